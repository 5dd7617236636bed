"""A checkpoint on disk: its folder, manifest and files, the temporary-folder-then-rename install, and
a series of step folders behind a ``latest`` pointer. No engine and no collectives here: what is in
the files (and who writes which) is ``checkpoint.py``'s business.

A checkpoint is a folder holding DCP's ``*.distcp`` data files and ``.metadata`` beside
``manifest.json`` (format, version, and a hash of every file: XXH3-128, or SHA-256 where the
``xxhash`` package is missing and in checkpoints written before it). A save is written to
``.<name>.tmp-<token>`` beside the target and renamed into place when complete (an older checkpoint
moved aside first to ``.<name>.old-<token>``, removed after); ``clean_partial`` removes what an
interrupted save left.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from ...errors import ShardingError

FORMAT, VERSION = "shardlib-checkpoint", 2      # 2: DCP's standard names (runtime/checkpoint/dcp.py)
MANIFEST, LATEST = "manifest.json", "latest"


class CheckpointError(ShardingError):
    """A checkpoint cannot be written or read: not a checkpoint, half-written, corrupt, of another
    model, or the disk refused."""


def dcp_error() -> type:
    """DCP's ``CheckpointException`` (a ``BaseException``: it carries every rank's failure)."""
    from torch.distributed.checkpoint.api import CheckpointException
    return CheckpointException


def dcp_failure(e: BaseException) -> str:
    """The first underlying failure of a DCP error (``rank r: OSError: ...``), or ``e`` itself."""
    failures = getattr(e, "failures", None)
    if failures:
        r, inner = sorted(failures.items(), key=lambda x: x[0])[0]
        inner = inner[0] if isinstance(inner, tuple) and inner else inner     # (exception, its frames)
        return f"rank {r}: {type(inner).__name__}: {str(inner).splitlines()[0][:300] if str(inner) else ''}"
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


# The files' hash guards against truncation and corruption (a disk, a copy, a half-written save), not
# against tampering: the manifest sits beside the files it hashes. XXH3-128 does that 5x faster than
# SHA-256 on this machine's SHA-NI (6.6 vs 1.25 GB/s per core, ``benchmarks/results/checkpoint-*.md``);
# SHA-256 stays readable (checkpoints written before, or where ``xxhash`` is not installed).
HASHES = ("xxh3_128", "sha256")


def default_hash() -> str:
    """The hash a save writes: XXH3-128 where ``xxhash`` imports, else SHA-256."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "sha256"
    return "xxh3_128"


def hasher(algo: str):
    """A fresh ``update``/``hexdigest`` object of ``algo`` (one of ``HASHES``)."""
    if algo == "sha256":
        return hashlib.sha256()
    if algo == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            raise CheckpointError("load: the checkpoint's files are hashed with XXH3-128 and the xxhash package is "
                                  "not installed — pip install xxhash (a dependency of shardlib).") from None
        return xxhash.xxh3_128()
    raise CheckpointError(f"load: the manifest names hash {algo!r} — this shardlib checks {', '.join(HASHES)}.")


def file_hash(path: Path, algo: str) -> str:
    h = hasher(algo)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class _Tee:
    """A binary stream that hashes what is written through it (DCP writes a file front to back).
    (Hashing in a thread beside the writer was measured slower here: 4.3 vs 2.7 CPU-seconds per save
    of the 69M model at data 4 — the buffers' copies and the threads' hand-offs cost more than the
    overlap gains on two busy cores.)"""

    def __init__(self, raw, algo: str) -> None:
        self._raw, self._h = raw, hasher(algo)

    def write(self, b) -> int:
        self._h.update(b)
        return self._raw.write(b)

    def digest(self) -> str:
        return self._h.hexdigest()

    def __getattr__(self, name: str):
        return getattr(self._raw, name)


def hashing_writer(path: Path, algo: str):
    """DCP's ``FileSystemWriter`` into ``path`` that hashes each data file as it writes it (no second
    read): ``writer.hashes()`` gives ``{file name: hash}`` (``algo``) of the files this process wrote."""
    from contextlib import contextmanager

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFS(FileSystem):
        def __init__(self) -> None:
            self.tees: dict[str, _Tee] = {}

        @contextmanager
        def create_stream(self, p, mode):
            with super().create_stream(p, mode) as stream:
                if mode != "wb" or not str(p).endswith(".distcp"):
                    yield stream
                    return
                yield self.tees.setdefault(Path(p).name, _Tee(stream, algo))

    class Writer(dcp.FileSystemWriter):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.fs = HashingFS()

        def hashes(self) -> dict[str, str]:
            return {k: t.digest() for k, t in self.fs.tees.items()}

    return Writer(str(path))


def writable(folder: Path) -> str | None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"save: cannot create {folder} ({e.strerror}) — expected a folder this process may write to."
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"save: no permission to write in {folder} — expected a writable folder. Fix its permissions or save elsewhere."
    return None


def fsync_dir(folder: Path, files: tuple[str, ...] | None = None) -> None:
    """``fsync`` ``files`` (default: every file) in ``folder``, then the folder itself."""
    for f in folder.iterdir() if files is None else (folder / n for n in files):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def install(tmp: Path, path: Path) -> None:
    """Move the finished ``tmp`` to ``path``; an older checkpoint there is moved aside first and
    removed after (a crash between the two renames leaves it as ``.<name>.old-*``, whole)."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def clean_partial(folder: str | os.PathLike) -> list[Path]:
    """Remove what interrupted saves left in ``folder`` (their temporary folders); the complete
    checkpoints stay. Call it where no save is running (e.g. after Ctrl-C stopped the ranks)."""
    gone = []
    for p in Path(folder).glob(".*.tmp-*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        gone.append(p)
    return gone


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint folder: ``path`` itself, or the one its ``latest`` pointer names."""
    path = Path(path)
    if (path / LATEST).is_file():
        name = (path / LATEST).read_text().strip()
        return path / name
    return path


def latest(folder: str | os.PathLike) -> Path | None:
    """The checkpoint ``folder/latest`` names, if there is a complete one."""
    p = resolve(folder)
    return p if (p / MANIFEST).is_file() else None


def read_manifest(path: Path) -> dict:
    if not path.exists():
        old = sorted(path.parent.glob(f".{path.name}.old-*")) if path.parent.exists() else []
        hint = (f" {old[0]} beside it is the previous checkpoint of that name, whole (a save was stopped while "
                f"replacing it): rename it to {path.name} to load it.") if old else ""
        raise CheckpointError(f"load: {path} does not exist — expected a checkpoint folder written by engine.save "
                              "(or a folder with a 'latest' pointer)." + hint)
    if not (path / MANIFEST).is_file():
        tmp = sorted(path.parent.glob(f".{path.name}.tmp-*"))
        half = f" ({tmp[0].name} beside it is a save that never finished)" if tmp else ""
        raise CheckpointError(f"load: {path} is not a checkpoint — no {MANIFEST}{half}; expected a folder written "
                              "by engine.save. A half-written save has no manifest: load the previous checkpoint.")
    try:
        m = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"load: {path / MANIFEST} cannot be read ({e}) — the checkpoint is corrupt.") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"load: {path} is not a shardlib checkpoint (manifest format {m.get('format')!r}).")
    if m.get("version") != VERSION:
        raise CheckpointError(f"load: {path} has checkpoint format version {m.get('version')} — this shardlib "
                              f"reads version {VERSION}."
                              + (" Version 1 (shardlib 0.1) stored each box under its own key: load it with shardlib 0.1 and "
                                 "engine.export() the weights, then engine.load_pretrained them here (its optimizer "
                                 "state does not carry over)." if m.get("version") == 1 else ""))
    return m


def params_problems(manifest: dict, mine: dict[str, tuple], path: Path) -> list[str]:
    """Where the checkpoint's parameters (names, shapes) differ from ``mine``, one line each."""
    saved = manifest["params"]
    problems = []
    for name, shape in mine.items():
        got = saved.get(name)
        if got is None:
            problems.append(f"load: {path} has no parameter {name!r} {shape} — the checkpoint is of another model.")
        elif tuple(got["shape"]) != shape:
            problems.append(f"load: parameter {name!r} is {tuple(got['shape'])} in {path} but {shape} in "
                            "this model — expected the model the checkpoint was saved from.")
    problems += [f"load: {path} holds parameter {n!r}, which this model does not have." for n in saved if n not in mine]
    return problems


def resume_problems(resume: str | None, folder: str, mine: dict[str, tuple]) -> list[str]:
    """What would stop a run from resuming (``resume`` = ``"auto"``: ``folder``'s latest, if any; or a
    path) or from saving into ``folder``, checked in one process before any rank starts: the
    manifest read and compared with the model's parameters (the files' hashes are the ranks' job)."""
    problems = []
    dest = Path(folder).absolute()
    probe = next((p for p in (dest, *dest.parents) if p.exists()), None)
    if probe is None or not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        problems.append(f"checkpoint.dir: {folder} cannot be written ({probe} is not a writable folder) — "
                        "expected a folder this user may write to.")
    if not resume:
        return problems
    if resume == "auto":
        path = resolve(folder)
        if not (path / MANIFEST).is_file():
            return problems                 # nothing saved yet: the run starts at step 0
    else:
        path = resolve(resume)
    try:
        manifest = read_manifest(path)
        problems += params_problems(manifest, mine, path)
    except CheckpointError as e:
        problems += list(getattr(e, "problems", None) or [str(e)])
    return [p if p.startswith("checkpoint.") else f"checkpoint.resume: {p.removeprefix('load: ')}" for p in problems]


# ---- DCP's metadata, read without unpickling arbitrary objects -------------------------------

_SAFE_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_SAFE_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                 ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
                 ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its ``.metadata``; this unpickler builds only DCP's own metadata classes, torch's
    ``Size``, dtypes and layouts and paths — anything else (a function, an arbitrary class) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        cls = getattr(sys.modules.get(module), name, None)
        ok = ((module, name) in _SAFE_GLOBALS
              or (module in _SAFE_MODULES and isinstance(cls, type) and cls.__module__ == module)   # DCP's own classes
              or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not ok:
            raise CheckpointError(f"load: the checkpoint's DCP metadata asks for {module}.{name}, which a checkpoint "
                                  "never holds — refusing to unpickle it (the file was not written by engine.save).")
        return super().find_class(module, name)


def safe_reader(path: Path):
    """A ``FileSystemReader`` whose ``.metadata`` is read with :class:`_MetadataUnpickler` (DCP reads
    the tensor data itself with ``torch.load(weights_only=True)``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(dcp.FileSystemReader):
        refused: CheckpointError | None = None      # torch 2.11's DCP swallows read_metadata's errors

        def read_metadata(self, *args: Any, **kwargs: Any):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                try:
                    metadata = _MetadataUnpickler(f).load()
                except CheckpointError as e:
                    self.refused = e
                    raise
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(path))
