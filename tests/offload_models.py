"""Workers for the offload tests (issue 20): the reference GPT and a transformers Llama trained with the
optimizer's states on the host or on disk, next to the same run without offload, on one mesh.

``run`` returns, per configuration: the losses and final full state of the offloaded run and of the
plain one (compared bit for bit: same optimizer, same arithmetic), the collectives counted on the
second step against the plan's (offload adds none), the copies between memory kinds counted on the
second step against the plan's ``d2h``/``h2d``/``disk_*`` entries, and the bytes held per memory kind
against ``memory_per_rank(kind=)``.
"""

from __future__ import annotations

import logging
import tempfile

import torch

import hf_models
import shardlib as sl
from shardlib.models.gpt import GPT, GPTConfig, token_batch
from shardlib.planner.offload import COPY_OPS

STEPS, ROWS, LR = 3, 4, 1e-2
GPT_CFG = GPTConfig(vocab_size=67, seq_len=16, d_model=32, n_heads=4, n_layers=2, mlp_width=90)
GPT4_CFG = GPTConfig(vocab_size=67, seq_len=16, d_model=32, n_heads=4, n_layers=4, mlp_width=90)
# routed experts (split over an expert axis) beside a shared one, DeepSeek-V3's bias balancing
MOE_CFG = GPTConfig(vocab_size=67, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4, top_k=2,
                    expert_width=24, shared_experts=1, aux_loss=0.05)
logging.getLogger("torchao").setLevel(logging.ERROR)


def model(kind: str):
    if kind == "llama":
        return hf_models.build("llama", layers=2)
    if kind == "gpt":
        return GPT(GPT_CFG, seed=0)
    if kind == "gpt4":                         # four blocks: interleaved stages at pipe 2
        return GPT(GPT4_CFG, seed=0)
    if kind == "moe":
        return GPT(MOE_CFG, seed=0)
    if kind == "lora":                         # LoRA over an int8 Llama (QLoRA): frozen, quantized base
        import peft_models as pm
        return pm.lora("llama", "int8")
    raise ValueError(kind)


def batches(kind: str) -> list:
    if kind in ("llama", "lora"):
        return [hf_models.batch("llama", ROWS, 300 + s, mask=s % 2 == 1) for s in range(STEPS)]
    return [token_batch(GPT_CFG, ROWS, seed=100 + s) for s in range(STEPS)]     # (GPT4_CFG: the same shapes)


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
    rules = {"heads": "tensor", "mlp": "tensor"} if kind in ("gpt", "moe") and "tensor" in shape else {}
    if "expert" in shape:
        rules["experts"] = "expert"
    if shape.get("pipe", 1) > 1:
        rules["layers"] = "pipe"
        kw.update(microbatches=cfg.get("microbatches", 2), schedule=cfg.get("schedule", "1f1b"))
        if "virtual" in cfg:
            kw["virtual_stages"] = cfg["virtual"]
    plan = sl.plan(m, mesh, zero=cfg.get("zero", 0), sequence_parallel=cfg.get("sp", False),
                   precision=cfg.get("precision", "fp32"), batch=batches(kind)[0], rules=rules,
                   clip_grad_norm=cfg.get("clip"), grad_accum=cfg.get("accum", 1), offload=offload,
                   offload_dir=offload_dir, **kw)
    loss_fn = None if kind in ("llama", "lora") or shape.get("pipe", 1) > 1 else _loss
    return sl.parallelize(m, plan, optimizer=lambda ps: hf_models.adamw(ps, LR), loss_fn=loss_fn), plan


def train(kind: str, cfg: dict, shape: dict, offload: dict | None, offload_dir: str | None = None) -> dict:
    from test_tensor_parallel import train_counting

    eng, plan = engine(kind, cfg, shape, offload, offload_dir)
    rank = eng.mesh.rank
    losses, counts = train_counting(eng, plan, batches(kind))
    # the copies of the last step (a steady one: the moments exist); the plan lists them beside the
    # collectives, which count_collectives does not see
    planned = {k: v for k, v in counts["planned"].items() if k[0] not in COPY_OPS}
    if kind == "moe":       # the ragged all-to-alls by count: their bytes follow the routing (planned: uniform)
        planned = {k: v for k, v in planned.items() if k[0] != "all_to_all" or k[-1] == "n"}
        counts["counted"] = {k: v for k, v in counts["counted"].items() if k[0] != "all_to_all" or k[-1] == "n"}
    copies = {op: sum(v[0] for (o, w), v in eng.copies.step.items() if o == op and w != "activations")
              for op in COPY_OPS}
    copies["activations"] = {o: v[0] for (o, w), v in eng.copies.step.items() if w == "activations"}
    kinds = ("device", "host", "disk")
    out = {"losses": losses, "state": eng.full_state_dict(), "counted": counts["counted"], "planned": planned,
           "copies": copies, "planned_copies": plan.copy_bytes_per_step(rank) if offload else {},
           "held": {k: eng.memory_held(kind=k) for k in kinds},
           "memory": {k: plan.memory_per_rank(rank, kind=k) for k in kinds + ("all",)}}
    for off in (eng.offload, eng.params_offload, eng.act_offload):
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


def reference(kind: str) -> list[float]:
    """The one-process run: losses of the same model, batches and AdamW."""
    return hf_models.train_alone(model(kind), batches(kind), lr=LR, loss=_loss)


def failed_write(cfg: dict, shape: dict, offload: dict) -> dict:
    """Step once, then make the second step's disk writes fail (as a full disk would): the step must
    raise ``OffloadError`` and leave the parameters and the offloaded states as they were; stepping the
    same batch again once the disk is back continues exactly as a run that never failed."""
    from shardlib.runtime.offload.files import DiskStore, OffloadError

    bs = batches("gpt")
    with tempfile.TemporaryDirectory() as d:
        eng, _ = engine("gpt", cfg, shape, offload, d)
        losses = [eng.step(bs[0])]
        before = eng.full_state_dict()
        real = DiskStore.write

        def full(self, gen, i, slot, lo, values):
            raise OSError(28, "No space left on device")

        DiskStore.write = full
        try:
            eng.step(bs[1])
            error = None
        except OffloadError as e:
            error = str(e)
        finally:
            DiskStore.write = real
        if "optimizer" not in offload:      # the device optimizer had stepped: refused until a load
            try:
                eng.step(bs[1])
                refused = None
            except sl.CheckpointError as e:
                refused = str(e)
            return {"error": error, "refused": refused}
        after = eng.full_state_dict()
        unchanged = [k for k in before if isinstance(before[k], torch.Tensor) and not torch.equal(before[k], after[k])]
        steps = eng.step_count
        losses += [eng.step(b) for b in bs[1:]]
        for off in (eng.offload, eng.params_offload, eng.act_offload):
            if off is not None:
                off.close()
    plain, _ = engine("gpt", cfg, shape, None)
    return {"error": error, "changed": unchanged, "step_count": steps, "losses": losses,
            "plain": [plain.step(b) for b in bs]}


def checkpoint_round(folder: str, save_cfg: dict, save_shape: dict, save_off: dict | None,
                     load_cfg: dict, load_shape: dict, load_off: dict | None, part: str) -> list[float]:
    """``part="save"``: step once on the saving layout and save; ``"load"``: load on the loading layout
    and step the remaining batches; ``"whole"``: the run without a break (no offload), for reference."""
    bs = batches("gpt")
    with tempfile.TemporaryDirectory() as d:
        if part == "whole":
            eng, _ = engine("gpt", load_cfg, load_shape, None)
            return [eng.step(b) for b in bs]
        cfg, shape, off = (save_cfg, save_shape, save_off) if part == "save" else (load_cfg, load_shape, load_off)
        eng, _ = engine("gpt", cfg, shape, off, d if off and "disk" in off.values() else None)
        if part == "save":
            losses = [eng.step(bs[0])]
            eng.save(folder)
        else:
            eng.load(folder)
            losses = [eng.step(b) for b in bs[1:]]
        for o in (eng.offload, eng.params_offload, eng.act_offload):
            if o is not None:
                o.close()
        return losses
