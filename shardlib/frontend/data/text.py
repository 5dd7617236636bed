"""Text to train on, read as bytes, and the step-indexed batches of a run.

``load_text`` reads the Python standard library's own source (real text that ships with every
Python: no download), a file of yours (``data.path``) or a local dataset's text (``source:
dataset``, read by ``frontend/data/tokens.py``), checking it first: a path that is missing,
a folder, unreadable, too short for one sequence, or not UTF-8 text (a corrupt or binary file) is a
``DataError`` naming ``data.path`` and the fix. ``batch_at(text, step, ...)`` draws step ``step``'s
global batch from a generator seeded by ``(seed, step)``: every rank draws the same batch, and a run
resumed at step ``k`` draws exactly what it would have drawn (the data position is the step).
"""

from __future__ import annotations

import fnmatch
import os
import pathlib
import sysconfig

import torch

from ..config.run_config import DataConfig, DataError

VOCAB = 256          # byte-level


def _stdlib_sources() -> list[pathlib.Path]:
    """The stdlib's ``*.py`` files in ``sorted(root.rglob("*.py"))`` order, without ``site-packages``:
    that folder is not walked at all (with torch installed it holds >90% of the files — walking and
    sorting it cost each rank seconds), and the sort key is computed once per path, not per comparison."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        found += [pathlib.Path(folder, f) for f in files if fnmatch.fnmatchcase(f, "*.py")]
    return sorted(found, key=lambda p: p.parts)      # Path's own order (a POSIX path compares by its parts)


def _stdlib(limit: int) -> bytes:
    out, size = [], 0
    for path in _stdlib_sources():
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"".join(out)


def _file(path: str, limit: int) -> bytes:
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data.path: {path} does not exist — expected a text file. Check the path (relative paths "
                        f"are taken from {pathlib.Path.cwd()}).")
    if not p.is_file():
        raise DataError(f"data.path: {path} is not a file — expected a text file, not a {'folder' if p.is_dir() else 'special file'}.")
    try:
        with open(p, "rb") as f:
            data = f.read(limit)
    except OSError as e:
        raise DataError(f"data.path: {path} cannot be read ({e.strerror}) — expected a readable text file.") from None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(data) - 3:           # not just a character cut at the read limit
            raise DataError(f"data.path: {path} is not UTF-8 text (byte {e.start} is 0x{data[e.start]:02x}) — "
                            "expected a text file; it may be corrupt or binary.") from None
    return data


def _dataset(data: DataConfig, limit: int) -> bytes:
    """A local dataset's text (``frontend/data/tokens.py`` reads it) as UTF-8 bytes: documents end with a
    newline, a text file's lines keep theirs."""
    from .local_dataset import dataset_texts
    out, size = [], 0
    for text, _ in dataset_texts(data):
        out.append(text.encode("utf-8") + b"\n")
        size += len(out[-1])
        if size >= limit:
            break
    return b"".join(out)[:limit]


def load_text(data: DataConfig, seq: int) -> torch.Tensor:
    """The training text as a 1-D int64 tensor of byte values (at most ``data.megabytes``)."""
    limit = int(data.megabytes * 2**20)
    if data.source == "dataset":
        raw = _dataset(data, limit)
    else:
        raw = _file(data.path, limit) if data.path is not None else _stdlib(limit)
    if len(raw) < seq + 2:
        where = f"data.path: {data.path}" if data.path is not None else "data: the stdlib's source"
        raise DataError(f"{where} holds {len(raw)} bytes — expected at least one sequence of train.seq={seq} tokens "
                        f"and its target ({seq + 2} bytes). Use a longer text or a shorter train.seq.")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def text_share(data: DataConfig, index: int, size: int) -> bytes:
    """Data rank ``index`` of ``size``'s contiguous share of the stdlib's source or of ``data.path``
    (of their first ``data.megabytes``): a file is read at its share's offset, that share only.
    Checked by ``load_text`` before any rank starts."""
    limit = int(data.megabytes * 2**20)
    if data.path is None:
        raw = _stdlib(limit)[:limit]
        return raw[index * len(raw) // size:(index + 1) * len(raw) // size]
    path = pathlib.Path(data.path).expanduser()
    n = min(path.stat().st_size, limit)
    with open(path, "rb") as f:
        f.seek(index * n // size)
        return f.read((index + 1) * n // size - index * n // size)


def batch_at(text: torch.Tensor, step: int, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch: ``batch`` windows of ``seq + 1`` bytes at random offsets
    (inputs, and targets shifted by one), the same on every rank and on every resume."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(text) - seq - 1, (batch,), generator=gen)
    windows = torch.stack([text[s:s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
