"""Shared fixtures: worker pools reused across the whole session, one per world size.

``world(n, fn, *args)`` runs ``fn(*args)`` on every rank of an ``n``-rank gloo world and returns
the per-rank results. ``fn`` must be a module-level function (it is pickled by reference).
A failing rank raises ``shardlib.WorkerError`` here, with the rank's traceback.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHARDLIB_TEST_TIMEOUT", "60")


@pytest.fixture(scope="session")
def world():
    from shardlib.testing import WorldPool

    pools: dict[int, WorldPool] = {}

    def run(nprocs: int, fn, *args, **kwargs):
        if nprocs not in pools:
            pools[nprocs] = WorldPool(nprocs)
            pools[nprocs].start()
        return pools[nprocs].run(fn, *args, **kwargs)

    yield run
    for pool in pools.values():
        pool.close()
