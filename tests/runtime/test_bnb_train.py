"""A model loaded with bitsandbytes 4-bit (issue 42, deliverable 2): ``from_pretrained`` with
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`` on the
CPU, PEFT LoRA on every projection — the model a QLoRA user brings — plans and trains on a mesh as it trains
in one process with bitsandbytes' own ``Linear4bit`` product (``tests/qlora_models.py``):

* ``sl.plan`` lays each ``Params4bit`` out as a ``Bnb4Tensor`` (``quant/bnb4.py``): bitsandbytes' codes and
  its exact block scales, split on every axis without cutting a block, moved packed by ZeRO-3;
* losses within 1e-5 of one process's, the trained adapters within round-off, every rank the same losses;
* the frozen base after training equals bitsandbytes' dequantized weights bit for bit (and is still packed);
* memory planned = held.
"""

from __future__ import annotations

import math

import pytest

import qlora_models as qm

CASES = [({"data": 2}, 3), ({"data": 1, "tensor": 2}, 0), ({"data": 2, "tensor": 2}, 3), ({"data": 1, "pipe": 2}, 0)]
_REF: dict = {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return qm.write_folder(str(tmp_path_factory.mktemp("bnb") / "llama"))


@pytest.mark.parametrize("shape,zero", CASES, ids=[f"{'x'.join(f'{k}{v}' for k, v in s.items())}-zero{z}"
                                                   for s, z in CASES])
def test_a_bitsandbytes_4bit_peft_model_trains_on_a_mesh_like_one_process(world, folder, shape, zero):
    if "ref" not in _REF:
        _REF["ref"] = qm.bnb_reference(folder)
    ref = _REF["ref"]
    per_rank = world(math.prod(shape.values()), qm.bnb_run, folder, shape, zero)
    for r, res in enumerate(per_rank):
        where = f"bitsandbytes {shape} zero={zero} rank {r}"
        assert res["kinds"] == ["Bnb4Tensor"] and res["params4bit"] == [], \
            f"{where}: the quantized states are {res['kinds']}, bitsandbytes' own left: {res['params4bit'][:3]}"
        qm.check_trains_like(res, ref, per_rank[0], where)


def test_a_bitsandbytes_checkpoint_resumes_on_another_mesh(world, folder, tmp_path):
    """Saved at data 2 ZeRO-3 after a step, loaded at tensor 2: every tensor equal, the next loss the same."""
    for r, res in enumerate(world(2, qm.bnb_resume, folder, str(tmp_path / "ckpt"))):
        assert res["differ"] == [], (r, res["differ"][:4])
        assert res["loss_a"] == res["loss_b"], (r, res)
