"""Text as a transformers tokenizer's tokens, each data rank reading and tokenizing only its share.

The sources are ``conf/data``'s: the stdlib's source or a text file (``data.text_share``: ``size``
contiguous shares of its bytes, a file read at the share's offset), or a local dataset (``source: dataset``, ``frontend/data/local_dataset.py``: each rank reads its rows only),
up to ``data.megabytes`` of text. Documents (JSON lines, parquet rows) are joined with the
tokenizer's end-of-text token; lines of a text file with their newlines.

``local_batch(tokens, step, ...)`` draws a data rank's rows of step ``step``'s global batch from a
generator seeded by ``(seed, step, data index)``: a function of the step, so a resumed run draws
what it would have drawn (on the same number of data ranks).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..config.run_config import DataConfig
from .text import DataError, text_share
from .local_dataset import dataset_texts

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
