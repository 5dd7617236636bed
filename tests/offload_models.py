"""Workers for the offload tests (issue 20): the reference GPT and a transformers Llama trained with the
optimizer's states on the host or on disk, next to the same run without offload, on one mesh.

``run`` returns, per configuration: the losses and final full state of the offloaded run and of the
plain one (compared bit for bit: same optimizer, same arithmetic), the collectives counted on the
second step against the plan's (offload adds none), the copies between memory kinds counted on the
second step against the plan's ``d2h``/``h2d``/``disk_*`` entries, and the bytes held per memory kind
against ``memory_per_rank(kind=)``.
"""

from __future__ import annotations

import collections
import logging
import tempfile

import torch

import hf_models
import shardlib as sl
from shardlib.models.gpt import GPT, GPTConfig, token_batch
from shardlib.planner.offload import COPY_OPS

STEPS, ROWS, LR = 3, 4, 1e-2
GPT_CFG = GPTConfig(vocab_size=67, seq_len=16, d_model=32, n_heads=4, n_layers=2, mlp_width=90)
logging.getLogger("torchao").setLevel(logging.ERROR)


def model(kind: str):
    if kind == "llama":
        return hf_models.build("llama", layers=2)
    if kind == "gpt":
        return GPT(GPT_CFG, seed=0)
    if kind == "lora":                         # LoRA over an int8 Llama (QLoRA): frozen, quantized base
        import peft_models as pm
        return pm.lora("llama", "int8")
    raise ValueError(kind)


def batches(kind: str) -> list:
    if kind in ("llama", "lora"):
        return [hf_models.batch("llama", ROWS, 300 + s, mask=s % 2 == 1) for s in range(STEPS)]
    return [token_batch(GPT_CFG, ROWS, seed=100 + s) for s in range(STEPS)]


def _loss(m, batch) -> torch.Tensor:
    return m(**batch).loss if isinstance(batch, dict) else m(*batch)


def engine(kind: str, cfg: dict, shape: dict, offload: dict | None, offload_dir: str | None = None):
    from shardlib.planner.hf_tp import tp_table
    from shardlib.testing import get_mesh

    mesh = get_mesh(shape)
    m = model(kind)
    kw: dict = {}
    if kind in ("llama", "lora") and shape.get("tensor", 1) > 1:
        sl.shard(tp_table(m))(m)
    rules = {"heads": "tensor", "mlp": "tensor"} if kind == "gpt" and "tensor" in shape else {}
    if shape.get("pipe", 1) > 1:
        rules["layers"] = "pipe"
        kw.update(microbatches=2, schedule=cfg.get("schedule", "1f1b"))
    plan = sl.plan(m, mesh, zero=cfg.get("zero", 0), sequence_parallel=cfg.get("sp", False),
                   precision=cfg.get("precision", "fp32"), batch=batches(kind)[0], rules=rules,
                   clip_grad_norm=cfg.get("clip"), grad_accum=cfg.get("accum", 1), offload=offload,
                   offload_dir=offload_dir, **kw)
    loss_fn = None if kind in ("llama", "lora") or shape.get("pipe", 1) > 1 else _loss
    return sl.parallelize(m, plan, optimizer=lambda ps: hf_models.adamw(ps, LR), loss_fn=loss_fn), plan


def train(kind: str, cfg: dict, shape: dict, offload: dict | None, offload_dir: str | None = None) -> dict:
    eng, plan = engine(kind, cfg, shape, offload, offload_dir)
    rank = eng.mesh.rank
    losses = []
    counted, copies = collections.Counter(), {}
    for i, b in enumerate(batches(kind)):
        with sl.count_collectives() as c:
            losses.append(eng.step(b))
        if i == 1:
            for r in c.records:
                counted[(r.op, r.axes)] += r.bytes
                counted[(r.op, r.axes, "n")] += 1
            copies = {op: sum(v[0] for (o, _), v in eng.copies.step.items() if o == op) for op in COPY_OPS}
    planned = collections.Counter()
    for e in plan.comm_per_step(rank):
        if e.op not in COPY_OPS:
            planned[(e.op, e.axes)] += e.total
            planned[(e.op, e.axes, "n")] += e.count
    kinds = ("device", "host", "disk")
    out = {"losses": losses, "state": eng.full_state_dict(), "counted": dict(counted), "planned": dict(planned),
           "copies": copies, "planned_copies": plan.copy_bytes_per_step(rank) if offload else {},
           "held": {k: eng.memory_held(kind=k) for k in kinds},
           "memory": {k: plan.memory_per_rank(rank, kind=k) for k in kinds}}
    for off in (eng.offload, eng.params_offload):
        if off is not None:
            off.close()
    return out


def run(kind: str, cfgs: list[dict], shape: dict, offloads: tuple = ("host", "disk")) -> list[dict]:
    """Per configuration: the plain run and one run per offload (``{name: results}``); an offload is a
    kind for the optimizer (``"host"``) or ``"optimizer=disk,params=host"``."""
    out = []
    for cfg in cfgs:
        res = {"none": train(kind, cfg, shape, None)}
        for name in offloads:
            off = dict(p.split("=") for p in name.split(",")) if "=" in name else {"optimizer": name}
            with tempfile.TemporaryDirectory() as d:
                res[name] = train(kind, cfg, shape, off, d if "disk" in off.values() else None)
        out.append(res)
    return out
