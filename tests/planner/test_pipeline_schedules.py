"""Pipeline schedules as data, run by the process-free simulator (pure: no processes, no torch).

Expected numbers are the closed forms of the papers (GPipe, Megatron 2021, Zero Bubble 2023),
written out here; costs are ints or binary fractions (1/2, 1/4), so times are exact and "equals the
formula" means equal."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction as Fr
from itertools import pairwise

import pytest

from shardlib.errors import ShardingError
from shardlib.planner.schedules import (
    SCHEDULES,
    Action,
    ScheduleError,
    format_schedule,
    lower,
    parse_schedule,
    schedule_actions,
    schedule_problems,
    split_last_backwards,
)
from shardlib.planner.simulate import Record, bubble_formula, simulate

PS = (2, 3, 4, 8)
MS = range(1, 17)


def cases(name: str, v: int = 2):
    """(p, m, v) for every p in PS and m in 1..16 that ``name`` accepts."""
    inter = name == "interleaved_1f1b"
    return [(p, m, v if inter else 1) for p in PS for m in MS if not (inter and m < p)]


def check_run(acts, res, p: int, m: int, v: int) -> None:
    """From the records alone: every (stage, mb) once forward and once backward (B, or I and W)
    on rank stage % p; each rank runs its list in order without overlap; every input exists
    before it is used."""
    n_stages = p * v
    by_action = {}
    for rank in range(p):
        recs = [r for r in res.records if r.rank == rank]
        assert [r.action for r in recs] == [str(a) for a in acts[rank]]
        assert all(a.end <= b.start for a, b in pairwise(recs))
        for r in recs:
            assert r.action not in by_action
            by_action[r.action] = r
    for s in range(n_stages):
        for i in range(m):
            f = by_action[f"{s}F{i}"]
            split = f"{s}I{i}" in by_action
            back = by_action[f"{s}I{i}" if split else f"{s}B{i}"]
            assert (f"{s}B{i}" in by_action) != split
            assert f.rank == back.rank == s % p
            assert f.end <= back.start
            if split:
                w = by_action[f"{s}W{i}"]
                assert w.rank == s % p and back.end <= w.start
            if s > 0:
                assert by_action[f"{s - 1}F{i}"].end <= f.start
            if s < n_stages - 1:
                nxt = by_action.get(f"{s + 1}B{i}") or by_action[f"{s + 1}I{i}"]
                assert nxt.end <= back.start
    assert len(by_action) == sum(len(lst) for lst in acts.values())


# --- printing ---------------------------------------------------------------------------------

def test_actions_print_like_torch_and_parse_back():
    spelled = {(0, "F", 3): "0F3", (1, "B", 0): "1B0", (1, "I", 2): "1I2", (1, "W", 2): "1W2",
               (0, "SEND_F", 3): "0SEND_F3", (1, "RECV_F", 3): "1RECV_F3", (1, "SEND_B", 0): "1SEND_B0",
               (0, "RECV_B", 0): "0RECV_B0", (0, "UNSHARD", None): "0UNSHARD", (0, "RESHARD", None): "0RESHARD",
               (0, "REDUCE_GRAD", None): "0REDUCE_GRAD", (12, "F", 15): "12F15"}
    for fields, text in spelled.items():
        a = Action(*fields)
        assert str(a) == repr(a) == text
        assert Action.parse(text) == a
    for name in SCHEDULES:
        v = 2 if name == "interleaved_1f1b" else 1
        for lst in lower(schedule_actions(name, 3, 5, v), 3, v, unshard=True).values():
            text = format_schedule(lst)
            assert "  " not in text and text.split() == [str(a) for a in lst]
            assert parse_schedule(text) == lst
    assert format_schedule(schedule_actions("1f1b", 2, 3)[0]) == "0F0 0F1 0B0 0F2 0B1 0B2"
    for bad in ("0X3", "F3", "0F", "0F3x", ""):
        with pytest.raises(ScheduleError, match="not an action"):
            Action.parse(bad)
    for fields in ((0, "F", None), (0, "UNSHARD", 1), (-1, "F", 0), (0, "Q", 0)):
        with pytest.raises(ScheduleError, match="bad fields"):
            Action(*fields)


# --- every schedule, every size -------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_runs_without_deadlock_once_per_stage_and_microbatch_in_order(name):
    for p, m, v in cases(name) + (cases(name, v=3) if name == "interleaved_1f1b" else []):
        acts = schedule_actions(name, p, m, v)
        assert sorted(acts) == list(range(p))
        assert all(a.is_compute for lst in acts.values() for a in lst)
        check_run(acts, simulate(acts, p, m, v), p, m, v)


def test_microbatches_one_is_naive_model_parallel():
    for name in ("gpipe", "1f1b", "zb_h1"):
        for p in PS:
            back = ["B"] if name != "zb_h1" else ["I", "W"]
            acts = schedule_actions(name, p, 1)
            assert {r: [str(a) for a in lst] for r, lst in acts.items()} == \
                {r: [f"{r}F0"] + [f"{r}{k}0" for k in back] for r in range(p)}
            res = simulate(acts, p, 1, costs={"F": 1, "B": 2, "I": 1, "W": 1})
            # the microbatch goes down (p·F) and back up (p·B, or p·I then rank 0's W)
            assert res.makespan == (2 * p + 1 if name == "zb_h1" else 3 * p)
            assert res.peak_live == (1,) * p


# --- bubbles ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_idle_is_p_minus_1_over_m_plus_p_minus_1(name):
    for f, b in ((1, 2), (1, 1)):
        for p, m, _ in cases(name):
            res = simulate(schedule_actions(name, p, m), p, m, costs={"F": f, "B": b})
            assert res.makespan == (m + p - 1) * (f + b)
            assert res.busy == (m * (f + b),) * p
            assert res.idle_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
            assert bubble_formula(name, p, m) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


def test_interleaved_idle_is_p_minus_1_over_vm_plus_p_minus_1_with_chunks_costing_1_over_v():
    for v in (2, 4):                  # 1/2 and 1/4 are exact in binary: the sums below are exact
        for f, b in ((1, 2), (1, 1)):
            def cost(a: Action, f=f, b=b, v=v) -> float:
                return (f if a.kind == "F" else b) / v
            for p, m, _ in cases("interleaved_1f1b", v):
                res = simulate(schedule_actions("interleaved_1f1b", p, m, v), p, m, v, costs=cost)
                assert res.makespan == (v * m + p - 1) * (f + b) / v, (v, p, m)
                want = (p - 1) / (v * m + p - 1)
                assert res.idle_fraction == pytest.approx(want, abs=1e-12)
                assert bubble_formula("interleaved_1f1b", p, m, v) == pytest.approx(want, abs=1e-12)
                if m == 2 * p:
                    flat = simulate(schedule_actions("1f1b", p, m), p, m, costs={"F": f, "B": b})
                    assert res.idle_fraction < flat.idle_fraction


def test_zb_h1_idle_is_the_papers_third_of_1f1b_and_below_1f1b_for_every_m():
    for p, m, _ in cases("zb_h1"):
        zb = simulate(schedule_actions("zb_h1", p, m), p, m, costs={"F": 1, "I": 1, "W": 1})
        flat = simulate(schedule_actions("1f1b", p, m), p, m, costs={"F": 1, "B": 2})  # B = I + W
        assert zb.busy == flat.busy == (3 * m,) * p
        assert zb.idle_fraction < flat.idle_fraction, (p, m)
        if m >= p:   # Qi et al.: bubble (p-1)(T_F + T_B - T_W) = (p-1)·T per rank, 1/3 of 1F1B's
            assert zb.makespan == 3 * m + p - 1
            want = (p - 1) / (3 * m + p - 1)
        else:        # rank 0 gets I0 back at 2p-1, then still has m I's and m W's to run
            assert zb.makespan == 2 * p - 1 + 2 * m
            want = (2 * p - m - 1) / (2 * p + 2 * m - 1)
        assert zb.idle_fraction == pytest.approx(want, abs=1e-12)
        assert bubble_formula("zb_h1", p, m) == pytest.approx(want, abs=1e-12)


def test_zb_h1_bubble_with_unequal_costs_is_the_papers_p_minus_1_times_f_plus_i_minus_w():
    for f, i, w in ((2, 1, 1), (1, 2, 1), (1, 1, 0.5)):
        for p, m, _ in cases("zb_h1"):
            if m >= p:
                res = simulate(schedule_actions("zb_h1", p, m), p, m, costs={"F": f, "I": i, "W": w})
                assert res.makespan == m * (f + i + w) + (p - 1) * (f + i - w), (f, i, w, p, m)


def test_p2p_latency_is_paid_once_per_hop_down_and_up_in_gpipe():
    for p, m, _ in cases("gpipe"):
        acts = schedule_actions("gpipe", p, m)
        res = simulate(acts, p, m, p2p=0.25)
        assert res.makespan == (m + p - 1) * 3 + 2 * (p - 1) * 0.25
        assert simulate(lower(acts, p), p, m, p2p=0.25).makespan == res.makespan


# --- memory -----------------------------------------------------------------------------------

def test_peak_live_microbatches_per_rank_follow_each_schedules_formula():
    for p, m, _ in cases("gpipe"):
        assert simulate(schedule_actions("gpipe", p, m), p, m).peak_live == (m,) * p
        assert simulate(schedule_actions("1f1b", p, m), p, m).peak_live == tuple(min(p - r, m) for r in range(p))
        zb = simulate(schedule_actions("zb_h1", p, m), p, m).peak_live
        # ZB-H1 keeps 1F1B's first-rank peak, on every rank: its deferred W's hold the rest
        assert zb == (min(p, m),) * p
    for v in (2, 3):
        for p, m, _ in cases("interleaved_1f1b", v):
            # Megatron: (v-1)·G + 2(p-1-r) warm-up forwards (G = the microbatch group, here the
            # largest of the m // p groups), then one more forward before the first backward
            rounds = m // p
            group = -(-m // rounds)
            live = simulate(schedule_actions("interleaved_1f1b", p, m, v), p, m, v).peak_live
            assert live == tuple(min(v * m, (v - 1) * group + 2 * (p - 1 - r) + 1) for r in range(p)), (p, m, v)
            if m % p == 0:   # in whole-stage microbatches: p + (p-1)/v, i.e. 1F1B's p times 1 + (p-1)/(p·v)
                assert Fr(live[0], v) == p + Fr(p - 1, v) or live[0] == v * m


# --- lowering ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEDULES)
def test_lowering_pairs_sends_with_receives_and_keeps_the_makespan(name):
    for p, m, v in [c for c in cases(name) if c[1] in (1, 3, 8, 13)]:
        acts = schedule_actions(name, p, m, v)
        lo = lower(acts, p, v)
        assert lo == lower(acts, p, v)                              # deterministic
        n_stages = p * v
        sends = Counter((a.kind, a.stage, a.mb) for lst in lo.values() for a in lst if "SEND" in a.kind)
        recvs = Counter((a.kind, a.stage, a.mb) for lst in lo.values() for a in lst if "RECV" in a.kind)
        assert sends == Counter({("SEND_F", s, i): 1 for s in range(n_stages - 1) for i in range(m)}
                                | {("SEND_B", s, i): 1 for s in range(1, n_stages) for i in range(m)})
        assert recvs == Counter({("RECV_F", s + 1, i): 1 for s in range(n_stages - 1) for i in range(m)}
                                | {("RECV_B", s - 1, i): 1 for s in range(1, n_stages) for i in range(m)})
        for r, lst in lo.items():
            assert [a for a in lst if a.is_compute] == acts[r]
            assert all(a.stage % p == r for a in lst)
            for j, a in enumerate(lst):                              # recv right before, send right after
                if a.kind in ("RECV_F", "RECV_B"):
                    assert lst[j + 1] == Action(a.stage, "F" if a.kind == "RECV_F" else lst[j + 1].kind, a.mb)
                    assert lst[j + 1].kind in (("F",) if a.kind == "RECV_F" else ("B", "I"))
                if a.kind in ("SEND_F", "SEND_B"):
                    assert lst[j - 1].stage == a.stage and lst[j - 1].mb == a.mb
                    assert lst[j - 1].kind in (("F",) if a.kind == "SEND_F" else ("B", "I"))
            reduce = [j for j, a in enumerate(lst) if a.kind == "REDUCE_GRAD"]
            assert sorted(lst[j].stage for j in reduce) == list(range(r, n_stages, p))
            for j in reduce:
                s = lst[j].stage
                last = [a for a in lst[:j] if a.stage == s and a.is_compute][-1]
                assert last.kind in ("B", "W") and lst[j - 1] in (last, Action(s, "SEND_B", last.mb))
                assert not [a for a in lst[j:] if a.stage == s and a.is_compute]
        for p2p in (0, 0.25):
            base = simulate(acts, p, m, v, p2p=p2p)
            low = simulate(lo, p, m, v, p2p=p2p)
            assert low.makespan == base.makespan and low.busy == base.busy
            assert low.peak_live == base.peak_live


def test_splitting_the_last_stages_last_backward_saves_one_w_under_1f1b_and_nothing_elsewhere():
    """``split_last_backwards``: the last B of each named stage becomes I then W in its place, nothing else
    moves; lowered, the gradient's send follows I and the stage's REDUCE_GRAD follows W. With F = 1, I = 2,
    W = 1 (B = I + W), under 1f1b splitting the last stage's last backward ends the step one W earlier at
    every p and m (the first stage's last backward starts a W earlier) with the same peak of live
    micro-batches; splitting every stage's gains nothing more, and under GPipe (m >= 2) nothing at all —
    which is why ``PipelinePlan.lowered(split_tail=True)`` splits that one backward, under 1f1b only."""
    costs = {"F": 1, "B": 3, "I": 2, "W": 1}
    for name in ("1f1b", "gpipe"):
        for p, m, v in [c for c in cases(name) if c[1] in (1, 2, 3, 8, 13)]:
            acts = schedule_actions(name, p, m, v)
            last = split_last_backwards(acts, [p - 1])
            every = split_last_backwards(acts, range(1, p))
            for r, lst in acts.items():
                expect = lst if r != p - 1 else lst[:-1] + [Action(r, "I", m - 1), Action(r, "W", m - 1)]
                assert last[r] == expect, (name, p, m, r)
            check_run(last, simulate(last, p, m, v), p, m, v)
            lo = lower(last, p)[p - 1]
            tail = [str(a) for a in lo[-4:]]
            assert tail == [f"{p - 1}I{m - 1}", f"{p - 1}SEND_B{m - 1}", f"{p - 1}W{m - 1}", f"{p - 1}REDUCE_GRAD"]
            base, one, all_ = (simulate(x, p, m, v, costs=costs) for x in (acts, last, every))
            assert one.peak_live == base.peak_live
            if name == "1f1b" or m == 1:
                assert one.makespan == base.makespan - costs["W"], (name, p, m)
            else:
                assert one.makespan == base.makespan, (name, p, m)
            if m > 1:
                assert all_.makespan == one.makespan, (name, p, m)
    assert split_last_backwards({0: "0F0 0B0"}, [1]) == {0: parse_schedule("0F0 0B0")}   # no B of stage 1


def test_lowering_with_unshard_gathers_each_stage_once_before_it_runs_and_frees_it_after_its_reduce():
    p, m, v = 2, 4, 2
    acts = schedule_actions("interleaved_1f1b", p, m, v)
    lo = lower(acts, p, v, unshard=True)
    assert format_schedule(lo[1][:6]) == "1UNSHARD 1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1"
    for r, lst in lo.items():
        for s in range(r, p * v, p):
            kinds = [a.kind for a in lst if a.stage == s]
            assert kinds[0] == "UNSHARD" and kinds[-2:] == ["REDUCE_GRAD", "RESHARD"]
            assert kinds.count("UNSHARD") == kinds.count("RESHARD") == 1
    no_reduce = lower(acts, p, v, unshard=True, reduce_grad=False)
    assert [a for lst in no_reduce.values() for a in lst if a.kind == "REDUCE_GRAD"] == []
    assert no_reduce[0][-1] == Action(0, "RESHARD")
    res = simulate(lo, p, m, v, costs={"UNSHARD": 0.5})
    assert res.busy == (0.5 * v + 3 * m * v,) * p


# --- broken schedules -------------------------------------------------------------------------

def test_a_wait_cycle_across_ranks_is_a_deadlock_naming_every_rank():
    acts = schedule_actions("gpipe", 2, 2)      # rank 0: 0F0 0F1 0B0 0B1
    acts[0][1], acts[0][3] = acts[0][3], acts[0][1]
    with pytest.raises(ScheduleError) as err:
        simulate(acts, 2, 2)
    msg = str(err.value)
    assert "deadlock" in msg
    assert "rank 0 blocked at 0B1" in msg and "1B1 (rank 1)" in msg
    assert "rank 1 blocked at 1F1" in msg and "0F1 (rank 0)" in msg
    assert isinstance(err.value, ShardingError) and isinstance(err.value, ValueError)


def test_a_backward_before_its_own_forward_is_named_as_an_order_violation():
    acts = schedule_actions("1f1b", 3, 4)
    lst = acts[2]
    lst[0], lst[1] = lst[1], lst[0]             # 2B0 before 2F0
    with pytest.raises(ScheduleError, match=r"rank 2 blocked at 2B0 .*2F0 \(rank 2, later in its own list\)"):
        simulate(acts, 3, 4)
    zb = schedule_actions("zb_h1", 2, 3)
    j = zb[1].index(Action(1, "W", 0))
    zb[1].insert(0, zb[1].pop(j))               # a W before its I
    with pytest.raises(ScheduleError, match=r"1W0 .*1I0 \(rank 1, later in its own list\)"):
        simulate(zb, 2, 3)
    lo = lower(schedule_actions("1f1b", 2, 2), 2)
    j = lo[1].index(Action(1, "RECV_F", 1))
    lo[1][j], lo[1][j + 1] = lo[1][j + 1], lo[1][j]
    with pytest.raises(ScheduleError, match=r"rank 1 blocked at 1F1 .*1RECV_F1 \(rank 1, later in its own list\)"):
        simulate(lo, 2, 2)


def test_missing_duplicate_and_misplaced_actions_are_all_reported_at_once():
    acts = schedule_actions("1f1b", 3, 4)
    acts[0].remove(Action(0, "F", 1))
    acts[1].append(Action(1, "B", 2))
    acts[2].append(Action(1, "F", 3))
    with pytest.raises(ScheduleError) as err:
        simulate(acts, 3, 4)
    msg = str(err.value)
    assert "0F1 is missing" in msg
    assert "1B2 appears 2 times" in msg
    assert "1F3 is on rank 2 — expected rank 1" in msg
    assert len(err.value.problems) >= 3

    zb = schedule_actions("zb_h1", 2, 2)
    zb[0].remove(Action(0, "W", 1))
    zb[1].append(Action(1, "B", 0))
    with pytest.raises(ScheduleError) as err:
        simulate(zb, 2, 2)
    assert "I without W" in str(err.value) and "both 1B0 and a split backward" in str(err.value)

    lo = lower(schedule_actions("gpipe", 2, 2), 2)
    lo[1].remove(Action(1, "RECV_F", 0))
    lo[0].append(Action(0, "RECV_F", 1))        # stage 0 receives nothing
    with pytest.raises(ScheduleError) as err:
        simulate(lo, 2, 2)
    assert "1RECV_F0 is missing" in str(err.value) and "0RECV_F1 sends or receives nothing" in str(err.value)

    for bad in ({0: schedule_actions("gpipe", 2, 2)[0], 1: schedule_actions("gpipe", 2, 2)[1], 2: []},
                {0: [Action(0, "F", 5)], 1: []}):
        with pytest.raises(ScheduleError, match="rank 2|0F5"):
            simulate(bad, 2, 2)
    with pytest.raises(ScheduleError, match="bad costs"):
        simulate(schedule_actions("gpipe", 2, 2), 2, 2, costs={"F": -1, "X": 1})
    with pytest.raises(ScheduleError, match="compute actions only"):
        lower(lo, 2)


def test_simulate_reads_strings_and_writes_records():
    res = simulate({0: "0F0 0B0", 1: ["1F0", "1B0"]}, 2, 1)
    assert res.records == (Record(0, "0F0", 0, 1), Record(1, "1F0", 1, 2), Record(1, "1B0", 2, 4),
                           Record(0, "0B0", 4, 6))
    assert res.makespan == 6 and res.busy == (3, 3) and res.idle == (0.5, 0.5) and res.idle_fraction == 0.5


# --- plan-time errors -------------------------------------------------------------------------

def test_schedule_problems_name_the_sizes_and_the_fix():
    assert all(schedule_problems(n, 4, 8, 2 if n == "interleaved_1f1b" else 1) == [] for n in SCHEDULES)
    (msg,) = schedule_problems("zb_h2", 4, 8, 1)
    assert msg.startswith("plan: unknown schedule — got 'zb_h2'; "
                          "expected one of gpipe, 1f1b, interleaved_1f1b, zb_h1. ")
    (msg,) = schedule_problems("interleaved_1f1b", 4, 3, 2)
    assert "m=3" in msg and "p=4" in msg and "expected m >= p" in msg and "microbatches >= 4" in msg
    (msg,) = schedule_problems("interleaved_1f1b", 4, 8, 1)
    assert "v=1" in msg and "v >= 2" in msg and "virtual=2" in msg
    (msg,) = schedule_problems("1f1b", 4, 8, 2)
    assert "'1f1b' runs one stage per rank" in msg and "v=2" in msg and "interleaved_1f1b" in msg
    assert len(schedule_problems("interleaved_1f1b", 4, 2, 1)) == 2            # all problems at once
    for p, m, v in ((0, 4, 1), (2, -1, 1), (2, 4, 0), (2.0, 4, 1), (True, 4, 1)):
        probs = schedule_problems("1f1b", p, m, v)
        assert len(probs) == 1 and "must be a positive int" in probs[0] and "expected an int >= 1" in probs[0]
    with pytest.raises(ScheduleError) as err:
        schedule_actions("interleaved_1f1b", 4, 2, 1)
    assert err.value.problems == schedule_problems("interleaved_1f1b", 4, 2, 1)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        bubble_formula("pipedream", 2, 2)
    for name, p, m, v, want in (("1f1b", 4, 8, 1, 3 / 11), ("gpipe", 2, 1, 1, 1 / 2),
                                ("interleaved_1f1b", 4, 8, 2, 3 / 19), ("zb_h1", 4, 8, 1, 3 / 27)):
        assert bubble_formula(name, p, m, v) == pytest.approx(want, abs=1e-12)
