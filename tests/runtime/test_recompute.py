"""Recompute policies: ``"selective"`` (attention's core) trains like one process on every axis, and
the activation bytes the planner states for none/selective/full are what a CPU step saves.

Parity: the reference GPT with ``recompute="selective"`` on data 2 (ZeRO-3), data 2 x tensor 2
(± sequence parallel), pipe 2 (1F1B, interleaved, ZB-H1, whose split backward recomputes the core in
B) and data 2 x pipe 2 x tensor 2, and a transformers Llama (SDPA, grouped-query attention) at
tensor 2 — losses within 1e-5 of one process, final weights equal, collectives as planned (the core
runs none).

Planned = measured: each block's ``PipelinePlan.block_saved`` (measured on the meta device at plan
time) against the bytes autograd saves in that block in a real step on CPU, counted by hooks around
each block's call on every rank.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import shardlib as sl
from shardlib.algebra.mesh import AbstractMesh
from shardlib.comm.recompute import SelectiveRecompute
from shardlib.errors import ShardingError
from shardlib.models.gpt import GPT, GPTConfig
from shardlib.planner.estimate import transformer_flops
from shardlib.planner.pipeline_report import saved_bytes
from shardlib.testing import get_mesh
from test_engine_data_parallel import check_parity, make_model, make_optimizer, reference_for, run_configs
from test_pipeline_training import _check as pipe_check, batches as pp_batches, PIPE, TP
from test_tensor_parallel import _check as tensor_check

SEL = "selective"


# ---- the core on its own -------------------------------------------------------------------------

@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_core_recomputed_gives_the_same_output_and_gradients(dropout):
    """Bit for bit: the forward, and the gradients of q, k, v after the core is run again in backward
    (with dropout, the forward's RNG state comes back: the same mask)."""
    q, k, v = (torch.randn(2, 4, 16, 8, requires_grad=True) for _ in range(3))

    def run(selective: bool):
        torch.manual_seed(7)
        mode = SelectiveRecompute() if selective else warnings.catch_warnings()
        with mode:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        torch.manual_seed(99)                       # backward must not read the RNG as it is now
        return out, torch.autograd.grad((out * out).sum(), (q, k, v)), getattr(mode, "calls", None)

    out, grads, _ = run(False)
    out_s, grads_s, calls = run(True)
    assert calls == 1
    assert torch.equal(out, out_s)
    for a, b in zip(grads, grads_s):
        assert torch.equal(a, b)


def test_core_keeps_only_its_inputs():
    """What the core saves: plain (fused CPU kernel) q, k, v, output and log-sum-exp; selective q, k,
    v only. On the meta device the planner's ``FusedOnMeta`` gives the CPU kernel's bytes (not the
    math decomposition's s x s scores)."""
    b, h, s, d = 2, 4, 32, 16
    qkv_bytes, out_bytes, lse_bytes = 3 * b * h * s * d * 4, b * h * s * d * 4, b * h * s * 4

    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for device in ("cpu", "meta"):
        q, k, v = (torch.empty(b, h, s, d, device=device, requires_grad=True) for _ in range(3))
        assert saved_bytes(attn, q, k, v) == qkv_bytes + out_bytes + lse_bytes, device
        with SelectiveRecompute():
            assert saved_bytes(attn, q, k, v) == qkv_bytes, device


def test_recompute_flops_full_redoes_the_layer_selective_the_core():
    """``transformer_flops`` on a one-layer case by hand: d=4, r=4, s=2, V=10, 3 tokens. Dense weights
    2·(4+8)·16 = 384 FLOPs per token, the core 4·2·4 = 32, the head 2·4·10 = 80. Training is 3x
    forward; full recompute 4x the layer's; selective 4x the core's only."""
    kw = dict(layers=1, d_model=4, seq=2, vocab=10, tokens=3)
    assert transformer_flops(**kw) == 3 * (3 * (384 + 32) + 3 * 80)
    assert transformer_flops(**kw, recompute="full") == 3 * (4 * (384 + 32) + 3 * 80)
    assert transformer_flops(**kw, recompute=True) == transformer_flops(**kw, recompute="full")
    assert transformer_flops(**kw, recompute=SEL) == 3 * (3 * 384 + 4 * 32 + 3 * 80)


def test_selective_block_bytes_by_hand():
    """One GPT block (d=32, 4 heads, MLP 128, rows·seq = n tokens) in fp32 at pipe 2, as planned:
    none saves ln1's input and stats, the attention (qkv input, q/k/v in one buffer, the kernel's
    output (a view of the proj input's storage) and log-sum-exp), the residual sum, ln2's input and
    stats, fc's input, gelu's input, out's input; selective drops only the log-sum-exp (the fused
    kernel keeps no s x s scores to drop); full keeps the block's input."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    rows, s, d, h, heads = 2, 16, 32, 128, 4
    n = rows * s
    with torch.device("meta"):
        model = GPT(cfg, seed=None)
    ids = torch.zeros(2 * rows, s, dtype=torch.long, device="meta")
    got = {rc: sl.plan(model, AbstractMesh({"pipe": 2}), rules=PIPE, batch=(ids, ids), microbatches=2,
                       recompute=rc).pipeline.block_saved for rc in ("none", SEL, "full")}
    ln = n * d * 4 + 2 * n * 4                      # input + mean and rstd (fp32)
    attention = n * d * 4 + 3 * n * d * 4 + n * d * 4 + rows * heads * s * 4   # ln1 out, qkv, out, lse
    mlp = n * d * 4 + n * h * 4 + n * h * 4         # ln2 out, fc out (gelu's input), gelu out
    none = 2 * ln + attention + mlp
    assert got["none"] == (none, none)
    assert got[SEL] == (none - rows * heads * s * 4,) * 2
    assert got["full"] == (n * d * 4,) * 2


def test_selective_needs_an_attention_core():
    """Attention written as separate ops (transformers' eager attention) has no core to recompute:
    the planner says so and names the fix."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, use_cache=False,
                      attn_implementation="eager", tie_word_embeddings=False, pad_token_id=None)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.zeros(4, 16, dtype=torch.long, device="meta")
    with pytest.raises(ShardingError, match=r"attn_implementation='sdpa'.*recompute='full'"):
        sl.plan(model, AbstractMesh({"pipe": 2}), rules={"layers": "pipe"},
                batch={"input_ids": ids, "labels": ids}, microbatches=2, recompute=SEL)


def test_an_unknown_recompute_value_is_a_type_error_listing_the_choices():
    with pytest.raises(sl.ShardingTypeError, match="recompute must be 'none', 'selective', 'full'"):
        sl.plan(make_model("gpt"), AbstractMesh({"data": 2}), recompute="attention")


# ---- parity with one process ---------------------------------------------------------------------

def test_selective_on_the_data_axis_trains_like_one_process(world):
    cfgs = [{"model": "gpt", "zero": z, "recompute": SEL} for z in (0, 3)]
    for cfg, results in zip(cfgs, run_configs(world, cfgs, 2)):
        check_parity(cfg, results, reference_for(cfg))


def test_selective_on_the_tensor_axis_trains_like_one_process(world):
    tensor_check(world, [{"zero": 3, "sp": True, "recompute": SEL},
                         {"zero": 1, "sp": False, "recompute": SEL, "grad_accum": 2}], {"data": 2, "tensor": 2})


def test_selective_on_the_pipe_axis_trains_like_one_process(world):
    pipe_check(world, [{"microbatches": 4, "schedule": "1f1b", "recompute": SEL},
                       {"microbatches": 4, "schedule": "zb_h1", "recompute": SEL},
                       {"microbatches": 4, "schedule": "interleaved_1f1b", "virtual_stages": 2,
                        "recompute": SEL}], {"data": 1, "pipe": 2})


def test_selective_on_three_axes_trains_like_one_process(world):
    pipe_check(world, [{"zero": 3, "microbatches": 2, "sp": True, "recompute": SEL}],
               {"data": 2, "pipe": 2, "tensor": 2})


def test_selective_on_a_transformers_llama_trains_like_one_process(world):
    """transformers' SDPA attention (grouped-query: 4 query heads over 2 key/value heads) is found
    and recomputed, at tensor 2 with sequence parallel."""
    from test_tensor_parallel_table import llama_runs, reference
    from test_engine_data_parallel import max_rel
    shape = {"data": 1, "tensor": 2}
    per_rank = world(2, llama_runs, [{"zero": 0, "sp": True, "recompute": SEL}], shape)
    ref = reference()
    for r in range(2):
        res = per_rank[r][0]
        assert max_rel(res["losses"], ref["losses"]) <= 1e-5, (res["losses"], ref["losses"])
        for name, want in ref["params"].items():
            torch.testing.assert_close(res["params"][name], want, rtol=1e-3, atol=4e-4)
        assert res["counted"] == res["planned"]


# ---- planned = measured --------------------------------------------------------------------------

class SavedPerBlock:
    """Bytes autograd saves inside each block's call in forward (not in a recompute during backward):
    storages counted once, the block's parameters not at all."""

    def __init__(self, blocks: dict[str, torch.nn.Module]):
        self.bytes: dict[str, list[int]] = {n: [] for n in blocks}
        self.handles = []
        for name, block in blocks.items():
            self.handles.append(block.register_forward_pre_hook(self._pre(name, block)))
            self.handles.append(block.register_forward_hook(self._post(name)))
        self.open: dict[str, tuple] = {}

    def _pre(self, name, block):
        def hook(module, args):
            if torch._C._current_graph_task_id() != -1 or not torch.is_grad_enabled():
                return                              # a recompute inside backward
            own = {p.untyped_storage()._cdata for p in block.parameters()}
            sizes: dict[int, int] = {}

            def pack(t):
                s = t.untyped_storage()
                if s._cdata not in own:
                    sizes[s._cdata] = s.nbytes()
                return t
            ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            ctx.__enter__()
            self.open[name] = (ctx, sizes)
        return hook

    def _post(self, name):
        def hook(module, args, out):
            if name in self.open:
                ctx, sizes = self.open.pop(name)
                ctx.__exit__(None, None, None)
                self.bytes[name].append(sum(sizes.values()))
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _measured(cfgs: list[dict], shape: dict) -> list[dict]:
    out = []
    for cfg in cfgs:
        mesh = get_mesh(shape)
        model = make_model("gpt_pp")
        data = pp_batches(1)
        rules = {**PIPE, **(TP if shape.get("tensor", 1) > 1 else {})}
        plan = sl.plan(model, mesh, rules=rules, batch=data[0], microbatches=2, zero=cfg.get("zero", 0),
                       sequence_parallel=cfg.get("sp", False), recompute=cfg["recompute"])
        engine = sl.parallelize(model, plan, optimizer=make_optimizer("sgd"))
        names = [b for s in plan.pipeline.stages for b in s.blocks]
        coord = mesh.coord(mesh.rank, "pipe")
        mods = dict(model.named_modules())
        mine = {b: mods[b] for s in plan.pipeline.stages if s.rank == coord for b in s.blocks}
        counter = SavedPerBlock(mine)
        engine.step(data[0])
        counter.remove()
        planned = dict(zip(names, plan.pipeline.block_saved))
        out.append({"planned": {n: planned[n] for n in mine}, "measured": counter.bytes})
    return out


@pytest.mark.parametrize("shape,extra", [({"pipe": 2}, {}), ({"pipe": 2, "tensor": 2}, {"sp": True}),
                                         ({"pipe": 2, "tensor": 2}, {"sp": False}),
                                         ({"data": 2, "pipe": 2}, {"zero": 3})])
def test_planned_activation_bytes_are_what_a_step_saves(world, shape, extra):
    cfgs = [{"recompute": rc, **extra} for rc in ("none", SEL, "full")]
    n = 1
    for v in shape.values():
        n *= v
    per_rank = world(n, _measured, cfgs, shape)
    for r in range(n):
        for cfg, res in zip(cfgs, per_rank[r]):
            assert res["planned"], f"rank {r} ran no block"
            for name, want in res["planned"].items():
                got = res["measured"][name]
                assert got and all(g == want for g in got), f"{cfg} {shape} rank {r} {name}: saved {got}, " \
                                                            f"planned {want}"


def test_whole_model_activations_follow_the_policy():
    """Without a pipe axis the dry run measures the whole model (``peak.activation_bytes(plan=)``):
    each block then saves what ``block_saved_bytes`` measures for it under the same policy (the
    embeddings, head and loss are the same under each; the largest buffer is counted once more)."""
    from shardlib.planner.peak import activation_bytes
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
    with torch.device("meta"):
        model = GPT(cfg, seed=None)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    whole, per_block = {}, {}
    for rc in ("none", SEL, "full"):
        whole[rc] = activation_bytes(model, (ids, ids), plan=sl.plan(model, AbstractMesh({"data": 2}), recompute=rc))
        per_block[rc] = sum(sl.plan(model, AbstractMesh({"pipe": 2}), rules=PIPE, batch=(ids, ids), microbatches=1,
                                    recompute=rc).pipeline.block_saved)
    # the largest buffer, counted once more: gelu's input (rows·s·4d fp32) while a block saves it, else
    # the logits (rows·s·V)
    largest = {"none": 2 * 16 * 128 * 4, SEL: 2 * 16 * 128 * 4, "full": 2 * 16 * 64 * 4}
    for rc in (SEL, "full"):
        assert (whole["none"] - whole[rc] == per_block["none"] - per_block[rc] + largest["none"] - largest[rc]
                and per_block["none"] > per_block[rc]), (rc, whole, per_block)
