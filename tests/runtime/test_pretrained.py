"""Pretrained weights straight into the shards, and back out (issue 18, deliverables 3 and 4).

A tiny transformers Llama is built on the meta device, parallelized with ``init=False`` on data 2 x
tensor 2 (ZeRO-3, ``tests/llama.py``'s ``LLAMA_TP``) and given its values by
``engine.load_pretrained`` from folders its own ``save_pretrained`` wrote (one file and sharded,
fp32 and bf16 on disk); trained 4 steps with no ``loss_fn`` (the model's own loss) it gives the
losses of ``from_pretrained`` trained in one process, and ``engine.save_pretrained`` writes what
``model.save_pretrained`` writes (same files, tensor names, index, config) — ``from_pretrained`` of
it gives the one-process logits; GPT-2 too (Conv1D, the fused ``c_attn`` split by heads, tied
embeddings replicated), and under precision="bf16" its loaded fp32 masters are the file's values
bit for bit. The same round trip from data 2 ZeRO-3, tensor 2 and one process; the
reference GPT on pipe 2 (each rank allocating only its stage) from an exported safetensors file.
Peak memory while loading is measured (the kernel's high-water mark of each rank's RSS, reset before
the load) on a larger Llama: at most the largest tensor above what the rank holds at rest. Every bad
folder is refused by name before a value is written (a persistent buffer a meta build awaits too).
Failures on some ranks only: ``tests/runtime/test_pretrained_failures.py``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import hf_models
import shardlib as sl
from llama import LLAMA_TP, tiny_config
from shardlib.models.gpt import GPT, GPTConfig, token_batch
from shardlib.planner.hf_tp import tp_table
from shardlib.runtime.checkpoint.files import CheckpointError
from shardlib.testing import get_mesh, peak_rss, peak_rss_reset
from test_engine_data_parallel import max_rel

STEPS, BATCH, LR = 4, 4, 1e-2
GPT_CFG = GPTConfig(vocab_size=67, seq_len=16, d_model=32, n_heads=4, n_layers=4)


def _opt(params):
    return hf_models.adamw(params, LR)


def _batches() -> list[dict]:
    return [hf_models.batch("llama", BATCH, 300 + s) for s in range(STEPS)]


def _from_pretrained(folder):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").train()


def _reference(folder) -> tuple[list[float], torch.nn.Module]:
    """``from_pretrained`` trained ``STEPS`` steps in one process: its losses and the model."""
    model = _from_pretrained(folder)
    return hf_models.train_alone(model, _batches(), lr=LR), model


def _write_sources(root, family: str = "llama") -> dict[str, tuple[str, str | None]]:
    """Folders written by the model's own save_pretrained: ``{case: (folder, max_shard_size)}``."""
    model = hf_models.build(family, seed=0)
    out = {}
    model.save_pretrained(root / f"{family}-f32")
    out["f32"] = (str(root / f"{family}-f32"), None)
    model.save_pretrained(root / f"{family}-sharded", max_shard_size="60KB")
    out["sharded"] = (str(root / f"{family}-sharded"), "60KB")
    model.to(torch.bfloat16).save_pretrained(root / f"{family}-bf16")
    out["bf16"] = (str(root / f"{family}-bf16"), None)
    return out


# ---- in the workers -------------------------------------------------------------------------------

def _engine(shape: dict, zero: int, *, meta: bool = True, init: bool = False, family: str = "llama",
            precision: str = "fp32"):
    mesh = get_mesh(shape)
    model = hf_models.build(family, seed=1, meta=meta)
    if shape.get("tensor", 1) > 1:       # GPT-2: Conv1D and the fused c_attn split, tied embeddings replicated
        sl.shard(LLAMA_TP if family == "llama" else tp_table(model))(model)
    rules = {}
    if shape.get("pipe", 1) > 1:           # the layer stack named by a table entry, cut by a rule
        sl.shard({"model.layers": ("layers",)})(model)
        rules = {"rules": {"layers": "pipe"}, "microbatches": 2}
    plan = sl.plan(model, mesh, zero=zero, precision=precision, **rules)
    return sl.parallelize(model, plan, optimizer=_opt, init=init)


def load_train_save(cases: list[tuple], shape: dict, zero: int, bad: str | None) -> dict:
    """Per case ``(folder, max_shard_size, dst[, family])``: meta build, init=False, (a refused load of
    ``bad`` first, Llama only), load, 4 steps, save."""
    out = {}
    for src, size, dst, *family in cases:
        family = family[0] if family else "llama"
        engine = _engine(shape, zero, family=family)
        refused = None
        if bad is not None and family == "llama":
            try:
                engine.load_pretrained(bad)
            except CheckpointError as e:
                refused = str(e)
        engine.load_pretrained(src)
        losses = [engine.step(b) for b in _batches()]
        engine.save_pretrained(dst, **({"max_shard_size": size} if size else {}))
        full = engine.full_state_dict()
        out[dst] = {"losses": losses, "refused": refused, "full": full if get_mesh(shape).rank == 0 else None}
    return out


def layouts(runs: list[tuple[list[tuple], dict, int]]) -> list[dict]:
    """``load_train_save`` for each ``(cases, shape, zero)`` in one world call."""
    return [load_train_save(cases, shape, zero, None) for cases, shape, zero in runs]


def load_bf16(src: str, shape: dict) -> dict:
    """precision="bf16" (fp32 masters, bf16 compute) on ``shape``, ZeRO-3: the masters right after the
    load (``full_state_dict``, rank 0) and the losses of 2 steps."""
    engine = _engine(shape, 3, family="gpt2", precision="bf16")
    engine.load_pretrained(src)
    full = engine.full_state_dict()
    losses = [engine.step(b) for b in _batches()[:2]]
    return {"full": full if get_mesh(shape).rank == 0 else None, "losses": losses}


def dp2tp2(cases: list[tuple], shape: dict, zero: int, bad: str, bf16_src: str) -> dict:
    return {"cases": load_train_save(cases, shape, zero, bad), "bf16": load_bf16(bf16_src, shape)}


def load_peak(folder: str, shape: dict) -> dict:
    """The peak RSS a load adds to what the rank holds at rest (kernel high-water mark, reset first)."""
    mesh = get_mesh(shape)
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(_big_config())
    sl.shard(LLAMA_TP)(model)
    engine = sl.parallelize(model, sl.plan(model, mesh, zero=3), optimizer=_opt, init=False)
    held = sum((s.hi - s.lo) * 4 for s in engine.states)          # this rank's fp32 pieces
    before = peak_rss_reset()
    engine.load_pretrained(folder)
    peak = peak_rss() - before
    ids = torch.randint(0, 2048, (4, 16), generator=torch.Generator().manual_seed(0))
    loss = engine.step({"input_ids": ids, "labels": ids})
    return {"peak": peak, "held": held, "loss": loss}


def _big_config():
    return tiny_config(vocab=2048, hidden=256, intermediate=704, heads=8, kv_heads=4, layers=6)


# ---- tests ----------------------------------------------------------------------------------------

def _same_files(ours, theirs) -> None:
    """Our folder holds what transformers' save_pretrained writes: files, tensor names, shapes, dtypes,
    index and config."""
    from safetensors import safe_open

    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    for name in os.listdir(theirs):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(ours, name), "pt") as a, safe_open(os.path.join(theirs, name), "pt") as b:
                assert sorted(a.keys()) == sorted(b.keys()), name
                assert a.metadata() == b.metadata()
                for k in b.keys():
                    sa, sb = a.get_slice(k), b.get_slice(k)
                    assert (sa.get_shape(), sa.get_dtype()) == (sb.get_shape(), sb.get_dtype()), k
        elif name.endswith(".json"):
            with open(os.path.join(ours, name)) as fa, open(os.path.join(theirs, name)) as fb:
                assert json.load(fa) == json.load(fb), name


def _check_round_trip(per_rank: list[dict], sources: dict, root, tag: str, family: str = "llama") -> None:
    for case, (folder, size) in sources.items():
        want, trained = _reference(folder)
        dst = str(root / f"{tag}-{case}")
        for r, res in enumerate(per_rank):
            got = res[dst]["losses"]
            assert max_rel(got, want) <= 1e-5, f"{tag} {case} rank {r}: {got} vs {want}"
        # transformers' own save of the trained weights, from a model whose tensors own their storage
        # (from_pretrained leaves views of one buffer, which huggingface_hub's split keeps together)
        fresh = hf_models.build(family)
        fresh.load_state_dict(trained.state_dict())
        fresh.save_pretrained(root / f"hf-{tag}-{case}", **({"max_shard_size": size} if size else {}))
        _same_files(dst, root / f"hf-{tag}-{case}")
        back = _from_pretrained(dst)
        for k, v in back.state_dict().items():         # the file holds the engine's values exactly
            assert torch.equal(v, per_rank[0][dst]["full"][k]), f"{tag} {case}: {k}"
        b = hf_models.batch("llama", 2, 77)
        with torch.no_grad():     # round-off over 4 steps (1.8e-6 measured at data 2 x tensor 2; hf_models.adamw)
            torch.testing.assert_close(back(**b).logits, trained(**b).logits, rtol=1e-4, atol=1e-4)


def test_meta_build_loads_into_data2_tensor2_zero3_and_saves_back(world, tmp_path):
    """Meta build + init=False + load_pretrained on data 2 x tensor 2 ZeRO-3 (one file, sharded, bf16 on
    disk): one process's losses on every rank; save_pretrained writes transformers' own files, and
    from_pretrained of them gives the one-process logits. A refused load first leaves nothing behind.
    The same for GPT-2 (``tp_table``: Conv1D and the fused q|k|v ``c_attn`` split by heads, the tied
    embeddings replicated); and GPT-2 under precision="bf16": the loaded fp32 masters are the file's
    values bit for bit, and 2 steps give fp32's losses within 2e-3 (bf16 compute; 1e-4 measured)."""
    from safetensors.torch import load_file

    sources = _write_sources(tmp_path)
    gpt2 = {k: v for k, v in _write_sources(tmp_path, "gpt2").items() if k != "bf16"}
    bad = tmp_path / "bad"
    _drop_tensor(sources["f32"][0], bad, "model.layers.1.mlp.up_proj.weight")
    cases = [(folder, size, str(tmp_path / f"dp2tp2-{case}")) for case, (folder, size) in sources.items()]
    cases += [(folder, size, str(tmp_path / f"dp2tp2-gpt2-{case}"), "gpt2") for case, (folder, size) in gpt2.items()]
    per_rank = world(4, dp2tp2, cases, {"data": 2, "tensor": 2}, 3, str(bad), gpt2["f32"][0])
    for res in per_rank:
        for dst, got in res["cases"].items():
            if "gpt2" not in dst:
                assert got["refused"] and "model.layers.1.mlp.up_proj.weight" in got["refused"], got["refused"]
    _check_round_trip([r["cases"] for r in per_rank], sources, tmp_path, "dp2tp2")
    _check_round_trip([r["cases"] for r in per_rank], gpt2, tmp_path, "dp2tp2-gpt2", "gpt2")
    file = load_file(f"{gpt2['f32'][0]}/model.safetensors")
    masters = per_rank[0]["bf16"]["full"]
    for k, v in file.items():
        assert masters[k].dtype == torch.float32 and torch.equal(masters[k], v), f"bf16: {k}"
    assert torch.equal(masters["lm_head.weight"], file["transformer.wte.weight"])       # tied
    want = _reference(gpt2["f32"][0])[0][:2]
    print("bf16 vs fp32 losses:", per_rank[0]["bf16"]["losses"], want)
    for r, res in enumerate(per_rank):
        assert res["bf16"]["losses"] == per_rank[0]["bf16"]["losses"], f"bf16: rank {r} differs from rank 0"
        assert max_rel(res["bf16"]["losses"], want) <= 2e-3, f"bf16: {res['bf16']['losses']} vs fp32 {want}"


def test_round_trip_from_data2_zero3_tensor2_and_one_process(world, tmp_path):
    """The save_pretrained round trip from data 2 ZeRO-3 and from tensor 2 alone (one world call), and
    from one process."""
    sources = {k: v for k, v in _write_sources(tmp_path).items() if k != "bf16"}
    runs = [([(folder, size, str(tmp_path / f"{tag}-{case}")) for case, (folder, size) in sources.items()],
             shape, zero) for tag, shape, zero in (("dp2", {"data": 2}, 3), ("tp2", {"data": 1, "tensor": 2}, 0))]
    per_rank = world(2, layouts, runs)
    _check_round_trip([r[0] for r in per_rank], sources, tmp_path, "dp2")
    _check_round_trip([r[1] for r in per_rank], sources, tmp_path, "tp2")
    cases = [(folder, size, str(tmp_path / f"one-{case}")) for case, (folder, size) in sources.items()]
    _check_round_trip([load_train_save(cases, {"data": 1}, 0, None)], sources, tmp_path, "one")


def test_peak_memory_while_loading_is_one_tensor_above_the_shards(world, tmp_path):
    """A 6-layer Llama (5.6M parameters, 22 MB) on data 2 x tensor 2 ZeRO-3: each rank's RSS high-water
    mark while loading exceeds what it held before the load by at most the largest tensor (the
    embedding, 2 MB) plus 1 MB of slack for the allocator and Python; the pieces it holds are under a third."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_big_config())
    model.save_pretrained(tmp_path / "big", max_shard_size="8MB")
    total = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    per_rank = world(4, load_peak, str(tmp_path / "big"), {"data": 2, "tensor": 2})
    print("load peak above the rank's states (B):", [r["peak"] for r in per_rank], "largest", largest,
          "pieces", [r["held"] for r in per_rank], "of", total)
    for r, res in enumerate(per_rank):
        assert res["peak"] <= largest + (1 << 20), f"rank {r}: loading added {res['peak']} B; largest {largest}"
        # a quarter of the tensor-split weights, half of the embedding and head (split over data only)
        assert res["held"] <= total / 3, f"rank {r}: holds {res['held']} B of {total}"
        assert torch.isfinite(torch.tensor(res["loss"]))


def test_meta_llama_loads_under_pipe2(world, tmp_path):
    """A transformers Llama on pipe 2 (and data 2 x pipe 2 ZeRO-3), built on meta, each rank allocating
    only its stage: one process's losses; save_pretrained round trip."""
    sources = {k: v for k, v in _write_sources(tmp_path).items() if k != "bf16"}
    cases = [(folder, size, str(tmp_path / f"pp2-{case}")) for case, (folder, size) in sources.items()]
    _check_round_trip(world(2, load_train_save, cases, {"data": 1, "pipe": 2}, 0, None), sources, tmp_path, "pp2")
    cases = [(folder, size, str(tmp_path / f"dp2pp2-{case}")) for case, (folder, size) in sources.items()]
    _check_round_trip(world(4, load_train_save, cases, {"data": 2, "pipe": 2}, 3, None), sources, tmp_path,
                      "dp2pp2")


# ---- pipe 2: the reference GPT, each rank allocating only its stage --------------------------------

def _gpt_batches():
    return [token_batch(GPT_CFG, 8, 500 + s) for s in range(STEPS)]


def gpt_pipe(file: str, dst: str, shape: dict, zero: int) -> dict:
    mesh = get_mesh(shape)
    with torch.device("meta"):
        model = GPT(GPT_CFG, seed=None)
    plan = sl.plan(model, mesh, rules={"layers": "pipe"}, microbatches=2, zero=zero)
    engine = sl.parallelize(model, plan, optimizer=_opt, init=False)
    allocated = sum(s.plan.numel for s in engine.states)
    engine.load_pretrained(file)
    losses = [engine.step(b) for b in _gpt_batches()]
    engine.save_pretrained(dst)
    return {"losses": losses, "allocated": allocated}


def test_meta_gpt_loads_under_pipe2(world, tmp_path):
    """The reference GPT (no transformers config) on pipe 2 and data 2 x pipe 2 ZeRO-3: built on meta,
    each rank allocating only its stage, loaded from a safetensors file engine.export wrote; one
    process's losses; save_pretrained writes model.safetensors only, the one-process weights."""
    from safetensors.torch import load_file

    source = GPT(GPT_CFG, seed=0)
    eng = sl.parallelize(source, sl.plan(source, sl.Mesh({"data": 1})), optimizer=_opt)
    eng.export(tmp_path / "gpt.safetensors")
    ref = GPT(GPT_CFG, seed=0)
    want = hf_models.train_alone(ref, _gpt_batches(), lr=LR, loss=lambda m, b: m(*b))
    total = sum(p.numel() for p in ref.parameters())
    for shape, zero in (({"data": 1, "pipe": 2}, 0), ({"data": 2, "pipe": 2}, 3)):
        dst = tmp_path / f"out-{shape['data']}"
        per_rank = world(shape["data"] * 2, gpt_pipe, str(tmp_path / "gpt.safetensors"), str(dst), shape, zero)
        for r, res in enumerate(per_rank):
            assert max_rel(res["losses"], want) <= 1e-5, f"{shape} rank {r}: {res['losses']} vs {want}"
            assert res["allocated"] < 0.75 * total, f"{shape} rank {r}: {res['allocated']} of {total}"
        assert sorted(os.listdir(dst)) == ["model.safetensors"]
        saved = load_file(dst / "model.safetensors")
        for name, p in ref.named_parameters():
            torch.testing.assert_close(saved[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


# ---- bad input: refused by name, nothing half-loaded ----------------------------------------------

def _drop_tensor(src, dst, name: str, **edits) -> None:
    """Copy folder ``src`` to ``dst`` without tensor ``name`` (or with ``edits``: name -> new tensor)."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    sd = load_file(os.path.join(dst, "model.safetensors"))
    if name:
        del sd[name]
    sd.update(edits)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def _values(engine) -> dict:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    hf_models.build("llama", seed=0, layers=2).save_pretrained(root / "good")
    return root


def _bad_folders(root) -> dict:
    good = root / "good"
    out = {}
    _drop_tensor(good, root / "missing", "model.norm.weight")
    out["missing"] = (root / "missing", "holds no tensor 'model.norm.weight'")
    _drop_tensor(good, root / "shape", "", **{"model.norm.weight": torch.ones(31)})
    out["shape"] = (root / "shape", "has shape [31] — expected [32]")
    _drop_tensor(good, root / "dtype", "", **{"model.norm.weight": torch.ones(32, dtype=torch.int32)})
    out["dtype"] = (root / "dtype", "is I32 — expected a float dtype")
    _drop_tensor(good, root / "extra", "", **{"model.layers.9.mlp.up_proj.weight": torch.ones(2)})
    out["extra"] = (root / "extra", "does not have")
    import shutil
    shutil.copytree(good, root / "truncated")
    f = root / "truncated" / "model.safetensors"
    os.truncate(f, f.stat().st_size - 100)
    out["truncated"] = (root / "truncated", "truncated")
    hf_models.build("gpt2", seed=0, layers=2).save_pretrained(root / "gpt2")
    out["architecture"] = (root / "gpt2", "holds a 'gpt2' model (GPT2LMHeadModel) — expected 'llama' (LlamaForCausalLM)")
    hf_models.build("llama", seed=0, layers=2).save_pretrained(root / "index", max_shard_size="20KB")
    os.remove(root / "index" / "model-00002-of-00008.safetensors")
    out["shard missing"] = (root / "index", "lists ['model-00002-of-00008.safetensors'], not in")
    out["no folder"] = (root / "nowhere", "does not exist")
    return out


def test_bad_folders_are_refused_before_any_value_is_written(folder):
    """A missing tensor, another shape, an int dtype, an extra tensor (strict), a truncated file, another
    architecture, a missing shard, no folder: each a CheckpointError naming it; the values (a model
    built normally, load over random init) are unchanged after the refusal."""
    mesh = sl.Mesh({"data": 1})
    model = hf_models.build("llama", seed=3, layers=2)
    engine = sl.parallelize(model, sl.plan(model, mesh, zero=0), optimizer=_opt)
    before = _values(engine)
    for case, (path, words) in _bad_folders(folder).items():
        with pytest.raises(CheckpointError, match="load_pretrained") as err:
            engine.load_pretrained(path)
        assert words in str(err.value), f"{case}: {err.value}"
        for k, v in _values(engine).items():
            assert torch.equal(v, before[k]), f"{case}: {k} changed"
    engine.load_pretrained(folder / "extra", strict=False)         # extra tensors ignored on request
    loaded = _values(engine)
    ref = hf_models.build("llama", seed=0, layers=2)
    for k, v in ref.state_dict().items():
        assert torch.equal(loaded[k], v), k


def test_load_after_a_step_and_a_step_before_a_load_are_refused(folder):
    mesh = sl.Mesh({"data": 1})
    model = hf_models.build("llama", seed=3, layers=2, meta=True)
    engine = sl.parallelize(model, sl.plan(model, mesh, zero=3), optimizer=_opt, init=False)
    with pytest.raises(sl.ShardingError, match=r"init=False .* engine.load_pretrained\(folder\)"):
        engine.step(hf_models.batch("llama", 2, 0))
    with pytest.raises(sl.ShardingError, match="save_pretrained: the engine was built with init=False"):
        engine.save_pretrained(folder / "never")
    engine.load_pretrained(folder / "good")
    engine.step(hf_models.batch("llama", 2, 0))
    with pytest.raises(CheckpointError, match="has taken 1 step"):
        engine.load_pretrained(folder / "good")
    engine.save(folder / "ckpt")                 # a training checkpoint is a load too
    again = hf_models.build("llama", seed=4, layers=2, meta=True)
    again = sl.parallelize(again, sl.plan(again, mesh, zero=3), optimizer=_opt, init=False)
    again.load(folder / "ckpt")
    b = hf_models.batch("llama", 2, 1)
    assert again.step(b) == engine.step(b)


def test_init_false_drops_built_values_and_unlabelled_steps_are_refused(folder):
    """init=False on a model with values: they are dropped, the load gives the folder's; a transformers
    model called without labels (no .loss) is refused naming the fix."""
    mesh = sl.Mesh({"data": 1})
    model = hf_models.build("llama", seed=3, layers=2)
    engine = sl.parallelize(model, sl.plan(model, mesh, zero=0), optimizer=_opt, init=False)
    engine.load_pretrained(folder / "good")
    ref = hf_models.build("llama", seed=0, layers=2)
    for k, v in ref.state_dict().items():
        assert torch.equal(engine.full_state_dict()[k], v), k
    with pytest.raises(sl.ShardingTypeError, match="no loss — expected labels"):
        engine.step({"input_ids": hf_models.batch("llama", 2, 0)["input_ids"]})


@pytest.mark.parametrize("family,tie", [("llama", True), ("gpt2", None), ("gpt_neox", None), ("qwen2", None)])
def test_families_and_tied_weights_round_trip_in_one_process(tmp_path, family, tie):
    """Tied embeddings (the head absent from the file, resolved through its alias; written as
    transformers writes it), GPT-2's Conv1D and fused c_attn, GPT-NeoX's rotary tables recomputed on a
    meta build, Qwen2's biases: meta build + ZeRO-3 + load, two steps with one process's losses, and
    save_pretrained writes transformers' own files with the engine's values."""
    from safetensors import safe_open

    hf_models.build(family, seed=0, layers=2, tie=tie).save_pretrained(tmp_path / "src")
    model = hf_models.build(family, seed=1, layers=2, tie=tie, meta=True)
    engine = sl.parallelize(model, sl.plan(model, sl.Mesh({"data": 1}), zero=3), optimizer=_opt, init=False)
    engine.load_pretrained(tmp_path / "src")
    ref = _from_pretrained(tmp_path / "src")
    want = hf_models.train_alone(ref, _batches()[:2], lr=LR)
    got = [engine.step(b) for b in _batches()[:2]]
    assert max_rel(got, want) <= 1e-5, (family, got, want)
    engine.save_pretrained(tmp_path / "ours")
    fresh = hf_models.build(family, seed=2, layers=2, tie=tie)
    fresh.load_state_dict(ref.state_dict())
    fresh.save_pretrained(tmp_path / "theirs")
    _same_files(tmp_path / "ours", tmp_path / "theirs")
    if tie or family == "gpt2":
        with safe_open(tmp_path / "ours" / "model.safetensors", "pt") as f:
            assert "lm_head.weight" not in f.keys()
    full = engine.full_state_dict()
    for k, v in _from_pretrained(tmp_path / "ours").state_dict().items():
        assert torch.equal(v, full[k]), f"{family}: {k}"


class _Scaled(torch.nn.Module):
    """A linear layer and a persistent buffer: on a meta build only a load can give the buffer a value."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return (self.lin(x) * self.scale).pow(2).mean()


def test_a_persistent_buffer_missing_from_the_file_is_refused_on_a_meta_build(tmp_path):
    """init=False zeroes a meta model's persistent buffers: a file without one is refused by name (not
    loaded as zeros); with it, it is loaded. A model built normally keeps its own buffer."""
    from safetensors.torch import save_file

    weights = {"lin.weight": torch.randn(4, 4), "lin.bias": torch.randn(4)}
    save_file(weights, tmp_path / "no-scale.safetensors")
    save_file({**weights, "scale": torch.full((4,), 3.0)}, tmp_path / "scale.safetensors")
    with torch.device("meta"):
        model = _Scaled()
    engine = sl.parallelize(model, sl.plan(model, sl.Mesh({"data": 1})), optimizer=_opt, init=False)
    with pytest.raises(CheckpointError, match="holds no buffer 'scale'"):
        engine.load_pretrained(tmp_path / "no-scale.safetensors")
    engine.load_pretrained(tmp_path / "scale.safetensors")
    assert torch.equal(engine.model.scale, torch.full((4,), 3.0))
    assert torch.equal(engine.full_state_dict()["lin.weight"], weights["lin.weight"])
    built = _Scaled()
    engine = sl.parallelize(built, sl.plan(built, sl.Mesh({"data": 1})), optimizer=_opt)
    engine.load_pretrained(tmp_path / "no-scale.safetensors")
    assert torch.equal(engine.model.scale, torch.ones(4))
