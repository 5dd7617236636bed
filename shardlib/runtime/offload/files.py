"""One rank's offload files (``runtime/offload/core.py``, ``runtime/offload/params.py``, ``runtime/offload/activations.py``):
preallocated generations read and written with ``preadv``/``pwrite``, mapped for in-place access, removed
with the engine."""

from __future__ import annotations

import errno
import os
import uuid
import weakref
from pathlib import Path

import torch

from ...errors import ShardingError


class OffloadError(ShardingError):
    """Reading or writing offloaded states failed; the step was not applied."""


class DiskStore:
    """One rank's offload files: ``<offload_dir>/shardlib-offload-<pid>-<id>/rank<r>.<name>.{0,1}.bin``,
    each ``sizes[i] * slots`` elements of ``dtype`` per entry ``i`` (the optimizer's: slot 0 the master,
    then the moments), preallocated so a step never needs new space. Removed when the engine goes."""

    def __init__(self, offload_dir: str, rank: int, sizes: list[int], slots: int, *,
                 dtype: torch.dtype = torch.float32, name: str = "optimizer"):
        self.folder = Path(offload_dir) / f"shardlib-offload-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.sizes, self.slots, self.dtype = sizes, slots, dtype
        self.item = dtype.itemsize
        self.offsets, off = [], 0
        for n in sizes:
            self.offsets.append(off)
            off += n * slots * self.item
        self.gen_bytes = off
        self.paths = [self.folder / f"rank{rank}.{name}.{g}.bin" for g in (0, 1)]
        self.fds = []
        for p in self.paths:
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            self.fds.append(fd)
            if off:
                try:
                    os.posix_fallocate(fd, 0, off)
                except OSError as e:
                    self.close()
                    raise OffloadError(f"parallelize: could not reserve {off / 2**30:.2f} GiB for the offloaded "
                                       f"{name} state in {p} — {e}. Free space under offload_dir, or offload "
                                       "less to 'disk'.") from None
        self.current = 0
        # the files go with the engine (or the process): fds closed, files and folder removed
        self._finalizer = weakref.finalize(self, close_and_remove, list(self.fds), list(self.paths), self.folder)

    def _pos(self, i: int, slot: int, lo: int) -> int:
        return self.offsets[i] + (slot * self.sizes[i] + lo) * self.item

    def read(self, gen: int, i: int, slot: int, lo: int, out: torch.Tensor) -> None:
        view = memoryview(out.view(torch.uint8).numpy())
        got = os.preadv(self.fds[gen], [view], self._pos(i, slot, lo))
        if got != len(view):
            raise OSError(errno.EIO, f"short read of {self.paths[gen]} ({got} of {len(view)} bytes)")

    def write(self, gen: int, i: int, slot: int, lo: int, values: torch.Tensor) -> None:
        data = values.detach().contiguous().view(torch.uint8).numpy()
        done = 0
        while done < len(data):
            n = os.pwrite(self.fds[gen], memoryview(data)[done:], self._pos(i, slot, lo) + done)
            if n <= 0:
                raise OSError(errno.EIO, f"write to {self.paths[gen]} made no progress")
            done += n

    def map(self, gen: int) -> int:
        """A handle on generation ``gen`` for ``view``."""
        return gen

    def view(self, gen: int, i: int, slot: int, lo: int = 0, n: int | None = None) -> torch.Tensor:
        """Elements ``[lo, lo + n)`` of entry ``i``'s ``slot`` in generation ``gen`` as a file-backed tensor
        (``MAP_SHARED``: reads and writes go to the file) whose storage is exactly that region — so a
        checkpoint writer sees a tensor of its own, not a view of a whole file it would copy out."""
        import numpy as np

        n = self.sizes[i] - lo if n is None else n
        if n == 0:
            return torch.empty(0, dtype=self.dtype)
        kind = {torch.float32: np.float32, torch.float64: np.float64}.get(self.dtype, np.uint16 if self.item == 2 else None)
        if kind is None:
            kind = np.uint8
            n *= self.item
        arr = np.memmap(self.paths[gen], dtype=kind, mode="r+", offset=self._pos(i, slot, lo), shape=(n,))
        return torch.from_numpy(arr).view(self.dtype)

    def close(self) -> None:
        if hasattr(self, "_finalizer"):
            self._finalizer()
        else:
            close_and_remove(self.fds, self.paths, self.folder)
        self.fds = []


def close_and_remove(fds: list[int], paths: list[Path], folder: Path) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    for p in paths:
        try:
            p.unlink()
        except OSError:
            pass
    try:
        folder.rmdir()
    except OSError:
        pass
