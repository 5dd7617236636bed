"""Quantize while loading (issue 42, deliverables 1 and 2): a PEFT model over a base built on the meta
device and marked by ``sl.quantize`` loads a float folder with ``engine.load_pretrained``, each rank
quantizing its own slices — and trains as the same folder loaded whole, quantized and wrapped in one
process (``tests/qlora_models.py``):

* the adapters as loaded equal one process's bit for bit (PEFT drew them on the CPU from the same seed);
* the quantized base equals one process's bit for bit (its codes: NF4's whole-weight mean of block
  scales included), and stays so after training;
* losses within 1e-5, the trained adapters within round-off, every rank the same losses;
* memory planned = held (the packed bytes);

for NF4 at data 2 (ZeRO 0 and 3), tensor 2, data 2 x tensor 2 ZeRO-3 and pipe 2; int8 at tensor 2 (a
row-parallel split: per-row scales over the whole row); int4 at data 2 ZeRO-3.
"""

from __future__ import annotations

import math

import pytest
import torch

import qlora_models as qm

_REFS: dict = {}

CASES = [("nf4", {"data": 2}, 0), ("nf4", {"data": 2}, 3), ("nf4", {"data": 1, "tensor": 2}, 0),
         ("nf4", {"data": 2, "tensor": 2}, 3), ("nf4", {"data": 1, "pipe": 2}, 3),
         ("int8", {"data": 1, "tensor": 2}, 0), ("int4", {"data": 2}, 3)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return qm.write_folder(str(tmp_path_factory.mktemp("qlora") / "llama"))


def _reference(path: str, fmt: str) -> dict:
    if fmt not in _REFS:
        _REFS[fmt] = qm.reference(path, fmt)
    return _REFS[fmt]


@pytest.mark.parametrize("fmt,shape,zero", CASES, ids=[f"{f}-{'x'.join(f'{k}{v}' for k, v in s.items())}-zero{z}"
                                                       for f, s, z in CASES])
def test_marked_meta_model_loads_quantized_and_trains_like_one_process(world, folder, fmt, shape, zero):
    per_rank = world(math.prod(shape.values()), qm.run, folder, fmt, shape, zero)
    ref = _reference(folder, fmt)
    for r, res in enumerate(per_rank):
        where = f"{fmt} {shape} zero={zero} rank {r}"
        assert res["first"].keys() == ref["first"].keys() and ref["first"], where
        for k, want in ref["first"].items():
            assert torch.equal(res["first"][k], want), f"{where}: adapter {k} as loaded differs from one process's"
        qm.check_trains_like(res, ref, per_rank[0], where)


def test_an_nf4_checkpoint_resumes_on_another_mesh_and_the_adapters_load_in_one_process(world, folder, tmp_path):
    """data 2 ZeRO-3 saves (``engine.save``: the codes as components), tensor 2 resumes from the checkpoint alone:
    every tensor equal, the next step's loss equal to round-off; the adapter folder (``engine.save_pretrained``)
    loads into the one-process base with ``PeftModel.from_pretrained`` and gives the engine's adapters."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    ckpt, adapters = str(tmp_path / "ckpt"), str(tmp_path / "adapters")
    per_rank = world(2, qm.resume, folder, "nf4", ({"data": 2}, 3), ({"data": 1, "tensor": 2}, 0), ckpt, adapters)
    for r, res in enumerate(per_rank):
        assert res["saved"].keys() == res["loaded"].keys(), r
        bad = [k for k, v in res["saved"].items() if not torch.equal(v, res["loaded"][k])]
        assert bad == [], f"rank {r}: resumed tensors differ: {bad[:4]}"
        assert abs(res["loss_a"] - res["loss_b"]) <= 1e-5 * abs(res["loss_a"]), res
    base = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    import shardlib as sl
    sl.quantize(base, "nf4", **qm.OPTIONS["nf4"])
    model = PeftModel.from_pretrained(base, adapters)
    got = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    want = {k: v for k, v in per_rank[0]["saved"].items() if "lora_" in k}
    assert got.keys() == want.keys() and want
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_bad_loads_are_named_before_anything_is_written(world, folder, tmp_path):
    folders = qm.broken_folders(folder, str(tmp_path))
    for r, out in enumerate(world(2, qm.refusals, folder, folders)):
        assert "have no values" in out["init"] and "init=False" in out["init"] and "load_pretrained" in out["init"], out
        # a marked weight stored as ints: no float values to quantize
        assert "'model.layers.0.self_attn.q_proj.weight' is I32 — expected a float tensor (F32, F16, BF16) to " \
               "quantize" in out["int"], out["int"]
        # an unmarked (float) weight the folder holds quantized by bitsandbytes: named, with the mark to add
        assert "holds 'model.layers.0.self_attn.q_proj.weight' quantized (bitsandbytes 4-bit" in out["bnb"] and \
            "sl.quantize(meta_model" in out["bnb"], out["bnb"]
        for kind in ("int", "bnb"):
            assert out[kind + "_untouched"], f"rank {r}: a refused {kind} load wrote codes"
            assert "init=False" in out[kind + "_step"] and "load first" in out[kind + "_step"], out[kind + "_step"]


def test_a_rank_killed_while_quantizing_leaves_the_others_refusing_to_step(folder, tmp_path):
    """A rank killed mid-load (``os._exit`` while it quantizes its second weight, as ``kill -9`` leaves it): the
    launcher names it, and the surviving rank's load raises a named error instead of returning. That rank wrote
    its own codes, but the mesh's values are incomplete (the dead rank's ZeRO-3 pieces): its engine refuses to
    step until a load completes — nothing half-loaded is trained on."""
    import json

    import shardlib as sl
    out = tmp_path / "rank0.json"
    with pytest.raises(sl.WorkerError) as info:
        sl.launch(qm.killed_mid_load, 2, folder, str(out), timeout=60)
    assert "rank 1" in str(info.value), str(info.value)
    got = json.loads(out.read_text())
    assert got["error"] is not None and "CheckpointError: load_pretrained: reading" in got["error"], got
    assert "another rank stopped answering" in got["error"] and "refuses to step" in got["error"], got
    assert got["quantized_filled"] > 0 and got["needs_load"] is True, got
    assert got["step"] is not None and "load" in got["step"], got
