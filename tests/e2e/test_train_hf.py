"""The main job on a transformers folder (``model=hf model.path=<folder>``), end to end.

A tiny Llama folder is made offline by ``examples/make_tiny_hf.py`` (a BPE tokenizer trained on the
stdlib's source, random weights, ``save_pretrained``), and the same 60 documents are written as
JSON lines and as parquet (``conftest.py``'s session fixture ``made``). The job trains the folder 6
steps on data 2 (ZeRO-3, JSON lines), and the job's own ``Trainer`` trains it on the default data 2 x
pipe 2 x tensor 2 (parallel=3d: 1F1B, TP + SP; parquet) on the suite's warm 8-rank pool, checked first
as the job's parent checks it (which also builds the parquet's cache): every data rank reads and
tokenizes only its share, the weights go straight into the shards (``init=False`` +
``engine.load_pretrained``), the loss is the model's own (on the last pipeline stage).
Both give the losses one process gives training ``from_pretrained`` on the same rows (fp32,
1e-5 relative) on every rank, hold the model states the plan says, and end with ``engine.save_pretrained``,
which ``from_pretrained`` loads; the job also writes metrics, pictures and a summary into its run
directory. Configuration errors are named by key before any rank starts.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SEQ = 32
COMMON = ["model=hf", "train=quick", f"model.seq_len={SEQ}", "data=dataset"]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(made, out: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "examples/train_gpt.py", *COMMON, f"model.path={made['folder']}", *args,
                           f"hydra.run.dir={out}"], cwd=ROOT, env=made["env"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _reference(made, data_file: Path) -> list[float]:
    """One process: ``from_pretrained``, the two data ranks' rows of each step stacked, AdamW with
    train=quick's settings (lr 3e-3 constant, clipping at 1.0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardlib.frontend.config.run_config import DataConfig
    from shardlib.frontend.data.tokens import load_tokens, local_batch

    tokenizer = AutoTokenizer.from_pretrained(made["folder"])
    data = DataConfig(source="dataset", path=str(data_file), megabytes=16)
    shares = [load_tokens(data, tokenizer, SEQ, d, 2) for d in range(2)]
    model = AutoModelForCausalLM.from_pretrained(made["folder"], dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(6):
        rows = [local_batch(shares[d], step, 8, SEQ, 0, d) for d in range(2)]
        batch = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _pool_train(run, cache: str, save: str) -> dict:
    """The main job's ``rank_main`` on a warm pool rank, for a transformers folder: its ``Trainer`` on
    ``run`` (the rank reads its share of the data; datasets' cache is the test's), every step, the model
    states held beside the plan's, and ``engine.save_pretrained`` as the job ends."""
    import datasets.config

    from shardlib.frontend.run import Trainer
    from shardlib.planner.pipeline_report import rank_activation_bytes
    from shardlib.testing import get_mesh

    before = datasets.config.HF_DATASETS_CACHE      # this pool rank serves other tests after this one
    datasets.config.HF_DATASETS_CACHE = Path(cache)
    try:
        trainer = Trainer(run, get_mesh(run.mesh.shape))
        losses = [trainer.step(i, record=False)["loss"] for i in range(run.train.steps)]
        trainer.engine.save_pretrained(save)
    finally:
        datasets.config.HF_DATASETS_CACHE = before
    rank = trainer.mesh.rank
    held = trainer.engine.memory_held()
    planned = trainer.plan.memory_per_rank(rank)
    return {"losses": losses, "held": {k: held[k] for k in ("params", "grads", "optimizer")},
            "planned": {k: planned[k] for k in ("params", "grads", "optimizer")},
            "activations": rank_activation_bytes(trainer.plan, rank)}


@pytest.mark.slow
def test_main_job_trains_a_transformers_folder_like_one_process(made, world, monkeypatch):
    import datasets.config

    from shardlib.cli.compose import check_overrides
    from shardlib.frontend.config.run_config import run_config
    from shardlib.frontend.run import check

    root = made["root"]
    want = _reference(made, root / "docs.jsonl")
    assert want[-1] < want[0]

    def agrees(what: str, losses: list[float]) -> None:
        assert len(losses) == 6 and all(math.isfinite(x) for x in losses), (what, losses)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True))
        assert rel <= 1e-5, f"{what}: {losses} vs one process {want} ({rel:.3g})"

    # the job: data 2, ZeRO-3, JSON lines
    what, out = "dp2 zero3 json lines", root / "dp2"
    proc = _run(made, out, "mesh=dp2", "parallel=zero3", f"data.path={root / 'docs.jsonl'}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)), what
    agrees(what, [r["loss"] for r in rows])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks_agree"] and summary["config"]["model_path"] == str(made["folder"]), what
    for planned, held in zip(summary["memory"]["planned"], summary["memory"]["measured"]):   # model states
        assert [planned[k] for k in ("params", "grads", "optimizer")] == \
            [held[k] for k in ("params", "grads", "optimizer")], what
    for name in ("loss.png", "memory.png", "plan.txt"):
        assert (out / name).stat().st_size > 0, (what, name)
    assert "by the folder's tokenizer" in proc.stdout and "\r" not in proc.stdout + proc.stderr, what

    # the job's Trainer on 2x2x2, parallel=3d, parquet: checked as the job's parent checks it, then the 8 ranks
    what = "2x2x2 3d parquet"
    cache = made["env"]["HF_DATASETS_CACHE"]
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", Path(cache))
    run = run_config(check_overrides([*COMMON, f"model.path={made['folder']}", "mesh=2x2x2", "parallel=3d",
                                      f"data.path={root / 'docs.parquet'}"]))
    assert check(run) == []
    per_rank = world(8, _pool_train, run, cache, str(root / "3d" / "hf"))
    for r, got in enumerate(per_rank):
        agrees(f"{what} rank {r}", got["losses"])
        assert got["losses"] == per_rank[0]["losses"], (what, r)
        assert got["held"] == got["planned"], (what, r)                                      # model states
        assert got["activations"] > 0, (what, r)
    # the trained model, written by engine.save_pretrained, loads with from_pretrained and is the trained one
    from transformers import AutoModelForCausalLM
    trained = AutoModelForCausalLM.from_pretrained(root / "3d" / "hf", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(made["folder"], dtype=torch.float32)
    other = AutoModelForCausalLM.from_pretrained(root / "dp2" / "hf", dtype=torch.float32).state_dict()
    for name, p in trained.state_dict().items():
        torch.testing.assert_close(p, other[name], rtol=1e-4, atol=1e-5, msg=name)
    assert not torch.equal(trained.model.embed_tokens.weight, initial.model.embed_tokens.weight)


# ---- configuration errors: named by key, before any rank starts -----------------------------------------

def test_folder_and_dataset_errors_are_named_by_key(made, tmp_path, monkeypatch):
    from transformers import AutoConfig

    monkeypatch.setenv("HF_DATASETS_CACHE", made["env"]["HF_DATASETS_CACHE"])
    problems_of = _example("train_gpt").problems_of
    base = ["mesh=dp2", "parallel=zero3", *COMMON, f"data.path={made['root'] / 'docs.jsonl'}"]

    def one(*args: str) -> str:
        got = problems_of([*base, *args])
        assert len(got) == 1, got
        return got[0]

    assert problems_of([*base, f"model.path={made['folder']}"]) == []
    # the default 2x2x2 mesh (parallel=3d: pipe, tensor, data) plans the folder's model too
    assert problems_of(["model=hf", f"model.path={made['folder']}", "train=quick", f"model.seq_len={SEQ}"]) == []
    assert one(f"model.path={tmp_path / 'nope'}").startswith(f"model.path: {tmp_path / 'nope'} does not exist")
    assert one().startswith("model.path: missing — model=hf trains a local transformers causal-LM folder")
    AutoConfig.for_model("t5").save_pretrained(tmp_path / "t5")                 # an encoder-decoder: no causal LM
    got = one(f"model.path={tmp_path / 't5'}")
    assert got.startswith(f"model.path: {tmp_path / 't5'} holds a ") and "not a causal language model" in got
    (tmp_path / "empty").mkdir()
    assert one(f"model.path={tmp_path / 'empty'}") == (f"model.path: {tmp_path / 'empty'} has no config.json — "
                                                       "expected a folder written by save_pretrained (config.json, "
                                                       "safetensors, tokenizer files).")
    folder = f"model.path={made['folder']}"
    assert one(folder, "train.seq=100").startswith("train.seq: 100 tokens is longer than the model's "
                                                   "max_position_embeddings=64")
    assert one(folder, "data.text_field=body").startswith("data.text_field: 'body' is not a column of ")
    assert one(folder, f"data.path={tmp_path / 'none.jsonl'}").startswith(f"data.path: {tmp_path / 'none.jsonl'} "
                                                                          "does not exist")
    (tmp_path / "two.jsonl").write_text('{"text": "a"}\n')
    assert "holds 1 rows, fewer than the 2 data ranks" in one(folder, f"data.path={tmp_path / 'two.jsonl'}")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    got = one(folder, f"data.path={tmp_path / 'bad.parquet'}")
    assert got.startswith(f"data.path: {tmp_path / 'bad.parquet'} cannot be read as parquet"), got
    (tmp_path / "x.csv").write_text("text\na\n")
    assert one(folder, f"data.path={tmp_path / 'x.csv'}").startswith("data.format: cannot tell the format of ")


def test_the_reference_gpt_reads_a_dataset_as_bytes(made, monkeypatch):
    """data=dataset without model=hf: the documents' text, as the byte-level GPT reads a file."""
    from shardlib.cli.compose import check_overrides
    from shardlib.frontend.config.run_config import run_config
    from shardlib.frontend.data.text import load_text
    from shardlib.frontend.run import check

    monkeypatch.setenv("HF_DATASETS_CACHE", made["env"]["HF_DATASETS_CACHE"])
    run = run_config(check_overrides(["mesh=dp2", "parallel=dp", "data=dataset",
                                      f"data.path={made['root'] / 'docs.parquet'}"]))
    assert check(run) == []
    text = bytes(load_text(run.data, run.seq).to(torch.uint8).tolist())
    first = json.loads((made["root"] / "docs.jsonl").read_text().splitlines()[0])["text"]
    assert text.startswith(first.encode("utf-8") + b"\n")
