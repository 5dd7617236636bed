"""Text as a transformers tokenizer's tokens, each data rank reading and tokenizing only its share.

The sources are ``conf/data``'s: the stdlib's source or a text file (``data.text_share``: ``size``
contiguous shares of its bytes, a file read at the share's offset), or a local dataset (``source: dataset``) read through the
``datasets`` library — ``load_dataset("text" | "json" | "parquet", data_files=...)``, converted
once into a memory-mapped Arrow cache (``HF_DATASETS_CACHE``) by the check before any rank starts,
then ``Dataset.shard(size, index, contiguous=True)`` on each rank: a rank touches only its rows,
up to ``data.megabytes`` of text. Documents (JSON lines, parquet rows) are joined with the
tokenizer's end-of-text token; lines of a text file with their newlines.

``local_batch(tokens, step, ...)`` draws a data rank's rows of step ``step``'s global batch from a
generator seeded by ``(seed, step, data index)``: a function of the step, so a resumed run draws
what it would have drawn (on the same number of data ranks).
"""

from __future__ import annotations

import glob
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import torch

from .config import DataConfig
from .data import DataError, text_share

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


def _chunks(data: DataConfig, index: int, size: int) -> Iterator[tuple[str, bool]]:
    """This data rank's text in pieces to tokenize: ``(piece, ends_a_document)``."""
    if data.source == "dataset":
        lines: list[str] = []
        for text, document in dataset_texts(data, index, size):
            if document:
                yield text, True
            else:
                lines.append(text + "\n")
                if len(lines) == 200:
                    yield "".join(lines), False
                    lines = []
        if lines:
            yield "".join(lines), False
        return
    text = text_share(data, index, size).decode("utf-8", errors="ignore")     # a character cut at an end: dropped
    lines = text.splitlines(keepends=True)
    for i in range(0, len(lines), 200):
        yield "".join(lines[i:i + 200]), False


def load_tokens(data: DataConfig, tokenizer: Any, seq: int, index: int = 0, size: int = 1) -> torch.Tensor:
    """Data rank ``index`` of ``size``'s share of the text as a 1-D int64 tensor of ``tokenizer``'s
    ids; a ``DataError`` if it holds less than one sequence of ``seq`` tokens."""
    eos = tokenizer.eos_token_id
    pieces, ends = [], []
    for piece, end in _chunks(data, index, size):
        pieces.append(piece)
        ends.append(end)
    ids: list[int] = []
    for start in range(0, len(pieces), 256):
        batch = tokenizer(pieces[start:start + 256], add_special_tokens=False, verbose=False)["input_ids"]
        for got, end in zip(batch, ends[start:start + 256]):
            ids.extend(got)
            if end and eos is not None:
                ids.append(eos)
    if len(ids) < seq + 1:
        where = f"data.path: {data.path}" if data.path is not None else "data: the stdlib's source"
        raise DataError(f"{where}: data rank {index} of {size}'s share holds {len(ids)} tokens — expected at least one "
                        f"sequence of train.seq={seq} tokens and one more. Use more text (data.megabytes, a longer "
                        "file), fewer data ranks, or a shorter train.seq.")
    return torch.tensor(ids, dtype=torch.long)


def local_batch(tokens: torch.Tensor, step: int, rows: int, seq: int, seed: int, index: int) -> dict[str, torch.Tensor]:
    """Data rank ``index``'s ``rows`` sequences of step ``step``: windows of ``seq`` tokens at random
    offsets of its share, as ``model(**batch)`` takes them (``labels`` = ``input_ids``: the model
    shifts them)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 4099 + index)
    starts = torch.randint(0, len(tokens) - seq + 1, (rows,), generator=gen)
    ids = torch.stack([tokens[s:s + seq] for s in starts.tolist()])
    return {"input_ids": ids, "labels": ids.clone()}
