"""Nothing left behind: the ranks and the result directory of a launch go when the launcher goes.

``sl.launch`` keeps per-rank files (results, progress, fault stacks) in a temporary directory and
removes it when it returns or raises. A launcher killed outright (``kill -9``, the OOM killer)
runs no ``finally``, so two things cover that case:

* every rank asks the kernel to kill it when its parent dies (``prctl(PR_SET_PDEATHSIG)`` on
  Linux; ``die_with_parent``): the launcher, or the fork server that forked it, which exits when
  the launcher's end of its pipe closes — so no rank outlives the launcher, even one stuck in C code;
* a tiny watcher process (``Reaper``: the Python standard library only, no torch) holds the read
  end of a pipe from the launcher. The kernel closes the write end however the launcher exits;
  on end-of-file the watcher kills the ranks it was told of (where the kernel could not), waits
  for them to go, and removes the directory (and multiprocessing's, which holds the fork server's
  socket and which the launcher would have removed at its exit). It runs in its own session, so a signal to the
  launcher's process group (Ctrl-C, a terminal hang-up) does not take it down first.

When the launcher exits normally it says ``forget`` first (its ranks are already reaped, and
their process ids may be reused), removes the directory itself and closes the pipe.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading

_WATCHER = r"""
import os, shutil, signal, sys, time
path = sys.argv[1]
pids, dirs = set(), set()
for line in sys.stdin:                      # ends at EOF: the launcher closed the pipe, or died
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "pid":
        pids.add(int(arg))
    elif cmd == "dir":
        dirs.add(arg)
    elif cmd == "forget":
        pids.clear()
        dirs.clear()
for pid in pids:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False

end = time.monotonic() + 10
while True:                                 # a rank still dying may create a file after a first pass
    for d in (path, *dirs):
        shutil.rmtree(d, ignore_errors=True)
    if (not any(map(os.path.exists, (path, *dirs))) and not any(alive(p) for p in pids)) \
            or time.monotonic() > end:
        break
    time.sleep(0.05)
for d in (path, *dirs):
    shutil.rmtree(d, ignore_errors=True)
"""


class Reaper:
    """Removes ``path`` and kills the ``watch``-ed processes once this process is gone."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHER, path], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, text=True)
        except OSError:   # no watcher: the normal exit path still cleans up
            self._proc = None

    def _send(self, line: str) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            try:
                self._proc.stdin.write(line + "\n")
                self._proc.stdin.flush()
            except OSError:
                pass

    def watch(self, pids: list[int]) -> None:
        for pid in pids:
            self._send(f"pid {pid}")

    def remove_if_killed(self, path: str) -> None:
        """Also remove ``path`` if this process dies before ``close`` (a directory it would remove
        at a normal exit: multiprocessing's, which holds the fork server's socket)."""
        self._send(f"dir {path}")

    def close(self) -> None:
        """The launcher cleaned up itself: the watcher removes whatever is left and exits."""
        if self._proc is None:
            return
        self._send("forget")
        proc, self._proc = self._proc, None
        try:
            proc.stdin.close()
            proc.wait(timeout=1)
        except OSError:
            pass
        except subprocess.TimeoutExpired:   # a slow start on a busy machine: reap it in the background
            threading.Thread(target=proc.wait, daemon=True).start()


def die_with_parent(parent_pid: int, launcher_pid: int | None = None) -> None:
    """Have the kernel kill this process when its parent dies (Linux); exit now if it already has,
    or if ``launcher_pid`` (the process the parent serves, when that is not the parent) has."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:   # the parent died before the request was in place
        os._exit(1)
    if launcher_pid is not None and launcher_pid != parent_pid:
        try:
            os.kill(launcher_pid, 0)
        except ProcessLookupError:   # gone before this rank started: its server is leaving too
            os._exit(1)
        except OSError:
            pass
