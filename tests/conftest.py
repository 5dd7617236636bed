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
import sys

import pytest

# The tests mirror the package (algebra, comm, planner, runtime, frontend, e2e, package); their shared helpers
# (hf_families, llama, ...) sit here, and a test module may import another's workers by its bare name: every
# folder is on sys.path, before any worker pool starts (the ranks take the parent's sys.path)
_HERE = os.path.dirname(os.path.abspath(__file__))
for _d in sorted(os.listdir(_HERE)):
    if os.path.isdir(os.path.join(_HERE, _d)) and not _d.startswith((".", "_")) and os.path.join(_HERE, _d) not in sys.path:
        sys.path.insert(0, os.path.join(_HERE, _d))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHARDLIB_TEST_TIMEOUT", "60")
if "torch" in sys.modules:   # imported before us (a plugin): its thread pool ignored the variable above; the
    # references computed here must round as the one-thread ranks do (another thread count blocks another way)
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The costliest files first (CPU-seconds, one process, 2026-11-26): the two workers (-n 2 --dist loadfile) take
# files in collection order, and one of these started last would run alone at the end while the other waits.
HEAVY_FIRST = ("test_redistribution_on_ranks.py", "test_examples.py", "test_transformers_families.py",
               "test_pipeline_hf.py", "test_pipeline_training.py", "test_checkpoint_change_mesh.py",
               "test_engine_data_parallel.py", "test_offload.py", "test_autoplan.py", "test_train_hf.py",
               "test_parity_matrix.py", "test_tensor_parallel.py", "test_train_peft.py")


# files whose tests start processes of their own (not through the ``world`` pools)
SPAWNS = ("test_launch_local.py", "test_launch_failures.py", "test_launch_cluster.py", "test_worker_pool.py")


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))   # stable: the rest keep their order
    # ``-m "not multiprocess"``: the pure tests alone (a process world of their own, or the warm pools, for the rest)
    for item in items:
        if ("world" in getattr(item, "fixturenames", ()) or item.path.parent.name == "e2e"
                or item.path.name in SPAWNS):
            item.add_marker(pytest.mark.multiprocess)


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


@pytest.fixture(scope="session")
def made(tmp_path_factory):
    """A tiny Llama folder (``examples/make_tiny_hf.py``: a BPE tokenizer trained on the stdlib's source,
    random weights) and 60 documents as JSON lines and parquet; datasets' cache in a tmp dir. Made once
    for the session: ``test_train_hf`` and ``test_train_peft`` both train it (the tokenizer's training
    costs seconds on a busy machine)."""
    import importlib.util
    import json
    import sysconfig
    from pathlib import Path

    import pandas as pd

    root = tmp_path_factory.mktemp("hf")
    example = Path(__file__).resolve().parents[1] / "examples" / "make_tiny_hf.py"
    spec = importlib.util.spec_from_file_location("example_make_tiny_hf", example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = module.make(root / "tiny-llama", vocab=300, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64,
                         positions=64, megabytes=0.25)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = [{"text": p.read_text(errors="ignore")[:3000], "source": p.name} for p in sorted(stdlib.glob("*.py"))[:60]]
    with open(root / "docs.jsonl", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    pd.DataFrame(docs).to_parquet(root / "docs.parquet")
    return {"folder": folder, "root": root, "env": {**os.environ, "PYTHONUNBUFFERED": "1",
                                                    "HF_DATASETS_CACHE": str(root / "cache")}}

