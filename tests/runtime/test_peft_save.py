"""Saving a PEFT model as users expect (issue 19, deliverable 4; ``runtime/pretrained/peft_export.py``).

``tests/peft_models.py``'s LoRA models — a transformers Llama (GQA, MLP 90) and the reference GPT (no
transformers config), LoRA on attention and MLP projections, gaussian init so the adapters matter from
step 1 — train 4 steps on gloo ranks (Llama: data 2 under ZeRO 0-3, tensor 2, pipe 2 ZeRO-3, 2x2x2
ZeRO-3; GPT: data 2 ZeRO-3, tensor 2), losses equal to one process's within 1e-5, and then:

- ``engine.save_pretrained(dir)`` writes what ``peft_model.save_pretrained(dir)`` writes after the
  same steps in one process: the same files, tensor names, shapes, dtypes, metadata and
  ``adapter_config.json``; the adapters are the engine's bit for bit (and the one-process model's
  within the training's round-off); ``PeftModel.from_pretrained(fresh base, dir)`` holds them and gives
  the one-process model's logits.
- ``engine.save_pretrained(dir, merged=True)`` writes a plain folder under the base model's own names
  (those of ``merge_and_unload().save_pretrained``: no ``base_model.model.``, ``.base_layer``, ``lora_*``),
  the values ``merge_and_unload`` gives for the same adapters bit for bit; ``AutoModelForCausalLM.
  from_pretrained(dir)`` (GPT: ``load_state_dict(strict=True)``) gives the PEFT model's logits.
- ``engine.save(path, frozen=False)`` at data 2 ZeRO-3 writes no frozen parameter (the manifest's
  ``absent`` names them; the folder is smaller by at least their bytes); ``engine.load`` of it at data 4
  (ZeRO-1) and at tensor 2 keeps the engine's own frozen weights, and the next steps' losses equal the
  saver's.

On an int8 (torchao) and an int4 (``Int4Tensor``) base, at data 2 ZeRO-3 and tensor 2: the adapter
folder is the one-process model's, the merged folder the dequantized weights plus the adapters exactly,
and a whole checkpoint (the quantized weights as their codes and scales) and one without frozen weights
each resume on the other layout with the saver's losses.

Refusals, on every rank before anything is written: an adapter save into a full model's folder or
over another adapter's config, a merged export into an adapter folder or another architecture's, to an
integer dtype, or of a model that is not a PEFT model; a plain save of a non-PEFT model with quantized
weights; a frozen-less checkpoint loaded into an ``init=False`` engine with no frozen values, or into
one where a parameter it lacks is trainable.
"""

from __future__ import annotations

import json
import os

import torch

import hf_models
import peft_models
import shardlib as sl
from shardlib.models.gpt import token_batch
from shardlib.runtime.checkpoint.files import CheckpointError
from shardlib.testing import get_mesh
from test_engine_data_parallel import max_rel

# (tag, mesh shape, peft_models.engine's cfg): one world call per world size
LAYOUTS = {
    "llama": [("data2-zero0", {"data": 2}, {"zero": 0}), ("data2-zero1", {"data": 2}, {"zero": 1}),
              ("data2-zero2", {"data": 2}, {"zero": 2}), ("data2-zero3", {"data": 2}, {"zero": 3}),
              ("tensor2", {"data": 1, "tensor": 2}, {}), ("pipe2", {"data": 1, "pipe": 2}, {"schedule": "gpipe",
                                                                                          "zero": 3})],
    "gpt": [("data2-zero3", {"data": 2, "tensor": 1}, {"zero": 3}), ("tensor2", {"data": 1, "tensor": 2}, {})],
}
SHARDED = ("llama", "data2-zero3")      # also writes the merged folder sharded, and in bf16
LAYOUT_3D = [("3d", {"data": 2, "pipe": 2, "tensor": 2}, {"zero": 3})]
_REF: dict = {}


def _probe(kind: str):
    return hf_models.batch("llama", 3, 999)["input_ids"] if kind == "llama" else \
        token_batch(peft_models.GPT_CFG, 3, seed=999)[0]


def _logits(kind: str, model) -> torch.Tensor:
    with torch.no_grad():
        out = model.eval()(_probe(kind))
    return out.logits if kind == "llama" else out


def _loss(model, batch) -> torch.Tensor:
    return model(**batch).loss if isinstance(batch, dict) else model(*batch)


def reference(kind: str, root) -> dict:
    """One process: ``peft_models.lora(kind)`` trained on ``peft_models.batches(kind)``, its logits, its
    adapter folder (``save_pretrained``) and its merged weights (``merge_and_unload``)."""
    if kind not in _REF:
        model = peft_models.lora(kind)
        losses = hf_models.train_alone(model, peft_models.batches(kind), lr=peft_models.LR, loss=_loss)
        model.save_pretrained(root / f"ref-{kind}-adapter")
        logits = _logits(kind, model)
        plain = model.merge_and_unload()
        if kind == "llama":
            plain.save_pretrained(root / f"ref-{kind}-merged")
            plain.save_pretrained(root / f"ref-{kind}-merged-sharded", max_shard_size="40KB")
            plain.to(torch.bfloat16).save_pretrained(root / f"ref-{kind}-merged-bf16")
        _REF[kind] = {"losses": losses, "logits": logits, "adapter": root / f"ref-{kind}-adapter",
                      "merged": root / f"ref-{kind}-merged", "state": {k: v.clone() for k, v in
                                                                       plain.state_dict().items()}}
    return _REF[kind]


# ---- in the workers -------------------------------------------------------------------------------

def train_save(kind: str, runs: list[tuple[str, dict, dict]], root: str) -> dict:
    """Per ``(tag, shape, cfg)``: 4 steps, then the adapter folder and the merged folder under ``root/kind-tag``."""
    out = {}
    for tag, shape, cfg in runs:
        engine, _ = peft_models.engine(kind, cfg, shape)
        losses = [engine.step(b) for b in peft_models.batches(kind)]
        engine.save_pretrained(os.path.join(root, f"{kind}-{tag}", "adapter"))
        engine.save_pretrained(os.path.join(root, f"{kind}-{tag}", "merged"), merged=True)
        if (kind, tag) == SHARDED:
            engine.save_pretrained(os.path.join(root, f"{kind}-{tag}", "merged-sharded"), merged=True,
                                   max_shard_size="40KB")
            engine.save_pretrained(os.path.join(root, f"{kind}-{tag}", "merged-bf16"), merged=True,
                                   dtype=torch.bfloat16)
        full = engine.full_state_dict()
        out[tag] = {"losses": losses, "adapters": {k.replace(".default", ""): v for k, v in full.items()
                                                   if "lora_" in k} if engine.mesh.rank == 0 else None}
    return out


def _refused(fn) -> str | None:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return None


def _plain_engine(model, shape: dict, *, init: bool = True):
    return sl.parallelize(model, sl.plan(model, get_mesh(shape), zero=3), optimizer=peft_models.adamw, init=init)


def refusals(root: str) -> dict:
    """Each bad save, tried on every rank: the message (None where nothing was raised)."""
    engine, _ = peft_models.engine("llama", {"zero": 3}, {"data": 2})
    d = {k: os.path.join(root, k) for k in ("full", "other", "adapter", "plain", "int8", "gpt2")}
    out = {
        "full": _refused(lambda: engine.save_pretrained(d["full"])),
        "other": _refused(lambda: engine.save_pretrained(d["other"])),
        "merged_into_adapter": _refused(lambda: engine.save_pretrained(d["adapter"], merged=True)),
        "merged_into_gpt2": _refused(lambda: engine.save_pretrained(d["gpt2"], merged=True)),
        "int8": _refused(lambda: engine.save_pretrained(d["int8"], merged=True, dtype=torch.int8)),
    }
    plain = _plain_engine(peft_models.base("llama"), {"data": 2})
    out["not_peft"] = _refused(lambda: plain.save_pretrained(d["plain"], merged=True))
    quantized = _plain_engine(peft_models.base("llama", "int8"), {"data": 2})
    out["quantized"] = _refused(lambda: quantized.save_pretrained(d["plain"]))
    return out


def save_frozenless(path: str, full: str) -> dict:
    """Data 2 ZeRO-3: 2 steps, ``save(path, frozen=False)`` and a full save, then 2 more steps."""
    engine, plan = peft_models.engine("llama", {"zero": 3}, {"data": 2})
    batches = peft_models.batches("llama")
    losses = [engine.step(b) for b in batches[:2]]
    engine.save(path, frozen=False)
    engine.save(full)
    losses += [engine.step(b) for b in batches[2:]]
    frozen = [p for p in plan.params if not p.trainable]
    return {"losses": losses, "frozen": sorted(p.name for p in frozen), "bytes": sum(4 * p.numel for p in frozen)}


def load_frozenless(path: str, shape: dict, cfg: dict, refusals: bool) -> dict:
    """On ``shape``: the engine built normally (its frozen values its own), ``load(path)``, 2 steps; with
    ``refusals`` also the loads refused (init=False with nothing loaded; a frozen weight made trainable)."""
    engine, _ = peft_models.engine("llama", cfg, shape)
    engine.load(path)
    out = {"losses": [engine.step(b) for b in peft_models.batches("llama")[2:]], "step": engine.step_count}
    if refusals:
        empty = _plain_engine(peft_models.lora("llama"), shape, init=False)
        thawed = peft_models.lora("llama")
        thawed.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.requires_grad_(True)
        thawed = _plain_engine(thawed, shape)
        out.update(empty=_refused(lambda: empty.load(path)), thawed=_refused(lambda: thawed.load(path)))
    return out


QUANT_RUNS = [("int8", "data2-zero3", {"data": 2}, {"zero": 3}), ("int8", "tensor2", {"data": 1, "tensor": 2}, {}),
              ("int4", "data2-zero3", {"data": 2}, {"zero": 3}), ("int4", "tensor2", {"data": 1, "tensor": 2}, {})]
RESUME_ON = {"data2-zero3": "tensor2", "tensor2": "data2-zero3"}      # each checkpoint loaded on the other


def quant_save(runs: list[tuple], root: str) -> dict:
    """Per ``(quant, tag, shape, cfg)`` on a quantized base: 2 steps, a whole checkpoint and one without
    frozen weights, 2 more steps, the adapter folder and the merged folder, under ``root/quant-tag``."""
    out = {}
    for quant, tag, shape, cfg in runs:
        engine, _ = peft_models.engine("llama", cfg, shape, quant)
        batches, d = peft_models.batches("llama"), os.path.join(root, f"{quant}-{tag}")
        losses = [engine.step(b) for b in batches[:2]]
        engine.save(os.path.join(d, "whole"))
        engine.save(os.path.join(d, "lean"), frozen=False)
        losses += [engine.step(b) for b in batches[2:]]
        engine.save_pretrained(os.path.join(d, "adapter"))
        engine.save_pretrained(os.path.join(d, "merged"), merged=True)
        out[(quant, tag)] = losses
        out[(quant, tag, "int8")] = _refused(lambda: engine.save_pretrained(os.path.join(d, "int"), merged=True,
                                                                           dtype=torch.int8))
    return out


def quant_resume(runs: list[tuple], root: str) -> dict:
    """Each checkpoint of ``quant_save`` loaded on the other layout (``RESUME_ON``), 2 steps."""
    shapes = {tag: (shape, cfg) for _, tag, shape, cfg in runs}
    out = {}
    for quant, tag, _, _ in runs:
        shape, cfg = shapes[RESUME_ON[tag]]
        for kind in ("whole", "lean"):
            engine, _ = peft_models.engine("llama", cfg, shape, quant)
            engine.load(os.path.join(root, f"{quant}-{tag}", kind))
            out[(quant, tag, kind)] = [engine.step(b) for b in peft_models.batches("llama")[2:]]
    return out


# ---- tests ----------------------------------------------------------------------------------------

def _tensors(file) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(file))


def _check_adapter(kind: str, folder, ref: dict, held: dict[str, torch.Tensor]):
    """The folder is the one-process save's: the same files, names, shapes, dtypes and config; its
    adapters are the engine's (``held``, PEFT's names) bit for bit, and the one-process model's within
    the training's round-off (2e-5 absolute; under 5e-7 measured with ``hf_models.adamw``'s eps, which
    keeps Adam from blowing round-off up). ``from_pretrained`` of it holds the file's values bit for bit
    and gives the reference's logits (that round-off summed over every adapted layer: under 3e-5 measured
    on logits of about 0.3). Returns that model and its logits."""
    from peft import PeftModel
    from safetensors import safe_open

    assert sorted(os.listdir(folder)) == sorted(os.listdir(ref["adapter"]))
    got, want = _tensors(folder / "adapter_model.safetensors"), _tensors(ref["adapter"] / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and want
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=2e-5, msg=k)
        assert torch.equal(got[k], held[k]), k
    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    cfg, rcfg = (json.loads((f / "adapter_config.json").read_text()) for f in (folder, ref["adapter"]))
    assert set(cfg.pop("target_modules")) == set(rcfg.pop("target_modules")) == set(peft_models.TARGETS[kind])
    assert cfg == rcfg
    model = PeftModel.from_pretrained(peft_models.base(kind), str(folder))
    loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    assert all(torch.equal(loaded[k], got[k]) for k in got)
    logits = _logits(kind, model)
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-3, atol=5e-4)
    return model, logits


def _check_merged(kind: str, folder, ref: dict, unmerged, logits: torch.Tensor) -> None:
    """The folder holds the tensors ``merge_and_unload`` gives, under its names: the one-process
    model's names and config, the values of ``unmerged`` (the PEFT model of the same layout's adapter
    folder) merged in one process, bit for bit; it loads into the plain base model with the logits of
    those adapters unmerged (``logits``, within 1e-5: another order of the same sums)."""
    got = _tensors(folder / "model.safetensors")
    assert not any("base_layer" in k or "lora_" in k or k.startswith("base_model") for k in got)
    if kind == "llama":
        from transformers import AutoModelForCausalLM

        want = _tensors(ref["merged"] / "model.safetensors")
        cfg, rcfg = (json.loads((f / "config.json").read_text()) for f in (folder, ref["merged"]))
        assert cfg == rcfg
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa")
        assert type(model).__name__ == "LlamaForCausalLM"
    else:                     # no transformers config: the safetensors file loads into the plain model
        want = {k: v for k, v in ref["state"].items() if k in got}
        model = peft_models.base(kind)
        model.load_state_dict(got, strict=True)
    assert sorted(got) == sorted(want)
    merged = unmerged.merge_and_unload().state_dict()
    assert all(torch.equal(got[k], merged[k]) for k in got), [k for k in got if not torch.equal(got[k], merged[k])]
    torch.testing.assert_close(_logits(kind, model), logits, rtol=1e-5, atol=1e-5)


def _check_layouts(kind: str, root, runs: list, results: list[dict]) -> None:
    ref = reference(kind, root)
    for tag, _, _ in runs:
        losses = [r[tag]["losses"] for r in results]
        assert all(x == losses[0] for x in losses), tag
        assert max_rel(losses[0], ref["losses"]) <= 1e-5, (tag, losses[0], ref["losses"])
        unmerged, logits = _check_adapter(kind, root / f"{kind}-{tag}" / "adapter", ref, results[0][tag]["adapters"])
        _check_merged(kind, root / f"{kind}-{tag}" / "merged", ref, unmerged, logits)
        if (kind, tag) == SHARDED:
            _check_sharded_bf16(root / f"{kind}-{tag}", root / f"ref-{kind}")


def _check_sharded_bf16(folder, ref) -> None:
    """``max_shard_size`` and ``dtype`` as ``save_pretrained`` has them: the same shard files, index and
    config as the one-process model's, and bf16 tensors under the same names."""
    from safetensors import safe_open

    sharded, rsharded = folder / "merged-sharded", ref.parent / f"{ref.name}-merged-sharded"
    assert sorted(os.listdir(sharded)) == sorted(os.listdir(rsharded)) and \
        "model.safetensors.index.json" in os.listdir(sharded)
    index, rindex = (json.loads((f / "model.safetensors.index.json").read_text()) for f in (sharded, rsharded))
    assert index == rindex
    bf16, rbf16 = folder / "merged-bf16", ref.parent / f"{ref.name}-merged-bf16"
    assert json.loads((bf16 / "config.json").read_text()) == json.loads((rbf16 / "config.json").read_text())
    for f in (bf16, rbf16):
        with safe_open(str(f / "model.safetensors"), framework="pt") as h:
            assert all(h.get_slice(k).get_dtype() == "BF16" for k in h.keys())


def test_adapter_and_merged_saved_from_every_layout_equal_one_process(world, tmp_path):
    for kind, runs in LAYOUTS.items():
        _check_layouts(kind, tmp_path, runs, world(2, train_save, kind, runs, str(tmp_path)))


def test_adapter_and_merged_saved_from_3d_equal_one_process(world, tmp_path):
    _check_layouts("llama", tmp_path, LAYOUT_3D, world(8, train_save, "llama", LAYOUT_3D, str(tmp_path)))


def test_bad_save_targets_are_refused_before_anything_is_written(world, tmp_path):
    from peft import LoraConfig, get_peft_model

    hf_models.build("llama", layers=2).save_pretrained(tmp_path / "full")
    other = get_peft_model(hf_models.build("llama", layers=2), LoraConfig(r=4, target_modules=["q_proj"]))
    other.save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "adapter")
    hf_models.build("gpt2", layers=1).save_pretrained(tmp_path / "gpt2")
    before = {k: sorted(os.listdir(tmp_path / k)) for k in ("full", "other", "adapter", "gpt2")}
    mtime = (tmp_path / "gpt2" / "model.safetensors").stat().st_mtime
    results = world(2, refusals, str(tmp_path))
    for r in results:
        assert all(v is not None for v in r.values()), r
        assert "full model's files (config.json, model.safetensors)" in r["full"] and "another folder" in r["full"]
        assert "another adapter's" in r["other"] and "target_modules" in r["other"] and "remove it" in r["other"]
        assert "holds a PEFT adapter" in r["merged_into_adapter"]
        assert "another model's config.json — got model_type 'gpt2'" in r["merged_into_gpt2"]
        assert "merged export to dtype torch.int8" in r["int8"] and "dtype=torch.bfloat16" in r["int8"]
        assert "not a peft PeftModel" in r["not_peft"]
        assert "quantized weight(s)" in r["quantized"] and "peft.get_peft_model" in r["quantized"]
    assert {k: sorted(os.listdir(tmp_path / k)) for k in before} == before
    assert (tmp_path / "gpt2" / "model.safetensors").stat().st_mtime == mtime
    assert not (tmp_path / "int8").exists() and not (tmp_path / "plain").exists()


def test_checkpoint_without_frozen_weights_resumes_on_other_meshes(world, tmp_path):
    path, full = str(tmp_path / "lean"), str(tmp_path / "full")
    saved = world(2, save_frozenless, path, full)[0]
    manifest = json.loads((tmp_path / "lean" / "manifest.json").read_text())
    assert sorted(manifest["absent"]) == saved["frozen"] and len(saved["frozen"]) == 2 * 7 + 2 * 2 + 3
    assert not any(n in manifest["tensors"] for n in saved["frozen"])     # (tensors: DCP's names, a value's its own)
    assert all(n in manifest["tensors"] for n in manifest["params"] if n not in saved["frozen"])

    def size(d):
        return sum(f.stat().st_size for f in (tmp_path / d).iterdir())
    assert size("full") - size("lean") >= saved["bytes"]         # the frozen values are not in it
    loads = [world(4, load_frozenless, path, {"data": 4}, {"zero": 1}, True),
             world(2, load_frozenless, path, {"data": 1, "tensor": 2}, {}, False)]
    for got in [g for ranks in loads for g in ranks]:
        assert got["step"] == 2 + 2
        assert max_rel(got["losses"], saved["losses"][2:]) <= 1e-5, (got["losses"], saved["losses"])
    for got in loads[0]:
        assert "init=False" in got["empty"] and "load_pretrained" in got["empty"]
        assert "trainable in this engine" in got["thawed"] and "q_proj.base_layer.weight" in got["thawed"]


def _manual_merge(model) -> dict[str, torch.Tensor]:
    """``W + scaling · (B @ A)`` of every LoRA Linear of ``model`` (a PEFT model on a quantized base,
    which PEFT itself cannot merge without torchao's requantization config), W dequantized."""
    out = {}
    for name, mod in model.get_base_model().named_modules():
        if hasattr(mod, "lora_A"):
            w = mod.base_layer.weight
            w = w.dequantize() if hasattr(w, "qdata") else w
            out[f"{name}.weight"] = w.float() + (mod.lora_B["default"].weight @ mod.lora_A["default"].weight) \
                * mod.scaling["default"]
    return out


def test_quantized_base_saves_and_resumes(world, tmp_path):
    """int8 (torchao) and int4 (``Int4Tensor``) bases at data 2 ZeRO-3 and tensor 2: the adapter folder is
    the one-process model's; the merged folder holds the dequantized weights plus the adapters (a plain
    float Llama, no quantization config); a whole checkpoint (quantized weights as their codes and
    scales, in their own dtypes) and one without frozen weights each resume on the other layout with
    the saver's losses."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved = world(2, quant_save, QUANT_RUNS, str(tmp_path))[0]
    resumed = world(2, quant_resume, QUANT_RUNS, str(tmp_path))
    for quant, tag, _, _ in QUANT_RUNS:
        d, where = tmp_path / f"{quant}-{tag}", f"{quant} {tag}"
        ref = peft_models.reference("llama", quant)
        assert max_rel(saved[(quant, tag)], ref["losses"]) <= 1e-5, where
        qtype = {"int8": "Int8Tensor", "int4": "Int4Tensor"}[quant]
        assert f"merged export of a quantized ({qtype}) base to dtype torch.int8" in saved[(quant, tag, "int8")]
        assert not (d / "int").exists()
        got = _tensors(d / "adapter" / "adapter_model.safetensors")
        assert sorted(got) == sorted(k.replace(".default", "") for k in ref["adapters"]), where
        for k, want in ref["adapters"].items():
            torch.testing.assert_close(got[k.replace(".default", "")], want, rtol=1e-5, atol=2e-5)
        manifest = json.loads((d / "whole" / "manifest.json").read_text())
        qkeys = [k for k in manifest["tensors"] if k.startswith("_shardlib.quant.")]
        assert qkeys and not any("q_proj.base_layer" in k and not k.startswith(("_shardlib.", "optimizer."))
                                 for k in manifest["tensors"])
        assert not any(k.startswith("_shardlib.quant.")
                       for k in json.loads((d / "lean" / "manifest.json").read_text())["tensors"])
        for kind in ("whole", "lean"):
            for r in resumed:
                assert max_rel(r[(quant, tag, kind)], saved[(quant, tag)][2:]) <= 1e-5, (where, kind)
        peft = PeftModel.from_pretrained(peft_models.base("llama", quant), str(d / "adapter"))
        merged = _tensors(d / "merged" / "model.safetensors")
        assert not any("base_layer" in k or "lora_" in k for k in merged)
        for k, want in _manual_merge(peft).items():
            assert torch.equal(merged[k], want), (where, k)
        assert "quantization_config" not in json.loads((d / "merged" / "config.json").read_text())
        plain = AutoModelForCausalLM.from_pretrained(str(d / "merged"), dtype=torch.float32, attn_implementation="sdpa")
        torch.testing.assert_close(_logits("llama", plain), _logits("llama", peft), rtol=1e-5, atol=1e-5)
