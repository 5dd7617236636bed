"""Offload runs (issue 20): the optimizer's states, ZeRO-3's parameter shards and the blocks' saved
activations on the host or on disk train exactly like the same plan without offload.

For the reference GPT and a transformers Llama at data 2 (ZeRO 0-3), HSDP, data 2 x tensor 2 (± SP),
pipe 2 (1F1B, GPipe x ZeRO-3, interleaved, ZB-H1), 2 x 2 x 2 and the MoE GPT at data 2 x expert 2, in fp32, bf16 and fp16 with loss scaling, clipping,
accumulation, and LoRA over an int8 base: the losses equal the non-offloaded run's bit for bit (the
same optimizer, the same arithmetic; that run equals one process, as the engine tests show — and one
configuration is compared with one process here too), the final full state equal, the collectives of
a step those the plan lists (offload adds none), the copies between memory kinds counted on the
second step equal to the plan's entries, and the bytes held in each memory kind equal
``memory_per_rank(kind=)``. Activations' copies are not planned (their bytes depend on the model's
forward): what leaves comes back, byte for byte (ZB-H1 reads some twice: its B and its W).
"""

from __future__ import annotations

import pytest
import torch

import offload_models as om
from test_engine_data_parallel import max_rel

STATES = ("params", "grads", "optimizer")
ALL = ("host", "disk", "optimizer=disk,params=disk,activations=disk", "optimizer=host,params=host,activations=host",
       "params=disk", "params=host,activations=disk")


def check(world, kind: str, shape: dict, cfgs: list[dict], offloads: tuple) -> list:
    n = 1
    for v in shape.values():
        n *= v
    per_rank = world(n, om.run, kind, cfgs, shape, offloads)
    for i, cfg in enumerate(cfgs):
        for r in range(n):
            res = per_rank[r][i]
            plain = res["none"]
            for name in offloads:
                got, where = res[name], f"{kind} {shape} {cfg} {name} rank {r}"
                assert got["losses"] == plain["losses"], f"{where}: {got['losses']} vs {plain['losses']}"
                for k, v in plain["state"].items():
                    if isinstance(v, torch.Tensor):
                        assert torch.equal(got["state"][k], v), f"{where}: {k} differs"
                assert got["counted"] == got["planned"], f"{where}: ran {got['counted']}, planned {got['planned']}"
                planned = got["planned_copies"]
                acts = got["copies"].pop("activations", {})
                assert got["copies"] == planned, f"{where}: copied {got['copies']}, planned {planned}"
                # every tensor that left comes back; ZB-H1's split backward (B, then W) reads some twice
                twice = cfg.get("schedule") == "zb_h1"
                for out, back in (("d2h", "h2d"), ("disk_write", "disk_read")):
                    assert (acts.get(back, 0) >= acts.get(out, 0)) if twice else acts.get(back, 0) == acts.get(out, 0), \
                        f"{where}: activations {acts}"
                assert ("activations" in name) == (acts.get("d2h", 0) > 0), f"{where}: activations {acts}"
                for k in ("device", "host", "disk"):
                    held, want = got["held"][k], got["memory"][k]
                    assert {s: held[s] for s in STATES} == {s: want[s] for s in STATES}, \
                        f"{where}: {k} holds {held}, planned {want}"
                assert sum(got["memory"][k]["total"] for k in ("device", "host", "disk")) == got["memory"]["all"]["total"]
    return per_rank


def _zero3(offloads):
    return tuple(o for o in offloads if "params" not in o and "activations" not in o)


def test_offloaded_gpt_data2_every_zero_stage_matches_no_offload(world):
    per_rank = check(world, "gpt", {"data": 2}, [{"zero": z} for z in (0, 1, 2)], _zero3(ALL) + ("activations=disk",))
    ref = om.reference("gpt")
    assert max_rel(per_rank[0][0]["host"]["losses"], ref) <= 1e-5, (per_rank[0][0]["host"]["losses"], ref)
    check(world, "gpt", {"data": 2}, [{"zero": 3}], ALL)


def test_offload_in_bf16_and_fp16_with_clip_and_accum_matches_no_offload(world):
    check(world, "gpt", {"data": 2}, [{"zero": 3, "precision": "bf16", "accum": 2, "clip": 0.5}], ALL)
    check(world, "gpt", {"data": 2}, [{"zero": 2, "precision": "fp16"}, {"zero": 0, "precision": "fp16", "clip": 1.0}],
          ("host", "disk"))


def test_offloaded_llama_tensor_and_sequence_parallel_matches_no_offload(world):
    check(world, "llama", {"data": 2, "tensor": 2}, [{"zero": 3}], ("disk", "optimizer=disk,params=disk,activations=host"))
    check(world, "llama", {"data": 2, "tensor": 2}, [{"zero": 1, "sp": True, "clip": 1.0}], ("host", "activations=disk"))


def test_offloaded_llama_pipe_matches_no_offload(world):
    check(world, "llama", {"data": 1, "pipe": 2}, [{"zero": 0, "schedule": "1f1b"}], ("disk", "activations=disk"))
    check(world, "llama", {"data": 1, "pipe": 2}, [{"zero": 3, "schedule": "gpipe"}],
          ("host", "optimizer=disk,params=disk,activations=disk"))


def test_offload_under_every_pipeline_schedule_matches_no_offload(world):
    """Interleaved 1F1B (v = 2) and ZB-H1 (backward split into B and W) over four blocks at pipe 2."""
    check(world, "gpt4", {"data": 1, "pipe": 2},
          [{"zero": 0, "schedule": "interleaved_1f1b", "virtual": 2}, {"zero": 1, "schedule": "zb_h1", "microbatches": 4},
           {"zero": 3, "schedule": "zb_h1"}], ("optimizer=disk,activations=disk", "host"))
    check(world, "gpt4", {"data": 1, "pipe": 2}, [{"zero": 3, "schedule": "interleaved_1f1b", "virtual": 2}],
          ("optimizer=disk,params=disk,activations=disk",))


def test_offloaded_hsdp_matches_no_offload(world):
    check(world, "gpt", {"replica": 2, "data": 2}, [{"zero": 3}], ("optimizer=disk,params=disk", "host"))
    check(world, "gpt", {"replica": 2, "data": 2}, [{"zero": 2, "clip": 0.5}], ("disk",))


def test_offloaded_3d_mesh_matches_no_offload(world):
    check(world, "gpt", {"data": 2, "pipe": 2, "tensor": 2}, [{"zero": 3}],
          ("optimizer=disk,params=disk,activations=disk", "optimizer=host,params=host"))
    check(world, "llama", {"data": 2, "pipe": 2, "tensor": 2}, [{"zero": 1}], ("disk",))


def test_offloaded_lora_over_int8_base_matches_no_offload(world):
    """QLoRA: the adapters' masters and moments offloaded; under ZeRO-3 the packed int8 shards of the
    frozen base on disk (both file generations hold them, never rewritten)."""
    check(world, "lora", {"data": 2}, [{"zero": 3}], ("optimizer=disk,params=disk", "params=host,activations=disk"))
    check(world, "lora", {"data": 2}, [{"zero": 0}], ("host",))


def test_offload_beside_an_expert_axis_matches_no_offload(world):
    """A mixture of experts (routed experts split over ``expert``, a shared one, the router's load-balancing
    loss): the experts' states offload as the others' do — ZeRO-3's parameter shards of both kinds (the experts'
    sharded over data alone, the rest over data x expert), the optimizer on the host or on disk, and each block's
    saved activations, the routed rows among them. Bit for bit the same run; its plain run equals one process."""
    per_rank = check(world, "moe", {"data": 2, "expert": 2}, [{"zero": 3}], ALL)
    ref = om.reference("moe")
    assert max_rel(per_rank[0][0]["disk"]["losses"], ref) <= 1e-5, (per_rank[0][0]["disk"]["losses"], ref)
    check(world, "moe", {"data": 2, "expert": 2}, [{"zero": 2, "clip": 1.0}], ("disk", "optimizer=host,activations=disk"))
    check(world, "moe", {"expert": 2}, [{"zero": 1}], ("activations=host",))
    check(world, "moe", {"pipe": 2, "expert": 2}, [{"zero": 3, "schedule": "gpipe"}],
          ("optimizer=host,params=disk,activations=host",))


@pytest.mark.parametrize("cfg,offload", [({"zero": 1}, {"optimizer": "disk"}),
                                         ({"zero": 3}, {"optimizer": "disk", "params": "disk"}),
                                         ({"zero": 3}, {"params": "disk"})])
def test_a_failed_write_leaves_the_step_undone(world, cfg, offload):
    """A full disk in the middle of the update: ``OffloadError`` naming the folder, the parameters and
    the offloaded states those of the previous step, the step count unchanged; stepping again once the
    disk is back gives the losses of a run that never failed."""
    for res in world(2, om.failed_write, cfg, {"data": 2}, offload):
        assert res["error"] is not None and "No space left on device" in res["error"]
        if "optimizer" not in offload:
            # the optimizer on the device had updated its states before the parameters failed to be
            # written: nothing can be undone, so the engine refuses to step until a checkpoint is loaded
            assert "Load the last checkpoint" in res["error"] and "Load the last checkpoint" in res["refused"]
            continue
        assert "was not applied" in res["error"]
        assert res["changed"] == [] and res["step_count"] == 1
        assert res["losses"] == res["plain"], (res["losses"], res["plain"])


@pytest.mark.parametrize("save,load", [
    (({"zero": 3}, {"data": 2}, {"optimizer": "disk", "params": "disk"}), ({"zero": 1}, {"data": 4}, None)),
    (({"zero": 0}, {"data": 4}, None), ({"zero": 3}, {"data": 2}, {"optimizer": "disk", "params": "disk"})),
    (({"zero": 2}, {"data": 2}, {"optimizer": "host"}), ({"zero": 3}, {"data": 2, "tensor": 2}, {"optimizer": "disk"})),
])
def test_checkpoints_move_between_offloaded_and_not(world, tmp_path, save, load):
    """Saved with offload on or off, loaded on another mesh with it off or on: the run goes on as one
    that never stopped."""
    folder = str(tmp_path / "ckpt")
    (scfg, sshape, soff), (lcfg, lshape, loff) = save, load
    size = lambda shape: int(torch.tensor(list(shape.values())).prod())      # noqa: E731
    first = world(size(sshape), om.checkpoint_round, folder, scfg, sshape, soff, lcfg, lshape, loff, "save")[0]
    rest = world(size(lshape), om.checkpoint_round, folder, scfg, sshape, soff, lcfg, lshape, loff, "load")
    whole = world(size(lshape), om.checkpoint_round, folder, scfg, sshape, soff, lcfg, lshape, loff, "whole")[0]
    for r in rest:
        got = first + r
        assert max_rel(got, whole) <= 1e-6, (got, whole)
