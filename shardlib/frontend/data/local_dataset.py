"""A local dataset (``data=dataset``: text, JSON lines or parquet files) through the ``datasets`` library.

``load_dataset("text" | "json" | "parquet", data_files=...)`` converts the files once into a
memory-mapped Arrow cache (``HF_DATASETS_CACHE``) — the main job's check does it before any rank
starts — and ``Dataset.shard(size, index, contiguous=True)`` gives each data rank its rows only.
Problems are ``DataError``s naming the config key.
"""

from __future__ import annotations

import glob
import os
import pathlib
from collections.abc import Iterator

from ..config.run_config import DataConfig, DataError


_EXTENSIONS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
               ".parquet": "parquet"}


def dataset_files(data: DataConfig) -> list[str]:
    """The files ``data.path`` names: a file, a glob, or a folder (its files of known extensions)."""
    path = os.path.expanduser(data.path or "")
    if os.path.isdir(path):
        files = sorted(str(p) for p in pathlib.Path(path).rglob("*") if p.is_file() and
                       (data.format is not None or p.suffix in _EXTENSIONS) and not p.name.startswith("."))
    else:
        files = sorted(glob.glob(path)) if glob.has_magic(path) else ([path] if os.path.exists(path) else [])
    if not files:
        raise DataError(f"data.path: {data.path} {'holds no data files' if os.path.isdir(path) else 'does not exist'}"
                        f" — expected a file, a glob or a folder of .txt, .json/.jsonl or .parquet files. Check the "
                        f"path (relative paths are taken from {pathlib.Path.cwd()}).")
    return files


def dataset_format(data: DataConfig, files: list[str]) -> str:
    """``data.format``, else the one format of the files' extensions."""
    if data.format is not None:
        return data.format
    found = {_EXTENSIONS.get(pathlib.Path(f).suffix) for f in files}
    if len(found) != 1 or None in found:
        raise DataError(f"data.format: cannot tell the format of {data.path} from its extensions "
                        f"({', '.join(sorted({pathlib.Path(f).suffix or '(none)' for f in files}))}) — expected "
                        ".txt, .json/.jsonl or .parquet files, all of one kind. Give data.format=text|json|parquet.")
    return found.pop()


def open_dataset(data: DataConfig):
    """The dataset of ``data`` (memory-mapped, every row) and its format; a ``DataError`` naming the
    key where it cannot be read or has no ``data.text_field`` column."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    files = dataset_files(data)
    fmt = dataset_format(data, files)
    try:
        ds = datasets.load_dataset(fmt, data_files=files, split="train")
    except Exception as e:  # noqa: BLE001 — pyarrow, json and datasets' own errors: the file is not of its format
        cause = str(e.__cause__ or e).strip().splitlines()
        raise DataError(f"data.path: {data.path} cannot be read as {fmt} ({type(e).__name__}: "
                        f"{cause[0] if cause else ''}) — expected {fmt} files; the file may be corrupt, or of another "
                        "format (data.format).") from None
    column = "text" if fmt == "text" else data.text_field
    if column not in ds.column_names:
        raise DataError(f"data.text_field: {column!r} is not a column of {data.path} — expected one of "
                        f"{ds.column_names}. Use data.text_field=<column>.")
    return ds, fmt, column


def dataset_problems(data: DataConfig, data_ranks: int) -> list[str]:
    """What the ranks would hit reading ``data`` (a dataset), found in this process; builds the cache."""
    try:
        ds, _, _ = open_dataset(data)
    except DataError as e:
        return e.problems
    if ds.num_rows < data_ranks:
        return [f"data.path: {data.path} holds {ds.num_rows} rows, fewer than the {data_ranks} data ranks that each "
                "read a share — expected at least one row per data rank. Use more data, or fewer data ranks."]
    return []


def dataset_texts(data: DataConfig, index: int = 0, size: int = 1) -> Iterator[tuple[str, bool]]:
    """Data rank ``index`` of ``size``'s share of a dataset: ``(text, is_document)`` rows in order,
    up to ``data.megabytes`` of text (a text file's rows are its lines, not documents)."""
    ds, fmt, column = open_dataset(data)
    share = ds.shard(num_shards=size, index=index, contiguous=True).select_columns([column])
    budget = int(data.megabytes * 2**20)
    for start in range(0, share.num_rows, 1000):
        for text in share[start:start + 1000][column]:
            if text is None:
                continue
            yield text, fmt != "text"
            budget -= len(text)
            if budget <= 0:
                return
