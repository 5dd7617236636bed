"""Shared fixtures: worker pools reused across the whole session, one per world size.

``world(n, fn, *args)`` runs ``fn(*args)`` on every rank of an ``n``-rank gloo world and returns
the per-rank results. ``fn`` must be a module-level function (it is pickled by reference).
A failing rank raises ``shardlib.WorkerError`` here, with the rank's traceback.

No test is failed by a wall-clock deadline: a collective that never completes fails at its timeout
(``SHARDLIB_TEST_TIMEOUT``), and a rank that makes no progress at all (no CPU time, no
``shardlib.testing.progress()``) for twice that long is named with its stack (see ``WorldPool``).
Keep each test's work bounded all the same (split long sweeps into chunks): a test that runs for
minutes on a busy machine hides what is slow.
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
