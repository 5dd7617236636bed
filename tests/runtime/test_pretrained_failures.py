"""``load_pretrained`` and ``save_pretrained`` failing on some ranks only: a folder only one rank
cannot read, and a save rank 0 cannot write (disk full, permission), raise on every rank — none
waits for the others until a timeout — and leave no temporary file.
"""

from __future__ import annotations

import os

import pytest

import hf_models
from shardlib.runtime.checkpoint.files import CheckpointError
from test_pretrained import _batches, _engine, folder  # noqa: F401 — folder: the module's fixture

# ---- failures on some ranks only: every rank raises, none hangs ------------------------------------

class _DiskFills:
    """A file whose third write finds the disk full."""

    def __init__(self, file):
        self.fh, self.writes = open(file, "wb"), 0

    def write(self, data):
        self.writes += 1
        if self.writes > 2:
            raise OSError(28, "No space left on device")
        return self.fh.write(data)

    def seek(self, at):
        return self.fh.seek(at)

    def close(self):
        self.fh.close()


def save_failing_on_rank0(src: str, dst: str, kind: str) -> dict:
    """Data 2 ZeRO-3 (rank 1 sends its boxes): rank 0's writes fail as ``kind`` (no permission: the
    first open; the disk full: the third write); then a save elsewhere (the ranks still in step)."""
    from shardlib.runtime.pretrained import files as pretrained_files

    engine = _engine({"data": 2}, 3)
    engine.load_pretrained(src)
    if engine.mesh.rank == 0:
        def refused(file, mode="r"):
            raise PermissionError(13, "Permission denied", str(file))
        pretrained_files.open = refused if kind == "permission" else lambda file, mode="r": _DiskFills(file)
    try:
        engine.save_pretrained(dst, max_shard_size="60KB")
        got = "saved"
    except CheckpointError as e:
        got = str(e)
    finally:
        pretrained_files.__dict__.pop("open", None)
    engine.save_pretrained(dst + "-again")
    return {"error": got, "again": sorted(os.listdir(dst + "-again"))}


@pytest.mark.parametrize("kind, words", [("full", "No space left on device"), ("permission", "Permission denied")])
def test_save_pretrained_failing_on_rank0_raises_everywhere(world, tmp_path, kind, words):
    """Rank 0 cannot write: it goes on receiving (the sends match), removes its temporary file, and
    every rank raises a CheckpointError naming the file and the OS error — no rank hangs."""
    src = tmp_path / "src"
    hf_models.build("llama", seed=0).save_pretrained(src)
    per_rank = world(2, save_failing_on_rank0, str(src), str(tmp_path / "out"), kind)
    for r, res in enumerate(per_rank):
        msg = res["error"]
        assert "save_pretrained: cannot write" in msg and str(tmp_path / "out") in msg and words in msg, f"{r}: {msg}"
        assert "model.safetensors" in res["again"]
    assert not list((tmp_path / "out").glob(".*tmp-*")), os.listdir(tmp_path / "out")


def load_apart(runs: list[list[str]]) -> list[str]:
    """Data 2 ZeRO-3, each rank given its own path per run (``run[rank]``): what each load says."""
    engine = _engine({"data": 2}, 3)
    out = []
    for paths in runs:
        try:
            engine.load_pretrained(paths[engine.mesh.rank])
            out.append("loaded")
        except CheckpointError as e:
            out.append(str(e))
    engine.step(_batches()[0])
    return out


def test_ranks_seeing_different_folders_all_raise(world, folder):
    """Rank 1's folder does not exist or is truncated, rank 0's is whole: rank 1 raises its own problem,
    rank 0 names rank 1's — neither waits for the other; then both load the same folder."""
    import shutil

    good = folder / "good4"
    hf_models.build("llama", seed=0).save_pretrained(good)
    shutil.copytree(good, folder / "truncated4")
    f = folder / "truncated4" / "model.safetensors"
    os.truncate(f, f.stat().st_size - 100)
    runs = [[str(good), str(folder / "nowhere")], [str(good), str(folder / "truncated4")], [str(good)] * 2]
    (nowhere0, trunc0, ok0), (nowhere1, trunc1, ok1) = world(2, load_apart, runs)
    assert "does not exist" in nowhere1 and "truncated" in trunc1, (nowhere1, trunc1)
    for mine, theirs in ((nowhere0, nowhere1), (trunc0, trunc1)):
        assert mine.startswith(f"load_pretrained: another rank (rank 1) cannot read {good} — "), mine
        assert theirs.splitlines()[0] in mine and mine.endswith("Give every node the same folder."), mine
    assert ok0 == ok1 == "loaded"
