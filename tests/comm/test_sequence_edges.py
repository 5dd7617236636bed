"""Sequence parallelism's edges send Megatron-LM's bytes (issue 22 item 3; ``comm/boundaries.py``).

Where the layer stack meets the rest of the model at tensor ``t`` with SP, on a micro-batch of
``b`` rows of ``s`` tokens of width ``h`` (``e`` bytes an element; a ring over ``t`` ranks sends
``(t-1)/t`` of a tensor per rank for an all-gather or a reduce-scatter, ``2(t-1)/t`` for an all-reduce):

* **the head** (Megatron's output layer with ``sequence_parallel``: the final norm's output
  all-gathered, the gradient reduce-scattered; the final norm's weight gradients all-reduced over
  tensor): forward an all-gather of ``s·b·h``, backward one reduce-scatter of ``s·b·h`` — no
  all-reduce of ``s·b·h`` (before: the LM head's ``f`` all-reduced its input gradient, ``2(t-1)/t``
  of it) — plus the all-reduce of the final norm's parameters;
* **the embedding** (Megatron's ``reduce_scatter_embeddings``, where no position table is added to
  the word embedding, as in Llama): forward one reduce-scatter of ``s·b·h`` (before: an all-reduce),
  backward an all-gather of it. GPT-2-style ``wte + wpe`` keeps the all-reduce and the slice, as
  Megatron does for learned positions.

Checked on the plan's byte accounting (a small GPT and a transformers Llama, tensor 2) against those
formulas written out by hand, and by training at tensor 2 and at data 2 x tensor 2 (ZeRO-3): the
same losses and weights as one process, collectives counted = planned. A GPT whose loss also reads
the gathered stream and the final norm's output outside the LM head (a replicated value head, a
penalty on the stack's output) trains like one process too: those readers keep the replicated
gradient, only the head's partial one is reduce-scattered.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardlib as sl
from hf_models import train_alone
from llama import LLAMA_TP, LLAMA_VOCAB_TP, llama_batch, tiny_config, tiny_llama
from shardlib.models import GPT
from shardlib.testing import get_mesh
from test_engine_data_parallel import GPT_TP_CFG, make_batches, make_model, make_optimizer
from test_tensor_parallel import train_counting
from test_tensor_parallel_table import PARAM_TOL, check_ranks, llama_runs
from test_tensor_parallel_table import reference as llama_reference

RULES = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
T, E = 2, 4                       # tensor ranks; fp32


def _root(plan) -> list[tuple[str, str, str, int]]:
    """The tensor axis's collectives outside the blocks (the edges), in the order a step runs them."""
    return [(e.phase, e.what, e.op, e.bytes) for e in plan.activation_entries(0)
            if e.where == "<root>" and e.what != "loss"]


def _ring(n: int) -> int:
    """Bytes a rank sends in an all-gather or a reduce-scatter of ``n`` elements over T ranks."""
    return (T - 1) * n // T * E


def _all_reduce(n: int) -> int:
    """... in a ring all-reduce of ``n`` elements (``n`` divisible by T)."""
    return 2 * (T - 1) * n // T * E


def test_gpt_edges_are_megatrons():
    """GPT (learned positions: ``wte(idx) + wpe(pos)``), b=8, s=8, h=32: s·b·h = 2048 elements, 8 KiB.
    Embedding: all-reduce 8192 B, first unit's slice all-gathers 4096 B in backward (as Megatron with
    learned positions). Head: all-gather 4096 B forward, reduce-scatter 4096 B backward (was an
    all-reduce of 8192 B), the final LayerNorm's 2h = 64 parameters all-reduced: 256 B."""
    model = make_model("gpt_tp")
    plan = sl.plan(model, sl.AbstractMesh({"data": 1, "tensor": T}), rules=RULES, sequence_parallel=True,
                   batch=make_batches("gpt_tp", 1)[0])
    b, s, h = 8, GPT_TP_CFG.seq_len, GPT_TP_CFG.d_model
    sbh = s * b * h
    assert (sbh, _ring(sbh), _all_reduce(sbh), _all_reduce(2 * h)) == (2048, 4096, 8192, 256)
    assert _root(plan) == [
        ("forward", "activations", "all_reduce", _all_reduce(sbh)),      # wte's partial sums, + wpe
        ("backward", "activations", "all_gather", _ring(sbh)),           # the first unit's slice
        ("forward", "activations", "all_gather", _ring(sbh)),            # the last unit's output
        ("backward", "activations", "reduce_scatter", _ring(sbh)),       # its gradient, from the head
        ("backward", "sp-grads", "all_reduce", _all_reduce(2 * h)),      # ln_f's weight and bias
    ]


def test_llama_edges_are_megatrons():
    """transformers Llama (rotary positions: nothing added to the embedding), vocab-parallel embedding
    and head, b=4, s=16, h=32: s·b·h = 2048 elements. Embedding: one reduce-scatter of 4096 B forward
    (was an all-reduce of 8192 B), all-gather of 4096 B backward. Head: all-gather 4096 B forward,
    reduce-scatter 4096 B backward (was an all-reduce of 8192 B), the final RMSNorm's h = 32
    parameters all-reduced: 128 B."""
    model = tiny_llama()
    sl.shard({**LLAMA_TP, **LLAMA_VOCAB_TP})(model)
    cfg = tiny_config()
    plan = sl.plan(model, sl.AbstractMesh({"data": 1, "tensor": T}), sequence_parallel=True,
                   batch=llama_batch(cfg, 4, seed=0))
    b, s, h = 4, cfg.max_position_embeddings, cfg.hidden_size
    sbh = s * b * h
    assert (sbh, _ring(sbh), _all_reduce(h)) == (2048, 4096, 128)
    assert _root(plan) == [
        ("forward", "activations", "reduce_scatter", _ring(sbh)),        # the embedding into the first unit
        ("backward", "activations", "all_gather", _ring(sbh)),
        ("forward", "activations", "all_gather", _ring(sbh)),            # the last unit's output
        ("backward", "activations", "reduce_scatter", _ring(sbh)),       # its gradient, from lm_head
        ("backward", "sp-grads", "all_reduce", _all_reduce(h)),          # model.norm's weight
    ]
    # without SP the edges are Megatron's f and g: an all-reduce of s·b·h each way
    plain = sl.plan(model, sl.AbstractMesh({"data": 1, "tensor": T}), batch=llama_batch(cfg, 4, seed=0))
    assert _root(plain) == [("forward", "activations", "all_reduce", _all_reduce(sbh)),
                            ("backward", "activations", "all_reduce", _all_reduce(sbh))]


@pytest.mark.parametrize("shape", [{"data": 1, "tensor": 2}, {"data": 2, "tensor": 2}])
def test_llama_edges_train_like_one_process(world, shape):
    """The reduce-scattered embedding and the head's reduce-scatter: losses within 1e-5 relative of one
    process, final weights equal, each rank's counted collectives those planned (ZeRO-3 at data 2:
    the engine's own hooks on the first unit come after the reduce-scatter)."""
    cfgs = [{"zero": 0 if shape["data"] == 1 else 3, "sp": True, "vocab": True}]
    n = shape["data"] * shape["tensor"]
    per_rank = world(n, llama_runs, cfgs, shape)
    check_ranks([per_rank[r][0] for r in range(n)], llama_reference(), f"{shape}", **PARAM_TOL)


# ---- other readers of the gathered stream --------------------------------------------------------

class ValueGPT(GPT):
    """A GPT whose loss also reads the final hidden states outside the LM head: a replicated value head
    on the final norm's output and a penalty on the stack's output."""

    def __init__(self, seed: int = 0):
        super().__init__(GPT_TP_CFG, seed=seed)
        torch.manual_seed(seed + 1)
        self.value = nn.Linear(GPT_TP_CFG.d_model, 1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.pipeline_pre(idx, targets)
        for block in self.blocks:
            x = block(x)
        hidden = self.ln_f(x)
        logits = self.head(hidden)
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return ce + 0.1 * self.value(hidden).pow(2).mean() + 0.1 * x.pow(2).mean()


def _value_run(zero: int, shape: dict) -> dict:
    mesh = get_mesh(shape)
    model = ValueGPT()
    batches = make_batches("gpt_tp", 4)
    plan = sl.plan(model, mesh, zero=zero, rules=RULES, sequence_parallel=True, batch=batches[0])
    engine = sl.parallelize(model, plan, optimizer=make_optimizer("sgd_plain"))
    losses, counts = train_counting(engine, plan, batches)
    full = engine.full_state_dict()
    return {"losses": losses, "params": {n: full[n] for n, _ in model.named_parameters()}, **counts}


def _value_reference() -> dict:
    model = ValueGPT()
    losses = train_alone(model, make_batches("gpt_tp", 4), optimizer=make_optimizer("sgd_plain"),
                         loss=lambda m, batch: m(*batch))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("shape,zero", [({"data": 1, "tensor": 2}, 0), ({"data": 2, "tensor": 2}, 3)])
def test_other_readers_of_the_gathered_stream_stay_exact(world, shape, zero):
    """The value head and the penalty get the replicated gradient (each rank's whole), the LM head's
    partial one goes through the reduce-scatter: plain SGD's weights equal one process's (so the
    gradients are equal), counted collectives = planned."""
    n = shape["data"] * shape["tensor"]
    per_rank = world(n, _value_run, zero, shape)
    check_ranks(per_rank, _value_reference(), f"{shape}", rtol=1e-5, atol=1e-6)
