"""The launcher: per-rank results, failures that name their rank fast, torchrun, gloo's abort at exit.

Spawning a torch world costs seconds here, so only four tests do (one of them via torchrun);
``collect``'s decisions are tested with plain processes that write a result file and then abort.
"""

import json
import multiprocessing
import os
import platform
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import shardlib as sl
from shardlib.frontend.launch.outcomes import collect
from shardlib.frontend.launch.outcomes import write as _write

# ---- sl.launch over a spawned gloo world -----------------------------------------------------------


def _rank_info(tag, scale=1):
    import torch.distributed as dist

    from shardlib.allocator import applied

    print(f"printed by rank {dist.get_rank()}")   # no flush: the launcher must not lose it
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "tag": tag, "scale": scale,
            "backend": dist.get_backend(), "threads": torch.get_num_threads(), "pid": os.getpid(),
            "mmap_threshold": applied()}


GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_launch_returns_results_in_rank_order(capfd, monkeypatch):
    """And every rank of a launch gets the host allocator setting (``shardlib/allocator.py``; its other
    cases in ``test_allocator.py``): ``SHARDLIB_MMAP_THRESHOLD`` from the environment, applied in each rank."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)   # ranks' stdout is block-buffered then
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("SHARDLIB_MMAP_THRESHOLD", "1048576")
    results = sl.launch(_rank_info, 2, "t", scale=3, backend="gloo", threads=1)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert (r["world"], r["tag"], r["scale"], r["backend"], r["threads"]) == (2, "t", 3, "gloo", 1)
        assert r["pid"] != os.getpid()
    assert [r["mmap_threshold"] for r in results] == ([1048576, 1048576] if GLIBC else [None, None])
    out = capfd.readouterr().out
    assert "printed by rank 0" in out and "printed by rank 1" in out


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("bad input on rank 1")
    time.sleep(600)   # stuck outside any collective: only the launcher can stop it


def test_exception_names_its_rank_and_the_rest_are_stopped():
    t0 = time.monotonic()
    with pytest.raises(sl.WorkerError) as info:
        sl.launch(_fail_on_rank_one, 2, timeout=300)
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.rank == 1
    assert isinstance(err.exc, ValueError) and str(err.exc) == "bad input on rank 1"
    assert "_fail_on_rank_one" in err.remote_traceback and "bad input on rank 1" in err.remote_traceback
    assert "rank 1 of 2 failed: ValueError: bad input on rank 1" in str(err)
    assert "ranks [0] were stopped" in str(err)
    assert elapsed < 30, elapsed   # spawn + grace; not rank 0's 600 s, nor the 300 s collective timeout


def _abort_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(0.3)
        os.abort()   # dies by SIGABRT without writing a result
    dist.all_reduce(torch.ones(1))   # rank 0 fails here once rank 1 is gone


def test_rank_that_dies_is_named_not_the_peer_it_took_down():
    with pytest.raises(sl.WorkerError) as info:
        sl.launch(_abort_on_rank_one, 2, timeout=300)
    err = info.value
    assert err.rank == 1, str(err)
    assert "rank 1 was killed by SIGABRT before returning a result" in str(err)
    assert "_abort_on_rank_one" in err.remote_traceback   # its stack, from faulthandler


def test_a_death_is_dated_by_its_stack_when_the_parent_learns_of_it_late(tmp_path):
    """A rank killed by a signal is dated by when faulthandler wrote its stack, not by when the parent last
    saw it alive: on a busy machine the fork server reports a forked rank's exit late, after the peer that
    lost its connection to it wrote its error (the race a loaded run of the test above hit once)."""
    from shardlib.frontend.launch.outcomes import _death, fault_path

    path = fault_path(str(tmp_path), 1)
    with open(path, "w") as f:
        f.write('Fatal Python error: Aborted\n  File "x.py", line 1 in f\n')
    died = time.time() - 10.0
    os.utime(path, (died, died))
    late = time.time()                     # "still alive" as the parent last saw it
    assert _death(1, -6, late, str(tmp_path))["time"] == pytest.approx(died, abs=1e-3)
    assert _death(1, 1, late, str(tmp_path))["time"] == late       # an exit code: no fatal signal, no stack time
    open(path, "w").close()                                          # killed without a stack (SIGKILL)
    assert _death(1, -9, late, str(tmp_path))["time"] == late


# ---- the same program under torchrun ----------------------------------------------------------------

_TORCHRUN_SCRIPT = '''
import json, os
import torch, torch.distributed as dist
import shardlib as sl

def main(k):
    mesh = sl.Mesh({"data": 2})
    x = torch.tensor([float(mesh.rank + k)])
    dist.all_reduce(x, group=mesh.group("data"))
    return {"rank": mesh.rank, "sum": x.item(), "pid": os.getpid()}

if __name__ == "__main__":
    out = sl.launch(main, 2, 10)
    with open(f"rank{os.environ['RANK']}.json", "w") as f:   # a file each: the ranks' stdout interleaves
        json.dump({"out": out, "pid": os.getpid(), "rank": int(os.environ["RANK"]),
                   "left_world": not dist.is_initialized()}, f)
'''


def test_torchrun_runs_the_same_program_unchanged(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(_TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    # exit code 0 also means gloo did not abort at interpreter exit (it did in ~1 of 4 runs before)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [d["rank"] for d in reports] == [0, 1]
    for d in reports:
        # fn ran once, in the process torchrun started, on torchrun's world
        assert d["out"] == [{"rank": d["rank"], "sum": 21.0, "pid": d["pid"]}]
        assert d["left_world"]


# ---- inside a world that already exists ---------------------------------------------------------------

def _pid_and_rank(k):
    import torch.distributed as dist

    return os.getpid(), dist.get_rank(), k


def _launch_in_existing_world(hide_env):
    import torch.distributed as dist

    saved = {}
    if hide_env:   # as if the program had called init_process_group itself, without torchrun
        saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR") if k in os.environ}
    try:
        out = sl.launch(_pid_and_rank, 2, "k")
    finally:
        os.environ.update(saved)
    x = torch.ones(1)
    dist.all_reduce(x)   # launch did not tear down a world it did not create
    return out, os.getpid(), dist.get_rank(), x.item()


@pytest.mark.parametrize("hide_env", [False, True])
def test_launch_inside_an_existing_world_runs_in_place(world, hide_env):
    for out, pid, rank, total in world(2, _launch_in_existing_world, hide_env):
        assert out == [(pid, rank, "k")] and total == 2.0


def _raise_while_peer_waits():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("no such parameter")
    dist.all_reduce(torch.ones(1))   # blocks: rank 1 never joins, and its process stays up
    return "unreachable"


def test_pool_failure_with_a_peer_stuck_in_a_collective_is_fast(world):
    """The test harness: a failing rank fails the test within seconds, not at the collective
    timeout, and the next task gets a fresh world."""
    t0 = time.monotonic()
    with pytest.raises(sl.WorkerError) as info:
        world(2, _raise_while_peer_waits)
    assert time.monotonic() - t0 < 15
    assert info.value.rank == 1 and isinstance(info.value.exc, KeyError)
    assert world(2, _pid_and_rank, 0)[1][1:] == (1, 0)


def test_launch_rejects_bad_arguments():
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(sl.ShardingTypeError, match="nprocs must be a positive int"):
            sl.launch(_pid_and_rank, bad)
    with pytest.raises(sl.ShardingTypeError, match="fn must be callable"):
        sl.launch("not a function", 2)


def test_start_method_is_the_fork_server_unless_told_and_a_bad_one_is_named(monkeypatch):
    from shardlib.frontend.launch.launcher import start_method

    monkeypatch.delenv("SHARDLIB_START_METHOD", raising=False)
    assert start_method() == ("forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn")
    monkeypatch.setenv("SHARDLIB_START_METHOD", "spawn")
    assert start_method() == "spawn"
    monkeypatch.setenv("SHARDLIB_START_METHOD", "fork")
    with pytest.raises(sl.ShardingError, match="SHARDLIB_START_METHOD='fork' — expected 'forkserver' or 'spawn'"):
        sl.launch(_pid_and_rank, 2)


# ---- collect(): success is decided from the result files ------------------------------------------------

# A plain child (no torch import, starts in a fraction of a second): it moves a result file that
# the test wrote with shardlib's own _write into place, then exits the way the test asks.
_CHILD = textwrap.dedent('''
    import os, shutil, time
    if src:
        shutil.copy(src, dst + ".tmp")
        os.replace(dst + ".tmp", dst)
    if then == "abort":
        os.abort()
    elif then == "sleep":
        time.sleep(600)
    elif then.startswith("exit"):
        os._exit(int(then[4:]))
''')


class _Unrebuildable(Exception):
    """Pickles, but cannot be rebuilt from its args (a common shape for user exceptions)."""

    def __init__(self, what, where):
        super().__init__(f"{what} at {where}")


def _start(tmp_path, plans):
    """plans[r] = (payload or None, then): rank r's outcome file and how it exits."""
    result_dir = tmp_path / "results"
    result_dir.mkdir()
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for r, (payload, then) in enumerate(plans):
        src = ""
        if payload is not None:
            src = str(tmp_path / f"staged{r}.pkl")
            _write(src, payload)
        p = ctx.Process(target=exec, args=(_CHILD, {"src": src, "dst": str(result_dir / f"rank{r}.pkl"),
                                                    "then": then}))
        p.start()
        procs.append(p)
    return procs, str(result_dir)


def test_abort_after_writing_the_result_does_not_fail_the_run(tmp_path):
    procs, result_dir = _start(tmp_path, [({"ok": True, "result": "r0"}, "exit0"),
                                          ({"ok": True, "result": {"r": 1}}, "abort")])
    assert collect(procs, result_dir, 2, run_timeout=60, grace=5) == ["r0", {"r": 1}]
    assert procs[1].exitcode == -6   # it really did die by SIGABRT


def test_death_before_writing_fails_and_stops_the_others(tmp_path):
    procs, result_dir = _start(tmp_path, [(None, "exit3"), ({"ok": True, "result": 1}, "sleep")])
    t0 = time.monotonic()
    with pytest.raises(sl.WorkerError) as info:
        collect(procs, result_dir, 2, run_timeout=60, grace=1)
    assert time.monotonic() - t0 < 15
    assert info.value.rank == 0
    assert "rank 0 exited with code 3 before returning a result" in str(info.value)
    assert not any(p.is_alive() for p in procs)   # rank 1 (sleeping 600 s) was stopped


def test_error_survives_an_exception_that_cannot_be_rebuilt(tmp_path):
    try:
        raise _Unrebuildable("bad shard", "layer 3")
    except _Unrebuildable as e:
        import traceback

        payload = {"ok": False, "time": time.time(), "error": f"_Unrebuildable: {e}",
                   "traceback": traceback.format_exc(), "exc": e}
    procs, result_dir = _start(tmp_path, [({"ok": True, "result": 0}, "exit0"), (payload, "exit1")])
    with pytest.raises(sl.WorkerError) as info:
        collect(procs, result_dir, 2, run_timeout=60, grace=1)
    err = info.value
    assert err.rank == 1 and "bad shard at layer 3" in str(err)
    assert "test_error_survives_an_exception_that_cannot_be_rebuilt" in err.remote_traceback
    assert err.exc is None   # could not be rebuilt here; message and traceback still arrive


def test_unpicklable_result_is_an_error_not_a_crash(tmp_path):
    procs, result_dir = _start(tmp_path, [({"ok": True, "result": 0}, "exit0"),
                                          ({"ok": True, "result": lambda: 1}, "exit0")])
    with pytest.raises(sl.WorkerError, match="could not pickle the rank's result") as info:
        collect(procs, result_dir, 2, run_timeout=60, grace=1)
    assert info.value.rank == 1


def test_run_timeout_stops_every_rank(tmp_path):
    procs, result_dir = _start(tmp_path, [(None, "sleep"), (None, "sleep")])
    with pytest.raises(sl.WorkerError, match=r"ranks \[0, 1\] did not finish within 1 s"):
        collect(procs, result_dir, 2, run_timeout=1, grace=1)
    assert not any(p.is_alive() for p in procs)
