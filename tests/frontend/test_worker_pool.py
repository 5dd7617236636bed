"""The worker pool itself: ranks answer in order, a failure names its rank, and a task's verdict
comes from its progress, not from a wall-clock deadline."""

import time

import pytest

import shardlib as sl
from shardlib.testing import WorldPool, progress

STALL = 2.0   # the quick pool's stall window, seconds; the tasks below outlast it on purpose


def _rank_and_world():
    import torch.distributed as dist
    return dist.get_rank(), dist.get_world_size()


def _fail_on_rank_one():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("boom on one")
    return "ok"


def test_pool_runs_every_rank(world):
    assert world(2, _rank_and_world) == [(0, 2), (1, 2)]


def test_pool_failure_names_rank_and_recovers(world):
    with pytest.raises(sl.WorkerError) as info:
        world(2, _fail_on_rank_one)
    assert info.value.rank == 1
    assert "boom on one" in str(info.value)
    assert isinstance(info.value.exc, ValueError)
    assert world(2, _rank_and_world) == [(0, 2), (1, 2)]   # a fresh world after the failure


# --- progress, not wall clock -------------------------------------------------------------------

@pytest.fixture(scope="module")
def quick_pool():
    """Two ranks that count as stalled after ``STALL`` s without progress (no collectives here)."""
    with WorldPool(2, stall=STALL, grace=1.5 * STALL, heartbeat=0.1) as pool:
        pool.run(_rank_and_world)   # the first task imports this module in the ranks
        yield pool


def _wait_while_reporting(seconds):
    """Sleeps (no CPU time) for ``seconds``, reporting progress in small steps."""
    end = time.monotonic() + seconds
    steps = 0
    while time.monotonic() < end:
        time.sleep(0.05)
        progress()
        steps += 1
    return steps


def _compute(seconds):
    """Uses CPU time without calling progress(): counts as progress by itself."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += sum(range(1000)) > 0
    return n > 0


def _sleep_on_rank_one(seconds):
    import torch.distributed as dist
    if dist.get_rank() == 1:
        time.sleep(seconds)   # neither CPU time nor progress(): stalled
    return dist.get_rank()


def _time_out_on_rank_zero(seconds):
    import torch.distributed as dist
    if dist.get_rank() == 0:   # as a collective would, waiting on the rank that is stuck
        raise TimeoutError("simulated: rank 0's collective timed out")
    time.sleep(seconds)


def _sleep_everywhere(seconds):
    time.sleep(seconds)


def test_a_slow_task_that_reports_progress_passes(quick_pool):
    steps = quick_pool.run(_wait_while_reporting, 2 * STALL)
    assert len(steps) == 2 and all(s > 0 for s in steps)


def test_a_slow_task_that_computes_passes_without_reporting(quick_pool):
    assert quick_pool.run(_compute, 2 * STALL) == [True, True]


@pytest.mark.timeout(60)   # without stall detection this would wait the whole sleep
def test_a_stalled_rank_is_named_with_its_stack_and_the_pool_recovers(quick_pool):
    with pytest.raises(sl.WorkerError) as info:
        quick_pool.run(_sleep_on_rank_one, 600)
    msg = str(info.value)
    assert info.value.rank == 1
    assert f"ranks [1] of 2 made no progress for {STALL:.0f} s" in msg
    assert "ranks [0] had answered" in msg
    assert "where rank 1 is" in msg and "_sleep_on_rank_one" in msg   # the stack it is stuck in
    assert "where rank 0 is" not in msg
    assert quick_pool.run(_rank_and_world) == [(0, 2), (1, 2)]   # a fresh world after the failure


@pytest.mark.timeout(60)
def test_ranks_stalled_together_are_all_named(quick_pool):
    with pytest.raises(sl.WorkerError) as info:
        quick_pool.run(_sleep_everywhere, 600)
    msg = str(info.value)
    assert info.value.rank == 0
    assert "ranks [0, 1] of 2 made no progress" in msg and "ranks [] had answered" in msg
    assert "where rank 0 is" in msg and "where rank 1 is" in msg


@pytest.mark.timeout(60)
def test_a_peer_that_failed_waiting_is_reported_with_the_rank_that_stalled(quick_pool):
    with pytest.raises(sl.WorkerError) as info:
        quick_pool.run(_time_out_on_rank_zero, 600)
    msg = str(info.value)
    assert info.value.rank == 0 and isinstance(info.value.exc, TimeoutError)
    assert "ranks [1] had not answered and made no progress" in msg
    assert "where rank 1 is" in msg and "_time_out_on_rank_zero" in msg
