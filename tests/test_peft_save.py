"""Saving a PEFT model as users expect (issue 19, deliverable 4; ``runtime/peft_export.py``).

A tiny transformers Llama (GQA, MLP 90) wrapped by ``peft.get_peft_model`` (LoRA r=4 on attention and
MLP projections, gaussian init so the adapters matter from step 1) trains 4 steps on gloo ranks —
data 2 under ZeRO 0-3 — and then:

- ``engine.save_pretrained(dir)`` writes what ``peft_model.save_pretrained(dir)`` writes after the
  same 4 steps in one process: the same files, the same tensor names and shapes, values equal within
  1e-5, the same ``adapter_config.json``; ``PeftModel.from_pretrained(fresh base, dir)`` gives the
  one-process model's logits.
- ``engine.save_pretrained(dir, merged=True)`` writes a plain transformers folder with the tensor names
  of ``merge_and_unload().save_pretrained`` (no ``base_model.model.``, ``.base_layer``, ``lora_*``):
  ``AutoModelForCausalLM.from_pretrained(dir)`` gives the trained PEFT model's logits.
- ``engine.save(path, frozen=False)`` at data 2 ZeRO-3 writes no frozen parameter (the manifest's
  ``absent`` names them); ``engine.load`` of it at data 4 (ZeRO-1) keeps the engine's own frozen
  weights and the next steps' losses equal the saver's.

Refusals, on every rank before anything is written: an adapter save into a full model's folder or
over another adapter's config, a merged export into an adapter folder, to an integer dtype, or of a
model that is not a PEFT model; a frozen-less checkpoint loaded into an ``init=False`` engine with no
frozen values, or into one where a parameter it lacks is trainable.
"""

from __future__ import annotations

import json
import os

import torch

import hf_models
import shardlib as sl
from shardlib.runtime.checkpoint_files import CheckpointError
from shardlib.testing import get_mesh
from test_engine import max_rel

STEPS, BATCH, LR = 4, 8, 1e-2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DATA2 = [("zero0", {"data": 2}, 0), ("zero1", {"data": 2}, 1), ("zero2", {"data": 2}, 2),
         ("zero3", {"data": 2}, 3)]
_REF: dict = {}


def peft_llama(targets: list[str] = TARGETS):
    """The base (``hf_models.build("llama", layers=2)``, seed 0) wrapped by PEFT, adapters from seed 5."""
    from peft import LoraConfig, get_peft_model

    model = hf_models.build("llama", layers=2)
    torch.manual_seed(5)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                            init_lora_weights="gaussian"))


def _batches() -> list[dict]:
    return [hf_models.batch("llama", BATCH, 300 + s) for s in range(STEPS)]


def _probe() -> torch.Tensor:
    return hf_models.batch("llama", 3, 999)["input_ids"]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=_probe()).logits


def reference(root) -> dict:
    """One process: the PEFT model trained on the whole batches, its adapter folder and merged folder."""
    if not _REF:
        model = peft_llama()
        losses = hf_models.train_alone(model, _batches(), lr=LR)
        model.save_pretrained(root / "ref-adapter")
        logits = _logits(model)
        model.merge_and_unload().save_pretrained(root / "ref-merged")
        _REF.update(losses=losses, logits=logits, adapter=root / "ref-adapter", merged=root / "ref-merged")
    return _REF


def _opt(params):
    return hf_models.adamw(params, LR)


def _engine(shape: dict, zero: int, *, init: bool = True, model=None):
    model = peft_llama() if model is None else model
    plan = sl.plan(model, get_mesh(shape), zero=zero)
    return sl.parallelize(model, plan, optimizer=_opt, init=init)


# ---- in the workers -------------------------------------------------------------------------------

def train_save(runs: list[tuple[str, dict, int]], root: str) -> dict:
    """Per ``(tag, shape, zero)``: 4 steps, then the adapter folder and the merged folder under ``root/tag``."""
    out = {}
    for tag, shape, zero in runs:
        engine = _engine(shape, zero)
        losses = [engine.step(b) for b in _batches()]
        engine.save_pretrained(os.path.join(root, tag, "adapter"))
        engine.save_pretrained(os.path.join(root, tag, "merged"), merged=True)
        out[tag] = losses
    return out


def _refused(fn) -> str | None:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return None


def refusals(root: str) -> dict:
    """Each bad save, tried on every rank: the message (None where nothing was raised)."""
    engine = _engine({"data": 2}, 3)
    d = {k: os.path.join(root, k) for k in ("full", "other", "adapter", "plain")}
    out = {
        "full": _refused(lambda: engine.save_pretrained(d["full"])),
        "other": _refused(lambda: engine.save_pretrained(d["other"])),
        "merged_into_adapter": _refused(lambda: engine.save_pretrained(d["adapter"], merged=True)),
        "int8": _refused(lambda: engine.save_pretrained(os.path.join(root, "int8"), merged=True, dtype=torch.int8)),
    }
    plain = hf_models.build("llama", layers=2)
    eng2 = sl.parallelize(plain, sl.plan(plain, get_mesh({"data": 2})), optimizer=_opt)
    out["not_peft"] = _refused(lambda: eng2.save_pretrained(d["plain"], merged=True))
    return out


def save_frozenless(path: str, full: str) -> dict:
    """Data 2 ZeRO-3: 2 steps, ``save(path, frozen=False)`` and a full save, then 2 more steps."""
    engine = _engine({"data": 2}, 3)
    batches = _batches()
    losses = [engine.step(b) for b in batches[:2]]
    engine.save(path, frozen=False)
    engine.save(full)
    losses += [engine.step(b) for b in batches[2:]]
    frozen = [p for p in engine.global_plan.params if not p.trainable]
    return {"losses": losses, "frozen": sorted(p.name for p in frozen), "bytes": sum(4 * p.numel for p in frozen)}


def load_frozenless(path: str, shape: dict, zero: int) -> dict:
    """Another mesh: the engine built normally (its frozen values its own), ``load(path)``, 2 steps; and
    the refusals (init=False with nothing loaded; a parameter the checkpoint lacks made trainable)."""
    engine = _engine(shape, zero)
    engine.load(path)
    losses = [engine.step(b) for b in _batches()[2:]]
    empty = _engine(shape, zero, init=False)
    model = peft_llama()
    model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.requires_grad_(True)
    thawed = _engine(shape, zero, model=model)
    return {"losses": losses, "step": engine.step_count, "empty": _refused(lambda: empty.load(path)),
            "thawed": _refused(lambda: thawed.load(path))}


# ---- tests ----------------------------------------------------------------------------------------

def _tensors(file) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(file))


def _check_adapter(folder, ref: dict) -> None:
    from peft import PeftModel
    from safetensors import safe_open

    assert sorted(os.listdir(folder)) == sorted(os.listdir(ref["adapter"]))
    got, want = _tensors(folder / "adapter_model.safetensors"), _tensors(ref["adapter"] / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    cfg, rcfg = (json.loads((f / "adapter_config.json").read_text()) for f in (folder, ref["adapter"]))
    assert set(cfg.pop("target_modules")) == set(rcfg.pop("target_modules")) == set(TARGETS)
    assert cfg == rcfg
    model = PeftModel.from_pretrained(hf_models.build("llama", layers=2), str(folder))
    torch.testing.assert_close(_logits(model), ref["logits"], rtol=1e-5, atol=1e-5)


def _check_merged(folder, ref: dict) -> None:
    from transformers import AutoModelForCausalLM

    got, want = _tensors(folder / "model.safetensors"), _tensors(ref["merged"] / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert not any("base_layer" in k or "lora_" in k or k.startswith("base_model") for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)
    cfg, rcfg = (json.loads((f / "config.json").read_text()) for f in (folder, ref["merged"]))
    assert cfg == rcfg
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa")
    assert type(model).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(_logits(model), ref["logits"], rtol=1e-5, atol=1e-5)


def test_adapter_and_merged_from_data_layouts(world, tmp_path):
    ref = reference(tmp_path)
    results = world(2, train_save, DATA2, str(tmp_path))
    for tag, _, _ in DATA2:
        losses = [r[tag] for r in results]
        assert losses[0] == losses[1], tag
        assert max_rel(losses[0], ref["losses"]) <= 1e-5, (tag, losses[0], ref["losses"])
        _check_adapter(tmp_path / tag / "adapter", ref)
        _check_merged(tmp_path / tag / "merged", ref)


def test_refusals_before_writing(world, tmp_path):
    from peft import LoraConfig, get_peft_model

    hf_models.build("llama", layers=2).save_pretrained(tmp_path / "full")
    other = get_peft_model(hf_models.build("llama", layers=2), LoraConfig(r=4, target_modules=["q_proj"]))
    other.save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "adapter")
    before = {k: sorted(os.listdir(tmp_path / k)) for k in ("full", "other", "adapter")}
    results = world(2, refusals, str(tmp_path))
    for r in results:
        assert all(v is not None for v in r.values()), r
        assert "full model's files (config.json, model.safetensors)" in r["full"] and "another folder" in r["full"]
        assert "another adapter's" in r["other"] and "target_modules" in r["other"] and "remove it" in r["other"]
        assert "holds a PEFT adapter" in r["merged_into_adapter"]
        assert "merged export to dtype torch.int8" in r["int8"] and "dtype=torch.bfloat16" in r["int8"]
        assert "not a peft PeftModel" in r["not_peft"]
    assert {k: sorted(os.listdir(tmp_path / k)) for k in before} == before
    assert not (tmp_path / "int8").exists() and not (tmp_path / "plain").exists()


def test_frozenless_checkpoint_across_meshes(world, tmp_path):
    path, full = str(tmp_path / "lean"), str(tmp_path / "full")
    saved = world(2, save_frozenless, path, full)[0]
    manifest = json.loads((tmp_path / "lean" / "manifest.json").read_text())
    assert sorted(manifest["absent"]) == saved["frozen"] and len(saved["frozen"]) == 2 * 7 + 2 * 2 + 3
    assert not any(k.startswith(f"param/{n}") for k in manifest["tensors"] for n in saved["frozen"])
    assert all(f"param/{n}" in manifest["tensors"] for n in manifest["params"] if n not in saved["frozen"])

    def size(d):
        return sum(f.stat().st_size for f in (tmp_path / d).iterdir())
    assert size("full") - size("lean") >= saved["bytes"]         # the frozen values are not in it
    for got in world(4, load_frozenless, path, {"data": 4}, 1):
        assert got["step"] == 2 + 2
        assert max_rel(got["losses"], saved["losses"][2:]) <= 1e-5, (got["losses"], saved["losses"])
        assert "init=False" in got["empty"] and "load_pretrained" in got["empty"]
        assert "trainable in this engine" in got["thawed"] and "q_proj.base_layer.weight" in got["thawed"]
