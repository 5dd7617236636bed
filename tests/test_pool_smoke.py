"""The worker pool itself: ranks answer in order and a failure names its rank."""

import pytest

import shardlib as sl


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
