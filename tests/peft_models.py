"""PEFT LoRA models for the fine-tuning tests (issue 19): a transformers Llama (grouped-query attention
4/2, MLP 90: uneven at tensor 4) and the reference GPT (``shardlib.models.GPT``: ``sl.shard`` class
tables with logical dims, a protocol pipeline), each wrapped by ``peft.get_peft_model`` with LoRA on
the attention and MLP projections, and the one-process reference they must equal.

The adapters are drawn after ``torch.manual_seed(ADAPTER_SEED)`` with ``init_lora_weights=False`` (both A and B random: PEFT's "gaussian" still zeroes B, and
the adapters then change nothing at the first step), the same on every rank.
``quant`` quantizes the base's Linear layers before wrapping: ``"int8"`` (torchao
``Int8WeightOnlyConfig``) or ``"int4"`` (``shardlib.quant.quantize_int4_``, group 16).
"""

from __future__ import annotations

import logging

import torch

import hf_models
import shardlib as sl
from shardlib.models.gpt import GPT, GPTConfig, token_batch

ADAPTER_SEED, STEPS, ROWS, LR = 1, 4, 4, 1e-2
GPT_CFG = GPTConfig(vocab_size=67, seq_len=16, d_model=32, n_heads=4, n_layers=2, mlp_width=90)
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "gpt": ["qkv", "proj", "fc", "out"]}
GROUP = 16
# torchao's import logs that its CUDA kernels do not load on this CPU-only machine: harmless noise here
logging.getLogger("torchao").setLevel(logging.ERROR)


def base(kind: str, quant: str | None = None):
    """The base model of ``kind`` (``"llama"`` or ``"gpt"``), fp32, seed 0; quantized with ``quant``."""
    model = hf_models.build("llama", layers=2) if kind == "llama" else GPT(GPT_CFG, seed=0)
    if quant == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=_adapted(kind))
    elif quant == "int4":
        from shardlib.quant import quantize_int4_
        quantize_int4_(model, group_size=GROUP, filter_fn=_adapted(kind, GROUP))
    elif quant is not None:
        raise ValueError(quant)
    return model


def _adapted(kind: str, group: int = 1):
    """Quantize the layers LoRA adapts only (the embeddings and the LM head stay float), those whose
    in-features hold whole groups of ``group`` (Llama's down_proj, 90 wide, stays float in int4)."""
    return lambda module, fqn: (isinstance(module, torch.nn.Linear) and fqn.rpartition(".")[2] in TARGETS[kind]
                                and module.in_features % group == 0)


def lora(kind: str, quant: str | None = None, r: int = 4):
    """``get_peft_model(base(kind, quant), LoraConfig(r, alpha 2r, the kind's projections))``."""
    from peft import LoraConfig, get_peft_model

    model = base(kind, quant)
    torch.manual_seed(ADAPTER_SEED)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS[kind], lora_dropout=0.0,
                     init_lora_weights=False)
    return get_peft_model(model, cfg)


def batches(kind: str) -> list:
    if kind == "llama":
        return [hf_models.batch("llama", ROWS, 300 + s, mask=s % 2 == 1) for s in range(STEPS)]
    return [token_batch(GPT_CFG, ROWS, seed=100 + s) for s in range(STEPS)]


def _loss(model, batch) -> torch.Tensor:
    return model(**batch).loss if isinstance(batch, dict) else model(*batch)


def adamw(params):
    return hf_models.adamw(params, LR)


def adapters(state: dict) -> dict:
    return {k: v for k, v in state.items() if "lora_" in k}


def reference(kind: str, quant: str | None = None) -> dict:
    """Train the PEFT model in one process (AdamW on the trainable parameters): losses, the final
    adapters, the base state before training."""
    model = lora(kind, quant)
    before = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    losses = []
    for b in batches(kind):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, b)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "adapters": {k: v.detach().clone() for k, v in adapters(model.state_dict()).items()},
            "base": before}


def engine(kind: str, cfg: dict, shape: dict, quant: str | None = None):
    """``(engine, plan)`` of the PEFT model on a ``shape`` mesh; ``cfg``: ``zero``, ``sp``, ``schedule``,
    ``precision``."""
    from shardlib.planner.hf_tp import tp_table
    from shardlib.testing import get_mesh

    mesh = get_mesh(shape)
    model = lora(kind, quant)
    kw: dict = {}
    if kind == "llama" and shape.get("tensor", 1) > 1:
        sl.shard(tp_table(model))(model)
    rules = {"heads": "tensor", "mlp": "tensor"} if kind == "gpt" and "tensor" in shape else {}
    if shape.get("pipe", 1) > 1:
        rules["layers"] = "pipe"
    kw["rules"] = rules
    if shape.get("pipe", 1) > 1:
        kw.update(microbatches=2, schedule=cfg.get("schedule", "1f1b"))
    plan = sl.plan(model, mesh, zero=cfg.get("zero", 0), sequence_parallel=cfg.get("sp", False),
                   precision=cfg.get("precision", "fp32"), batch=batches(kind)[0], **kw)
    loss_fn = None if kind == "llama" or shape.get("pipe", 1) > 1 else _loss
    return sl.parallelize(model, plan, optimizer=adamw, loss_fn=loss_fn), plan


def run(kind: str, cfg: dict, shape: dict, quant: str | None = None) -> dict:
    """Train on every rank: losses, counted and planned collectives, the final adapters (full), and
    the names of base tensors that differ from the untrained model's (bit for bit)."""
    from test_tensor_parallel import train_counting

    eng, plan = engine(kind, cfg, shape, quant)
    losses, counts = train_counting(eng, plan, batches(kind))
    state = eng.full_state_dict()
    fresh = lora(kind, quant).state_dict()
    # mixed precision holds a frozen float weight in the compute dtype only (no fp32 master): compare so
    held = plan.compute_dtype if cfg.get("precision", "fp32") != "fp32" else torch.float32
    changed = [k for k, v in state.items() if "lora_" not in k
               and not torch.equal(_plain(v), _plain(fresh[k]) if _quantized(fresh[k])
                                   else fresh[k].to(held).to(v.dtype))]
    return {"losses": losses, "adapters": adapters(state), "changed": changed, **counts,
            "memory": plan.memory_per_rank(eng.mesh.rank), "held": eng.memory_held(),
            "gathered": (plan.transient_per_rank(eng.mesh.rank)["gathered"], eng.peak_gathered_bytes)}


def _quantized(t: torch.Tensor) -> bool:
    return hasattr(t, "qdata")


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if _quantized(t) else t


def runs(kind: str, cfgs: list[dict], shape: dict, quant: str | None = None) -> list[dict]:
    return [run(kind, c, shape, quant) for c in cfgs]

