"""The pipe axis trains like one process: every schedule, micro-batch count and composition.

The reference GPT (8 blocks, vocabulary 67, MLP width 90) with ``rules={"layers": "pipe"}`` is cut
into ``pipe x virtual`` stages and trained 5 steps on gloo ranks; the losses must be those of plain
PyTorch in one process on the same batches (``test_engine_data_parallel.reference_run``) within 1e-5 relative,
and the final weights (``engine.full_state_dict()``, gathered across stages) equal — with SGD the
weight change is the gradient, so equal weights mean equal gradients. Each run counts one step's
collectives and point-to-point messages (``sl.count_collectives``) and compares them with
``plan.comm_per_step(rank)``.
"""

from __future__ import annotations

import torch

import shardlib as sl
from shardlib.runtime import weight_grads
from shardlib.testing import get_mesh
from test_engine_data_parallel import make_batches, make_model, make_optimizer, reference_run
from test_tensor_parallel import check_world, train_counting

PIPE = {"layers": "pipe"}
TP = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
BATCH = 16             # divides into data 2 x 8 micro-batches
_REFS: dict = {}


def batches(steps: int = 5):
    return make_batches("gpt_pp", steps, BATCH)


def reference(cfg: dict) -> dict:
    key = (cfg.get("optimizer", "sgd"), cfg.get("clip"), cfg.get("precision", "fp32"), cfg.get("loss_scale"))
    if key not in _REFS:
        kw = {"scale": key[3]} if key[3] is not None else {}
        _REFS[key] = reference_run("gpt_pp", optimizer=key[0], clip=key[1], precision=key[2], batches=batches(), **kw)
    return _REFS[key]


def pp_run(cfg: dict, shape: dict) -> dict:
    mesh = get_mesh(shape)
    model = make_model("gpt_pp")
    data = batches()
    kw = {k: cfg[k] for k in ("zero", "microbatches", "schedule", "virtual_stages", "stages", "recompute",
                              "precision", "pipe_gather") if k in cfg}
    if "clip" in cfg:
        kw["clip_grad_norm"] = cfg["clip"]
    rules = {**PIPE, **(TP if shape.get("tensor", 1) > 1 else {})}
    plan = sl.plan(model, mesh, rules=rules, sequence_parallel=cfg.get("sp", False), batch=data[0], **kw)
    engine = sl.parallelize(model, plan, optimizer=make_optimizer(cfg.get("optimizer", "sgd")),
                            loss_scale=cfg.get("loss_scale"))
    skipped = []
    if engine.scaler:          # which steps overflowed (and were skipped on every rank)
        step = engine.step
        def counted(batch):
            before = engine.scaler.skipped_steps
            loss = step(batch)
            if engine.scaler.skipped_steps > before:
                skipped.append(len(skipped_log))
            skipped_log.append(loss)
            return loss
        skipped_log: list = []
        engine.step = counted
    losses, counts = train_counting(engine, plan, data)
    full = engine.full_state_dict()
    params = {name: full[name] for name, _ in make_model("gpt_pp").named_parameters()}
    return {"losses": losses, "params": params, "skipped": skipped, **counts}


def pp_runs(cfgs: list[dict], shape: dict) -> list[dict]:
    return [pp_run(c, shape) for c in cfgs]


def _check(world, cfgs: list[dict], shape: dict, counts: bool = True, **tolerance) -> None:
    check_world(world, pp_runs, cfgs, shape, reference, counts=counts, **tolerance)


def _schedules(p: int, ms) -> list[dict]:
    out = []
    for m in ms:
        for s in ("gpipe", "1f1b", "zb_h1"):
            out.append({"schedule": s, "microbatches": m})
        if m >= p:
            out.append({"schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": m})
    return out


def test_pipe2_every_schedule_trains_like_one_process(world):
    """pipe = 2: GPipe, 1F1B, ZB-H1 at m = 1, 2, 4, 8 and interleaved 1F1B (v = 2) at m >= 2."""
    cfgs = _schedules(2, (1, 2, 4, 8))
    cfgs[1]["clip"] = 0.05                                   # clipping by the norm over both stages
    cfgs[1]["optimizer"] = "sgd"
    cfgs[2]["optimizer"] = "adamw"
    cfgs[3]["stages"] = "E t t t|t t t t t L"                # an uneven, explicit split
    _check(world, cfgs, {"data": 1, "pipe": 2})


def test_pipe4_every_schedule_trains_like_one_process(world):
    """pipe = 4: every schedule at m = 1, 4, 8 (interleaved: v = 2, eight stages of one block)."""
    _check(world, _schedules(4, (1, 4, 8)), {"data": 1, "pipe": 4})


def test_pipe_by_data_every_zero_stage_trains_like_one_process(world):
    """pipe 2 x data 2 with DP and ZeRO-1/2/3 (ZeRO-3: a stage gathered once per step)."""
    cfgs = [{"zero": z, "microbatches": 4} for z in range(4)]
    cfgs[1]["schedule"] = "gpipe"
    cfgs[2]["schedule"] = "interleaved_1f1b"
    cfgs[3]["clip"] = 0.05
    _check(world, cfgs, {"data": 2, "pipe": 2})


def test_zero3_per_microbatch_gather_under_pipe_trains_like_one_process(world):
    """ZeRO-3's other gather policy under a pipeline: each unit gathered for every micro-batch's
    forward and backward and reduce-scattered after each backward (the root once per step)."""
    mb = {"zero": 3, "microbatches": 4, "pipe_gather": "microbatch"}
    cfgs = [{**mb, "schedule": "gpipe"}, {**mb, "schedule": "1f1b", "recompute": True},
            {**mb, "schedule": "interleaved_1f1b", "virtual_stages": 2, "clip": 0.05}]
    _check(world, cfgs, {"data": 2, "pipe": 2})


def _gathers(cfgs: list[dict]) -> list[dict]:
    """One step of each ZeRO-3 pipeline config: what the engine gathered and freed (its units'
    events), the most bytes it held gathered, and what the stage-local plan says of both."""
    mesh = get_mesh({"data": 2, "pipe": 2})
    out = []
    for cfg in cfgs:
        model = make_model("gpt_pp")
        plan = sl.plan(model, mesh, rules=PIPE, zero=3, **cfg)
        engine = sl.parallelize(model, plan, optimizer=make_optimizer("sgd"))
        engine.step(batches(1)[0])
        local = plan.local(mesh.rank)
        out.append({"events": list(engine.units.events), "schedule": list(local.gather_schedule()),
                    "peak": engine.peak_gathered_bytes, "transient": local.transient_per_rank()["gathered"]})
    return out


def test_zero3_gather_schedule_and_peak_under_a_pipeline(world):
    """Both policies gather, wait for and free units in the order of the stage-local plan's
    ``gather_schedule()``, and hold at most ``transient_per_rank()`` gathered: under "step" a
    rank's whole stage(s), under "microbatch" a unit and its prefetched neighbour (and the root)."""
    cfgs = [{"microbatches": 4, "schedule": s, "pipe_gather": g, **({"virtual_stages": 2} if s[0] == "i" else {})}
            for g in ("step", "microbatch") for s in ("1f1b", "interleaved_1f1b")]
    per_rank = world(4, _gathers, cfgs)
    for r, results in enumerate(per_rank):
        for cfg, res in zip(cfgs, results):
            assert res["events"] == res["schedule"], (r, cfg)
            assert res["peak"] == res["transient"] > 0, (r, cfg)
        for step, micro in zip(results[:2], results[2:]):
            assert micro["peak"] < step["peak"], (r, step["peak"], micro["peak"])


def test_pipe_fp16_skips_the_same_overflowing_steps_as_one_process(world):
    """fp16 with a dynamic scale too large at first (2^40): the steps that overflow on some stage are
    skipped on every rank, the same steps as one process skips; losses within 2.5 fp16 eps of the same
    policy in one process (the tensor tests' bound)."""
    cfg = {"zero": 1, "microbatches": 4, "precision": "fp16", "loss_scale": 2.0 ** 40}
    assert reference(cfg)["skipped"], "the reference must overflow at first, or the test shows nothing"
    # (the counted step is a skipped one: no gather of updated parameters, unlike the plan's step)
    _check(world, [cfg], {"data": 2, "pipe": 2}, counts=False, rtol=2.5 * torch.finfo(torch.float16).eps,
           param_tol={"rtol": 1.0, "atol": 1.0})


def test_pipe_by_tensor_trains_like_one_process(world):
    """pipe 2 x tensor 2: Megatron TP (vocab-parallel embedding and loss) inside the stages, with
    and without sequence parallelism (the stream between stages is then sequence-split)."""
    cfgs = [{"microbatches": 4, "schedule": "zb_h1"}, {"microbatches": 4, "sp": True}]
    _check(world, cfgs, {"data": 1, "pipe": 2, "tensor": 2})


def test_3d_mesh_trains_like_one_process(world):
    """data 2 x pipe 2 x tensor 2 = 8 processes, ZeRO-1 and ZeRO-3."""
    cfgs = [{"zero": 1, "microbatches": 2}, {"zero": 3, "microbatches": 2, "sp": True, "clip": 0.05}]
    _check(world, cfgs, {"data": 2, "pipe": 2, "tensor": 2})


def test_loss_is_the_global_mean_whatever_the_pipeline():
    """The number the engine returns does not depend on p, m or the schedule: the reference is
    one number per step (checked above against every layout); here, the reference itself is the
    mean over the global batch — a pipeline that summed micro-batch losses would be m times off."""
    ref = reference({})
    model = make_model("gpt_pp")
    idx, tgt = batches(1)[0]
    with torch.no_grad():
        whole = model(idx, tgt).item()
        halves = sum(model(idx[i:i + 8], tgt[i:i + 8]).item() for i in (0, 8)) / 2
    assert abs(ref["losses"][0] - whole) <= 1e-6 * abs(whole)
    assert abs(halves - whole) <= 1e-5 * abs(whole)


def _receive_posts(schedule: str, m: int) -> dict:
    """One step; from ``engine.timeline``, each receive's post and wait (a RECV record each, posted
    first) as positions among the rank's records, and the window the plan allows; and, the mesh having
    one data rank, what the gradient buckets made and what the rank holds in gradients against the plan."""
    mesh = get_mesh({"data": 1, "pipe": 2})
    model = make_model("gpt_pp")
    data = batches(1)
    plan = sl.plan(model, mesh, rules=PIPE, microbatches=m, schedule=schedule)
    engine = sl.parallelize(model, plan, optimizer=make_optimizer("sgd"))
    engine.step(data[0])
    seen: dict[str, list[int]] = {}
    for k, rec in enumerate(engine.timeline):
        if "RECV" in rec.action:
            seen.setdefault(rec.action, []).append(k)
    return {"window": plan.pipeline.recv_window, "recvs": seen, "first": [r.action for r in engine.timeline[:2]],
            "computes": [k for k, r in enumerate(engine.timeline) if "RECV" not in r.action and "SEND" not in r.action],
            # one data rank: the optimizer read autograd's own gradients, no bucket buffer was made
            "direct": engine.buckets.direct, "buffers": [b for b in engine.buckets.buffers if b is not None],
            "held": engine.memory_held()["grads"], "planned": plan.memory_per_rank()["grads"]}


def test_receives_are_posted_ahead_within_the_window(world):
    """A receive is posted before the compute ahead of the one that waits for it (gloo moves data
    only once both sides posted), but never more than the plan's window ahead."""
    for schedule in ("gpipe", "1f1b"):
        for rank, out in enumerate(world(2, _receive_posts, schedule, 8)):
            assert out["recvs"] and all(len(ks) == 2 for ks in out["recvs"].values()), out
            events = sorted([(ks[0], +1) for ks in out["recvs"].values()] + [(ks[1], -1) for ks in out["recvs"].values()])
            live = peak = 0
            for _, d in events:
                live += d
                peak = max(peak, live)
            assert peak == out["window"], (schedule, rank, peak)
            # some receive spans compute: posted before another action's compute, waited after it
            assert any(any(post < c < wait for c in out["computes"]) for post, wait in out["recvs"].values())
            if rank == 0:     # the first stage's first forward and its send come before any receive is posted
                assert out["first"] == ["0F0", "0SEND_F0"], out["first"]


def test_one_data_rank_steps_on_autograds_own_gradients(world):
    """At data 1 nothing is reduced: no bucket buffer is made and nothing copied into one; the parameters'
    own gradients are what the step keeps between steps, the plan's bytes."""
    for rank, out in enumerate(world(2, _receive_posts, "1f1b", 4)):
        assert out["direct"] and out["buffers"] == [], (rank, out["direct"], len(out["buffers"]))
        assert out["held"] == out["planned"] > 0, (rank, out["held"], out["planned"])


def _failing(shape: dict, bad_rank: int):
    """Train 2 steps; ``bad_rank``'s stage raises in the second step's forward. Returns what each
    rank raised."""
    mesh = get_mesh(shape)
    model = make_model("gpt_pp")
    data = batches(2)
    plan = sl.plan(model, mesh, rules=PIPE, microbatches=2)
    engine = sl.parallelize(model, plan, optimizer=make_optimizer("sgd"))
    engine.step(data[0])
    if mesh.rank == bad_rank:
        def fail(*_):
            raise ValueError("bad data on this rank")
        engine.pipe.blocks[min(engine.pipe.blocks)][0].register_forward_pre_hook(fail)
    try:
        engine.step(data[1])
    except Exception as e:                       # every rank raises: report what
        engine.pipe.clear_failure() if mesh.rank == 0 else None
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_failure_on_one_rank_raises_everywhere():
    from shardlib.testing import WorldPool

    pool = WorldPool(2, timeout=5)
    pool.start()
    try:
        out = pool.run(_failing, {"data": 1, "pipe": 2}, 1)
    finally:
        pool.close()
    assert out[1].startswith("ValueError: bad data on this rank"), out
    assert out[0].startswith("PipelineError") and "rank 1" in out[0] and "bad data" in out[0], out


def _adamw_engine(mesh, schedule: str, data: list):
    """The GPT from its seed on ``mesh``'s pipe axis under ``schedule`` (4 micro-batches), with AdamW."""
    model = make_model("gpt_pp")
    plan = sl.plan(model, mesh, rules=PIPE, schedule=schedule, microbatches=4, batch=data[0])
    return sl.parallelize(model, plan, optimizer=make_optimizer("adamw"))


def _trained_alike(a: dict, b: dict, where) -> None:
    """The same losses and final weights, bit for bit."""
    assert a["losses"] == b["losses"], where
    assert a["state"].keys() == b["state"].keys(), where
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), (where, k)


def _split_kinds(p: int) -> dict:
    """zb_h1 on the GPT, 3 steps, twice from one seed: the blocks' Linear weight gradients deferred to W
    (``runtime/weight_grads.py``), and torch's generic split (the store taken away after the build)."""
    mesh = get_mesh({"data": 1, "pipe": p})
    data = batches(3)
    out = {}
    for kind in ("deferred", "generic"):
        engine = _adamw_engine(mesh, "zb_h1", data)
        store, deferred = engine.pipe.deferred, engine.pipe.deferred_layers
        if kind == "generic":
            engine.pipe.deferred = None
        losses = [engine.step(b) for b in data]
        out[kind] = {"losses": losses, "state": engine.full_state_dict(), "store": store is not None,
                     "deferred": deferred, "left": len(store.pending) if store is not None else 0}
    return out


def test_zero_bubble_deferred_weight_gradients_equal_the_generic_split(world):
    """Deferring the Linear weight gradients to W changes no bit of the losses or the weights (AdamW), at pipe 2
    and 4; the stages with an input defer them (the first stage's W runs its whole backward)."""
    for p in (2, 4):
        for r, got in enumerate(world(p, _split_kinds, p)):
            d, g = got["deferred"], got["generic"]
            assert d["store"] and d["left"] == 0, (p, r)
            # rank 0 holds the first stage; a GPT block has 4 Linear layers (qkv, proj, fc, out), the last
            # stage the head too
            head = 1 if r == p - 1 else 0
            assert (d["deferred"] > 0) == (r > 0) and d["deferred"] == 4 * (8 // p) * (r > 0) + head, \
                (p, r, d["deferred"])
            _trained_alike(d, g, (p, r))


def _tail_split(p: int) -> dict:
    """1f1b on the GPT, 3 steps, twice from one seed: as built (the last stage's last backward split into I,
    its gradient's send, then W), and with the split taken away after the build (the plain lowered list)."""
    mesh = get_mesh({"data": 1, "pipe": p})
    data = batches(3)
    out = {}
    for kind in ("split", "plain"):
        engine = _adamw_engine(mesh, "1f1b", data)
        pipe, plan = engine.pipe, engine.plan
        split, store = pipe.split, pipe.deferred
        if kind == "plain":
            pipe.actions = plan.pipeline.lowered(pipe.coord)
            pipe.recvs = [k for k, a in enumerate(pipe.actions) if a.kind in ("RECV_F", "RECV_B")]
            pipe.deferred = pipe.split = None
        applied = []                 # forwards through the store (runtime/weight_grads.py), per layer call
        apply = weight_grads._DeferredLinear.apply
        weight_grads._DeferredLinear.apply = lambda *a: (applied.append(1), apply(*a))[1]
        try:
            losses = [engine.step(b) for b in data]
        finally:
            weight_grads._DeferredLinear.apply = apply
        out[kind] = {"losses": losses, "state": engine.full_state_dict(), "split": split,
                     "actions": [r.action for r in engine.timeline if r.action[1:2] in "IW" or "B" in r.action],
                     "applied": len(applied),
                     "layers": pipe.deferred_layers, "left": len(store.pending) if store is not None else 0}
    return out


def test_1f1b_sends_the_last_stages_last_input_gradient_before_its_weight_gradients(world):
    """Under 1f1b the last stage's last backward runs as I, the gradient's send, then W (its Linear weight
    gradients deferred): only that micro-batch's forward records through the store, every other backward is
    whole, and no bit of the losses or the AdamW weights changes against the unsplit schedule (pipe 2 and 4)."""
    for p in (2, 4):
        for r, got in enumerate(world(p, _tail_split, p)):
            s, plain = got["split"], got["plain"]
            last = r == p - 1
            assert s["split"] == ({(p - 1, 3)} if last else None), (p, r, s["split"])
            # 4 Linear layers a block, and the head
            assert s["layers"] == (4 * (8 // p) + 1 if last else 0), (p, r, s["layers"])
            if last:
                acts = s["actions"]
                assert acts[-3:] == [f"{r}I3", f"{r}SEND_B3", f"{r}W3"], acts
                assert not [a for a in acts[:-3] if a[1] in "IW"], acts
                # micro-batch 3's forward alone, in each of the 3 steps; nothing left over
                assert s["applied"] == 3 * s["layers"] and s["left"] == 0, (s["applied"], s["layers"])
            else:
                assert not [a for a in s["actions"] if a[1] in "IW"] and s["applied"] == 0, s["actions"]
            _trained_alike(s, plain, (p, r))
