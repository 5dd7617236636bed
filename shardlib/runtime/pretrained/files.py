"""A transformers folder on disk: the safetensors headers read and checked whole (no tensor data), a
header written up front for a file filled tensor by tensor (a failed write leaving no temporary
file), and the index. No engine here: ``pretrained.py`` decides who reads and writes what."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import NamedTuple

import torch

from ..checkpoint.files import CheckpointError

SAFE, INDEX, CONFIG = "model.safetensors", "model.safetensors.index.json", "config.json"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_CODES = {v: k for k, v in DTYPES.items()}
FLOATS = ("F64", "F32", "F16", "BF16")
RELOAD = "Save the folder again (model.save_pretrained) or download it again."


class Entry(NamedTuple):
    """One tensor in a safetensors file: where it is, its dtype code, shape and name in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    key: str


def _header(file: Path) -> dict[str, Entry]:
    """The tensors a safetensors file holds, checked whole against the file's size."""
    size = file.stat().st_size
    bad = f"load_pretrained: {file} is not a whole safetensors file"
    with open(file, "rb") as fh:
        raw = fh.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n < 0 or n > size - 8:
            raise CheckpointError(f"{bad} — got {size} bytes, its header says {n}; expected a header and data. "
                                  f"The file is truncated. {RELOAD}")
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            raise CheckpointError(f"{bad} — its header is not JSON. {RELOAD}") from None
    data, out = size - 8 - n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{bad} — tensor {name!r} has a malformed header entry. {RELOAD}") from None
        if e > data:
            raise CheckpointError(f"{bad} — tensor {name!r} ends at data byte {e} but the file holds {data}: it is "
                                  f"truncated. {RELOAD}")
        item = DTYPES[dtype].itemsize if dtype in DTYPES else None
        if item is not None and e - b != math.prod(shape) * item:
            raise CheckpointError(f"{bad} — tensor {name!r} ({dtype} {list(shape)}) spans {e - b} bytes. {RELOAD}")
        out[name] = Entry(file, dtype, shape, name)
    return out


def read_folder(path: Path, api: str = "load_pretrained") -> tuple[dict | None, dict[str, Entry]]:
    """``(config.json or None, every tensor by name)`` of a transformers folder (one ``model.safetensors``,
    or shards listed by ``model.safetensors.index.json``), or of a single ``.safetensors`` file."""
    if path.is_file():
        return None, _header(path)
    if not path.is_dir():
        raise CheckpointError(f"{api}: {path} does not exist — expected a folder written by save_pretrained or a "
                              ".safetensors file. Check the path.")
    config = None
    if (path / CONFIG).is_file():
        try:
            config = json.loads((path / CONFIG).read_text())
        except ValueError:
            raise CheckpointError(f"{api}: {path / CONFIG} is not JSON. {RELOAD}") from None
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise CheckpointError(f"{api}: {path / INDEX} is not a safetensors index (no weight_map). {RELOAD}") \
                from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise CheckpointError(f"{api}: {path / INDEX} lists {missing[:4]}, not in {path} — expected every shard "
                                  f"file the index names. {RELOAD}")
        out: dict[str, Entry] = {}
        for f in files:
            out.update(_header(path / f))
        lost = [k for k, f in weight_map.items() if k not in out or out[k].file.name != f]
        if lost:
            raise CheckpointError(f"{api}: {path / INDEX} places {lost[:4]} in files that do not hold them — the "
                                  f"shards and the index disagree. {RELOAD}")
        return config, out
    if (path / SAFE).is_file():
        return config, _header(path / SAFE)
    raise CheckpointError(f"{api}: {path} holds neither {SAFE} nor {INDEX} — expected a folder written by "
                          "save_pretrained (safetensors). Save it with safe_serialization, or point at the right "
                          "folder.")


def header_bytes(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, dict[str, int]]:
    """A safetensors header for ``tensors`` laid out as safetensors does (by dtype, then name), and each
    tensor's data offset."""
    order = sorted(tensors, key=lambda t: (-t[1].itemsize, t[0]))
    header: dict = {"__metadata__": {"format": "pt"}}
    offsets, off = {}, 0
    for name, dtype, shape in order:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        offsets[name] = off
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, offsets


def tidy(path: Path, split, params: int, hf: bool) -> None:
    """The index (sharded) or its absence (one file), and no stale shard from an earlier save."""
    stale = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
    for f in path.iterdir():
        if stale.fullmatch(f.name) and f.name not in split.filename_to_tensors:
            f.unlink()
    if split.is_sharded:
        if (path / SAFE).is_file():
            (path / SAFE).unlink()
        total = {"total_parameters": params} if hf else {}
        index = {"metadata": {**total, **split.metadata}, "weight_map": split.tensor_to_filename}
        (path / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    elif (path / INDEX).is_file():
        (path / INDEX).unlink()


def write_refused(path: Path, e: OSError) -> str:
    """The message of a write the disk refused."""
    return (f"save_pretrained: cannot write {path} — got {type(e).__name__}: {e.strerror or e}; expected a writable "
            "folder with room for the model. Free space or fix the permissions, and save again (the folder is "
            "incomplete; no temporary file is left).")


class OutFile:
    """Rank 0's temporary file for one safetensors file: a failed write (disk full, permission) is
    kept as ``error``, the file closed and removed; the rest of the writes are skipped."""

    def __init__(self, tmp: Path, head: bytes):
        self.tmp, self.fh, self.error = tmp, None, None
        try:
            self.fh = open(tmp, "wb")
            self.fh.write(head)
        except OSError as e:
            self._fail(e)

    @property
    def ok(self) -> bool:
        return self.error is None

    def write(self, at: int, data) -> None:
        try:
            self.fh.seek(at)
            self.fh.write(data)
        except OSError as e:
            self._fail(e)

    def install(self, dst: Path) -> str | None:
        """Close and move into place; the failure message (the temporary file gone) if any write failed."""
        if self.ok:
            try:
                self.fh.close()
                os.replace(self.tmp, dst)
            except OSError as e:
                self._fail(e)
        return None if self.ok else write_refused(dst, self.error)

    def _fail(self, e: OSError) -> None:
        self.error = e
        if self.fh is not None:
            try:
                self.fh.close()
            except OSError:
                pass                 # the close re-raises the write's failure; the file goes below
        self.tmp.unlink(missing_ok=True)
