"""Failures that name the right rank: a hang blames the rank that never arrived, not the peer
that timed out waiting (under ``sl.launch`` and ``torchrun``); an unguarded script says so in
one line; a launcher killed with ``kill -9`` leaves no ranks and no files behind.

Collective timeouts are set short (``Mesh(timeout=3)``) where a test is about a hang, and the
world's own timeout long, so a slow start on a loaded machine is not mistaken for a hang.
"""

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

import shardlib as sl
from shardlib.comm import core, progress
from shardlib.frontend.launch import diagnose
from shardlib.frontend.launch.outcomes import UNGUARDED, collect
from shardlib.frontend.launch.outcomes import write as _write
from shardlib.testing import get_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **extra)
    return env


def _rec(seq, op="all_reduce", axes=("data",), t=None, step=-1):
    """A progress record as a rank would write it."""
    return progress._REC.pack(seq, step, time.time() if t is None else t, 1, op.encode(), ",".join(axes).encode())


# ---- the progress record -----------------------------------------------------------------------------

def _progress_of_collectives():
    mesh = get_mesh({"data": 2})
    before = progress.current()["seq"]
    core.all_reduce(torch.ones(3), mesh, "data")
    after_reduce = progress.current()
    core.send_recv(torch.ones(2), mesh, "data", [(0, 0)])   # rank 1 takes no part, and still counts it
    after_ppermute = progress.current()
    return before, after_reduce, after_ppermute


def test_every_rank_records_each_collective_it_enters(world):
    for before, after_reduce, after_ppermute in world(2, _progress_of_collectives):
        assert after_reduce["seq"] == before + 1
        assert (after_reduce["op"], after_reduce["axes"]) == ("all_reduce", ("data",))
        assert after_ppermute["seq"] == before + 2 and after_ppermute["op"] == "send_recv"


def test_record_round_trips_through_a_file(tmp_path):
    path = str(tmp_path / "p")
    with open(path, "wb") as f:
        f.write(_rec(7, "all_gather", ("data", "tensor"), t=123.5, step=4))
    assert progress.read_file(path) == {"seq": 7, "step": 4, "time": 123.5, "pid": 1, "op": "all_gather",
                                        "axes": ("data", "tensor"), "recent": []}
    assert progress.read_file(str(tmp_path / "missing")) is None


def test_laggards_are_the_lowest_sequence():
    recs = {r: progress.unpack(_rec(s)) for r, s in enumerate([7, 6, 5, 7])}
    assert progress.laggards(recs) == [2]
    assert progress.laggards({0: progress.unpack(_rec(3)), 1: None}) == [1]   # never entered one
    assert progress.laggards({r: progress.unpack(_rec(3)) for r in range(3)}) == []


def test_no_hang_report_when_a_laggard_failed_itself_or_nobody_is_behind():
    recs = {0: progress.unpack(_rec(2)), 1: progress.unpack(_rec(1))}
    err = {"time": time.time(), "error": "RuntimeError: timed out"}
    assert diagnose.hang_report(recs, {1: err}, set(), 2) is None         # rank 1 raised: it is the cause
    assert diagnose.hang_report(recs, {0: err, 1: err}, set(), 2) is None
    same = {0: progress.unpack(_rec(2)), 1: progress.unpack(_rec(2))}
    assert diagnose.hang_report(same, {0: err}, set(), 2) is None
    behind, msg = diagnose.hang_report(recs, {0: err}, {1}, 2)
    assert behind == [1] and "Rank 1: its last collective was #1 all_reduce(data)" in msg
    assert "it had returned its result" in msg


# ---- collect(): the parent names the rank that never arrived -----------------------------------------

_HUNG_CHILD = textwrap.dedent('''
    import faulthandler, signal, time
    log = open(fault, "w")
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    open(ready, "w").close()
    def waiting_for_nothing():
        time.sleep(600)
    waiting_for_nothing()
''')


def test_collect_blames_the_rank_behind_and_shows_its_stack(tmp_path):
    result_dir = tmp_path / "results"
    result_dir.mkdir()
    now = time.time()
    (result_dir / "rank0.progress").write_bytes(_rec(2, t=now - 5))
    (result_dir / "rank1.progress").write_bytes(_rec(1, t=now - 6, step=3))
    _write(str(result_dir / "rank0.pkl"), {"ok": False, "time": now, "traceback": "",
                                          "error": "RuntimeError: Timed out waiting 3000ms for recv operation"})
    ctx = multiprocessing.get_context("spawn")
    timed_out = ctx.Process(target=time.sleep, args=(600,))   # rank 0: failed, stays up a while
    hung = ctx.Process(target=exec, args=(_HUNG_CHILD, {"fault": str(result_dir / "rank1.fault"),
                                                        "ready": str(tmp_path / "ready")}))
    procs = [timed_out, hung]
    for p in procs:
        p.start()
    while not (tmp_path / "ready").exists():   # its stack handler is in place
        assert hung.is_alive()
        time.sleep(0.05)
    with pytest.raises(sl.WorkerError) as info:
        collect(procs, str(result_dir), 2, run_timeout=120, grace=1)
    err, msg = info.value, str(info.value)
    assert err.rank == 1, msg
    assert msg.startswith("rank 1 of 2 never reached collective #2 all_reduce(data), where rank 0 waited "
                          "until it failed."), msg
    assert "Rank 1: its last collective was #1 all_reduce(data), 6.0 s before the failure, at step 3" in msg
    assert "it was still running and was stopped" in msg
    assert "SHARDLIB_TIMEOUT" in msg
    assert "Timed out waiting 3000ms" in msg            # the peer's error is kept, below
    assert "waiting_for_nothing" in err.remote_traceback  # where the hung rank was
    assert not any(p.is_alive() for p in procs)


# ---- the same, end to end ----------------------------------------------------------------------------

def _hang_on_rank_one():
    import torch.distributed as dist

    mesh = sl.Mesh({"data": 2}, timeout=3)
    x = torch.ones(2)
    core.all_reduce(x, mesh, "data")
    if dist.get_rank() == 1:
        time.sleep(600)   # never reaches the next collective
    core.all_reduce(x, mesh, "data")


def _parted_ranks():
    import torch.distributed as dist

    mesh = sl.Mesh({"data": 2}, timeout=3)
    x = torch.ones(4)
    dist.barrier()                       # the world's timeout: however late a busy machine starts a rank
    for _ in range(3):
        core.all_reduce(x, mesh, "data")
    if mesh.rank == 1:                   # a data-dependent branch: a collective rank 0 does not run
        core.all_gather(torch.ones(8), mesh, "data")
    core.all_reduce(x, mesh, "data")
    core.all_reduce(x, mesh, "data")


def test_the_flight_recorder_shows_each_ranks_last_collectives_and_where_they_parted():
    with pytest.raises(sl.WorkerError) as info:
        sl.launch(_parted_ranks, 2, timeout=120)
    msg = str(info.value)
    assert "flight recorder (each rank's last collectives, oldest first):" in msg, msg
    assert "rank 0: " in msg and "rank 1: " in msg and "all_reduce(data) 16 B" in msg, msg
    # the barrier is #1 (a collective outside shardlib's: not counted); three all-reduces agree, then they part
    assert "the ranks parted at collective #4: rank 0 entered #4 all_reduce(data) 16 B" in msg, msg
    assert "rank 1 #4 all_gather(data)" in msg, msg


def test_parted_needs_ranks_that_agreed_first():
    def rec(*kinds):
        return {"recent": [{"seq": i + 1, "op": op, "axes": ("data",), "bytes": b, "step": None}
                           for i, (op, b) in enumerate(kinds)]}
    same, other = ("all_reduce", 16), ("all_gather", 32)
    assert progress.parted({0: rec(same, same, same), 1: rec(same, other, same)}) == (2, [1])
    assert progress.parted({0: rec(same, same), 1: rec(same, same)}) is None
    assert progress.parted({0: rec(other, same), 1: rec(same, same)}) is None      # never agreed: other roles


def test_launch_names_the_rank_that_never_reached_the_collective():
    with pytest.raises(sl.WorkerError) as info:
        sl.launch(_hang_on_rank_one, 2, timeout=120)
    err, msg = info.value, str(info.value)
    assert err.rank == 1, msg
    assert "rank 1 of 2 never reached collective" in msg and "where rank 0 waited until it failed" in msg
    assert "its last collective was" in msg and "all_reduce(data)" in msg
    assert "SHARDLIB_TIMEOUT" in msg and "120 s from launch(timeout=...)" in msg
    assert "_hang_on_rank_one" in err.remote_traceback


_TORCHRUN_HANG = '''
import threading
import time
import torch
import shardlib as sl
from shardlib.comm import core

def main():
    mesh = sl.Mesh({"data": 2}, timeout=5)
    x = torch.ones(2)
    torch.distributed.barrier()          # the world's timeout: however late a busy machine starts rank 1
    core.all_reduce(x, mesh, "data")
    if mesh.rank == 1:
        time.sleep(600)
    threading.Thread(target=time.sleep, args=(600,)).start()   # a thread that would hold rank 0's exit
    core.all_reduce(x, mesh, "data")

if __name__ == "__main__":
    sl.launch(main, 2, timeout=120)
'''


def test_torchrun_rank_that_times_out_names_the_peer_that_never_arrived(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(_TORCHRUN_HANG)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, env=_env(SHARDLIB_TIMEOUT="120", SHARDLIB_EXIT_GRACE="2"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    err = proc.stderr
    assert "rank 0 was in collective #2 all_reduce(data) when it failed; rank 1 of 2 never reached it" in err, err
    # rank 0's exit, held by its thread, is cut at SHARDLIB_EXIT_GRACE: torchrun sees it fail and stops rank 1
    assert "has not exited in 2 s (SHARDLIB_EXIT_GRACE)" in err and "Thread 0x" in err, err
    assert "rank 1: last collective #1 all_reduce(data)" in err
    assert "SHARDLIB_TIMEOUT=120 s" in err


class _Store:
    """The few store calls the watch makes, over a dict."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = bytes(value)

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def test_torchrun_note_names_only_the_peers_behind():
    progress.enter("all_gather", ("data",))   # this process is "rank 0", in a collective
    store = _Store()
    store.set("shardlib/progress/1", _rec(progress.current()["seq"] + 5))   # ahead of this rank
    watch = diagnose.WorldWatch(store=store, rank=0, world=3)   # rank 2 never published: behind
    try:
        exc = RuntimeError("Timed out waiting 3000ms")
        watch.annotate(exc)
    finally:
        watch.stop()
    note = "\n".join(getattr(exc, "__notes__", [])) or str(exc)
    assert "rank 2 of 3 never reached it" in note and "rank 2: no collective yet" in note
    assert "rank 1:" not in note
    value = ValueError("a user error")
    diagnose.WorldWatch(store=_Store(), rank=0, world=2).annotate(value)
    assert not getattr(value, "__notes__", None)   # not a failed collective: left alone


# ---- an unguarded script -------------------------------------------------------------------------------

def test_unguarded_script_gets_one_line_saying_what_to_do(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text("import shardlib as sl\n\ndef f():\n    return 1\n\nprint(sl.launch(f, 2))\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == f"shardlib.errors.ShardingError: {UNGUARDED}"
    assert "bootstrapping" not in proc.stderr and proc.stderr.count("Traceback") == 1, proc.stderr


# ---- kill -9 of the launcher ---------------------------------------------------------------------------

_SLEEPER = '''
import os, sys, time
import shardlib as sl

def main(d):
    import torch.distributed as dist
    path = os.path.join(d, f"rank{dist.get_rank()}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(600)

if __name__ == "__main__":
    sl.launch(main, 2, sys.argv[1], timeout=120)
'''


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")   # a zombie is gone
    except FileNotFoundError:
        return False


def _ours(tmp):
    return [d for d in tmp.iterdir() if not d.name.startswith("torchinductor_")]


def test_kill_9_of_the_launcher_leaves_no_ranks_and_no_files(tmp_path):
    # the launcher's TMPDIR: only this run's directory can appear here. Short: multiprocessing's fork server
    # binds a socket in it, and an AF_UNIX path has 108 bytes (pytest's tmp_path on a machine that has run
    # pytest a hundred times leaves too few: "AF_UNIX path too long")
    tmp = Path(tempfile.mkdtemp(prefix="sl-k9-", dir="/tmp"))
    try:
        _kill_9_of_the_launcher(tmp_path, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _kill_9_of_the_launcher(tmp_path: Path, tmp: Path) -> None:
    script = tmp_path / "prog.py"
    script.write_text(_SLEEPER)
    log = tmp_path / "launcher.log"       # what the launcher said, if it stops early
    with open(log, "wb") as out:
        launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=tmp_path,
                                    env=_env(TMPDIR=str(tmp)), stdout=out, stderr=subprocess.STDOUT)
    try:
        pids = [tmp_path / f"rank{r}.pid" for r in range(2)]
        deadline = time.monotonic() + 180
        while not all(p.exists() for p in pids):   # both ranks running
            assert launcher.poll() is None and time.monotonic() < deadline, \
                f"the ranks did not start (launcher exit {launcher.poll()}): {log.read_text(errors='replace')[-3000:]}"
            time.sleep(0.1)
        ranks = [int(p.read_text()) for p in pids]
        # the run's directory, multiprocessing's (the fork server's socket); torch's compile cache
        # (torchinductor_<user>, made by importing torch._dynamo, shared by every run) is not the run's
        made = sorted(d.name.split("-")[0] for d in _ours(tmp))
        assert made == ["pymp", "shardlib"], made
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 30
    while (_ours(tmp) or any(_alive(p) for p in ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ours(tmp) == []
    assert not any(_alive(p) for p in ranks)