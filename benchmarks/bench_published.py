"""The dry run's step time against published measurements at scale (issue 21): Megatron-LM on Selene's A100s,
DeepSpeed ZeRO-3 on the same machine, and torchtitan on H100s.

    PYTHONPATH=. python3 benchmarks/bench_published.py                # ~20 s on the 2-core machine
    PYTHONPATH=. python3 benchmarks/bench_published.py --json rows.json --no-write

Each row below is a published configuration (model sizes, GPUs, tensor t / pipe p / data d, global batch,
micro-batch, schedule, recompute) with its source and its measured throughput. The script builds the same
configuration as Hydra overrides, plans it with ``frontend/dryrun.py`` (no process: analytic) and sets the
estimate beside the measurement:

* ``published s``: the measured iteration time. Papers that give TFLOP/s per GPU (Narayanan et al.) are
  turned into seconds with their own FLOP count, ``F / (n · TFLOP/s)``; eq. 3 of the paper counts the
  recompute forward, which is exactly ``transformer_flops(recompute=True)``; Korthikanti et al. give
  seconds; torchtitan gives tokens/s per GPU (``batch · seq / (n · tps)``).
* ``predicted s``: the estimate without overlap (``StepEstimate.total_s``; full overlap in brackets).
* ``error``: predicted / published - 1 (negative: the estimate is faster than measured, i.e. optimistic).
* ``needed TF/s``: the sustained rate per GPU the estimate would need for its compute term to close the gap,
  given its own communication, bubble and (calibrated) attention scores:
  ``F_rank / ((published - comm) · (1 - bubble) - scores)``, and its fraction
  of the preset's ``device_tflops`` (a diagnostic of what the compute model misses; nothing is fitted to it;
  ``probe_layer_rate.py`` measures the same fraction for one layer at each row's shard shapes on a GPU).

The machine figures are the presets' (``meshes/a100_3072.yaml``: 268 TFLOP/s sustained = the A100's measured
maximum achievable matmul rate; ``meshes/h100_64.yaml``: 400), overriding only ``mesh.axes`` per row (and the
data link inside one node for the 8-GPU torchtitan row). Nothing else in the estimator is fitted to these rows.

Where a published run used something the planner cannot express the row says so (``note``): the interleaved
schedule's virtual stages where given; Megatron's scatter/gather of the pipe messages (planned with sequence parallelism, which sends the same
1/t share).

**One calibration** (``--calibrate``, on by default). The uncalibrated estimate prices FLOPs and bytes on
links; Megatron's 2021-22 attention also writes its ``a·s²`` scores per sequence to memory and runs scale,
mask, softmax and dropout over them (memory-bound, not FLOPs). The mesh's ``score_ns`` prices that work
(``planner/estimate.py``). One figure is fitted, on one row — Korthikanti's 22B with full recompute:
``score_ns = (published - predicted) / score elements`` — and every row whose stack materializes scores is
priced again with it (torchtitan's flash attention holds none: unchanged). The second table gives each row
before -> after, and for a row still outside 15% the reason its figures show.

The torchtitan rows plan the real Llama 3.1 8B architecture (grouped KV heads, SwiGLU, untied 128256-entry
vocabulary): the script writes its transformers ``config.json`` (no weights, no tokenizer) into a temporary
folder and plans ``model=hf model.path=<folder> model.seq_len=8192``; their FLOPs are ``ModelDims.of(model)``'s
(2 per matrix element).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import tempfile
import time

from shardlib.cli.compose import check_overrides
from shardlib.frontend.config.run_config import run_config
from shardlib.frontend.dryrun import dry_run
from shardlib.planner.estimate import ModelDims, transformer_flops

NARAYANAN = "Narayanan et al. 2021, arXiv:2104.04473"
SC21 = "configs: github.com/NVIDIA/Megatron-LM examples/sc21/run_table_1.sh"
KORTHIKANTI = "Korthikanti et al. 2022, arXiv:2205.05198, Tables 3 and 5"
TITAN = "github.com/pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"


def gpt(layers, hidden, heads, vocab=51200, seq=2048, mlp=4):
    return {"n_layers": layers, "d_model": hidden, "n_heads": heads, "vocab_size": vocab, "seq_len": seq,
            "mlp_ratio": mlp}


# Llama 3.1 8B (meta-llama/Llama-3.1-8B's config.json, without its long-context rope scaling: the rows run 8192)
LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                  tie_word_embeddings=False)


def hf(config: dict, seq: int) -> dict:
    """A transformers model planned from its config alone (``model=hf``); ``config``: LlamaConfig's arguments."""
    return {"hf": "LlamaConfig", "config": config, "seq_len": seq}


_TMP = []      # the temporary folders holding the written configs (removed at exit)


@functools.lru_cache(maxsize=None)
def _hf_folder(items: tuple) -> str:
    """A temporary folder holding only the ``config.json`` of ``LlamaConfig(**dict(items))``."""
    from transformers import LlamaConfig
    tmp = tempfile.TemporaryDirectory(prefix="bench_published_hf_")
    _TMP.append(tmp)
    LlamaConfig(**dict(items), attn_implementation="sdpa").save_pretrained(tmp.name)
    return tmp.name


def hf_folder(m: dict) -> str:
    return _hf_folder(tuple(sorted(m["config"].items())))


# (name, model, t, p, d, global batch, micro-batch size, virtual stages, recompute, zero, published, source)
# published: ("tflops", TFLOP/s per GPU counting recompute) | ("iter_s", s) | ("tps", tokens/s per GPU)
def _rows():
    rows = []
    t1 = [  # Table 1 (weak scaling, fp16, full recompute); micro-batch and virtual stages from run_table_1.sh
        ("1.7B", gpt(24, 2304, 24), 1, 1, 32, 512, 16, 1, 137),
        ("3.6B", gpt(30, 3072, 32), 2, 1, 32, 512, 16, 1, 138),
        ("7.5B", gpt(36, 4096, 32), 4, 1, 32, 512, 16, 1, 142),
        ("18.4B", gpt(40, 6144, 48), 8, 1, 32, 1024, 8, 1, 135),
        ("39.1B", gpt(48, 8192, 64), 8, 2, 32, 1536, 4, 1, 138),
        ("76.1B", gpt(60, 10240, 80), 8, 4, 32, 1792, 2, 3, 140),
        ("145.6B", gpt(80, 12288, 96), 8, 8, 24, 2304, 2, 2, 148),
        ("310.1B", gpt(96, 16384, 128), 8, 16, 15, 2160, 1, 2, 155),
        ("529.6B", gpt(105, 20480, 128), 8, 35, 9, 2520, 1, 3, 163),
        ("1008B", gpt(128, 25600, 160), 8, 64, 6, 3072, 1, 1, 163),
    ]
    for name, m, t, p, d, b, mbs, v, tf in t1:
        rows.append(dict(group="Megatron T1", name=name, model=m, t=t, p=p, d=d, batch=b, mbs=mbs, v=v,
                         recompute="full", zero=0, published=("tflops", tf), mesh="a100_3072",
                         source=f"{NARAYANAN}, Table 1; {SC21}"))
    t2 = [  # Table 2: PTD-P against DeepSpeed ZeRO-3 (M = t x p; ZeRO-3's M=2 read as t=2), full recompute
        ("175B PTD-P", gpt(96, 12288, 96), 8, 12, 4, 1536, 1, 0, 153),
        ("175B PTD-P", gpt(96, 12288, 96), 8, 12, 8, 1536, 1, 0, 149),
        ("175B PTD-P", gpt(96, 12288, 96), 8, 12, 16, 1536, 1, 0, 141),
        ("530B PTD-P", gpt(105, 20480, 128), 8, 35, 2, 2240, 1, 0, 171),
        ("530B PTD-P", gpt(105, 20480, 128), 8, 35, 4, 2240, 1, 0, 167),
        ("530B PTD-P", gpt(105, 20480, 128), 8, 35, 8, 2240, 1, 0, 159),
        ("175B ZeRO-3", gpt(96, 12288, 96), 1, 1, 384, 1536, 4, 3, 144),
        ("175B ZeRO-3", gpt(96, 12288, 96), 2, 1, 384, 1536, 2, 3, 88),
        ("175B ZeRO-3", gpt(96, 12288, 96), 1, 1, 1536, 1536, 1, 3, 44),
        ("530B ZeRO-3", gpt(105, 20480, 128), 1, 1, 640, 2560, 4, 3, 138),
        ("530B ZeRO-3", gpt(105, 20480, 128), 2, 1, 560, 2240, 2, 3, 98),
        ("530B ZeRO-3", gpt(105, 20480, 128), 1, 1, 2240, 2240, 1, 3, 48),
    ]
    for name, m, t, p, d, b, mbs, zero, tf in t2:
        rows.append(dict(group="Megatron T2", name=name, model=m, t=t, p=p, d=d, batch=b, mbs=mbs, v=1,
                         recompute="full", zero=zero, published=("tflops", tf), mesh="a100_3072",
                         source=f"{NARAYANAN}, Table 2"))
    kt = [  # Table 3 configs, Table 5 iteration times: data parallel 1, micro-batch 1, SP + selective or full
        ("22B", gpt(48, 6144, 64), 8, 1, 4, 1.10, 1.42),
        ("175B", gpt(96, 12288, 96), 8, 8, 64, 13.75, 18.13),
        ("530B", gpt(105, 20480, 128), 8, 35, 280, 37.83, 49.05),
        ("1T", gpt(128, 25600, 160), 8, 64, 512, 71.49, 94.42),
    ]
    for name, m, t, p, b, sel_s, full_s in kt:
        for rc, s in (("selective", sel_s), ("full", full_s)):
            rows.append(dict(group="Korthikanti", name=name, model=m, t=t, p=p, d=1, batch=b, mbs=1, v=1,
                             recompute=rc, zero=0, published=("iter_s", s), mesh="a100_3072", source=KORTHIKANTI))
    # torchtitan, Llama 3.1 8B, bf16, FSDP (ZeRO-3), eager (no torch.compile, no Float8), local batch 2 x 8192,
    # selective (op-level) activation checkpointing. The 70B/405B rows there are Float8 only: not compared.
    llama8b = hf(LLAMA31_8B, 8192)
    rows.append(dict(group="torchtitan", name="Llama3.1-8B FSDP", model=llama8b, t=1, p=1, d=8, batch=16, mbs=2,
                     v=1, recompute="selective", zero=3, published=("tps", 5762), mesh="h100_64", node_local=True,
                     source=f"{TITAN}, Table 1"))
    rows.append(dict(group="torchtitan", name="Llama3.1-8B FSDP", model=llama8b, t=1, p=1, d=128, batch=256,
                     mbs=2, v=1, recompute="selective", zero=3, published=("tps", 5605), mesh="h100_64",
                     source=f"{TITAN}, Table 3"))
    return rows


ROWS = _rows()


def overrides(row: dict, recompute) -> list[str]:
    t, p, d = row["t"], row["p"], row["d"]
    axes = {"data": d} | ({"pipe": p} if p > 1 else {}) | {"tensor": t}
    m = row["model"]
    model = (["model=hf", f"model.path={hf_folder(m)}", f"model.seq_len={m['seq_len']}"] if "hf" in m
             else ["model=1b", *(f"model.{k}={v}" for k, v in m.items())])
    out = [f"mesh={row['mesh']}", "mesh.axes={" + ",".join(f"{k}:{v}" for k, v in axes.items()) + "}", *model,
           f"train.batch={row['batch']}", "train.precision=bf16", f"train.recompute={recompute}",
           f"parallel.zero={row['zero']}"]
    if row.get("node_local"):       # 8 GPUs of one node: the data axis is NVLink, not the fabric
        out += ["+mesh.links.data={gbps:450,latency_us:3}"]
    rules = ["heads: tensor", "mlp: tensor", "vocab: tensor"] if t > 1 else []
    if p > 1:
        rules.insert(0, "layers: pipe")
        micro = row["batch"] // (d * row["mbs"])
        sched = "interleaved_1f1b" if row["v"] > 1 else "1f1b"
        out = ["parallel=3d", *out, f"parallel.schedule={sched}", f"parallel.microbatches={micro}"]
        if row["v"] > 1:
            out.append(f"parallel.virtual_stages={row['v']}")
    else:
        out = ["parallel=tp_sp" if t > 1 else "parallel=dp", *out,
               f"train.grad_accum={row['batch'] // (d * row['mbs'])}"]
    out.append("parallel.sequence_parallel=" + ("true" if t > 1 else "false"))
    out.append("parallel.rules={" + ", ".join(rules) + "}")
    return out


def _recompute_value(rc: str):
    return {"full": "true", "none": "false"}.get(rc, rc)


def materializes(row: dict) -> bool:
    """Whether the published stack wrote attention scores to memory: Megatron's 2021-22 scaled-masked softmax
    and dropout did (Narayanan's and Korthikanti's rows); torchtitan runs flash attention (SDPA), which does not."""
    return row["group"] != "torchtitan"


def price(row: dict, score_ns: float | None = None) -> dict:
    """The row's dry run against its publication; ``score_ns``: the mesh's seconds (x 1e9) per materialized
    attention score element (``planner/estimate.py``), applied where the row's stack materializes them."""
    notes = []
    rc = row["recompute"]
    over = overrides(row, _recompute_value(rc))
    if score_ns is not None and materializes(row):
        over.append(f"+mesh.score_ns={score_ns!r}")
    run = run_config(check_overrides(over))
    dr = dry_run(run)
    est = dr.estimate
    m, n = row["model"], row["t"] * row["p"] * row["d"]
    tokens = row["batch"] * m["seq_len"]
    kind, value = row["published"]
    if kind == "tflops":            # the paper's own count (eq. 3 includes the recompute forward)
        f_conv = transformer_flops(layers=m["n_layers"], d_model=m["d_model"], seq=m["seq_len"],
                                   vocab=m["vocab_size"], tokens=tokens, mlp_ratio=m["mlp_ratio"], recompute=True)
        pub_s = f_conv / (n * value * 1e12)
    elif kind == "iter_s":          # model FLOPs (no recompute), Korthikanti's MFU convention
        f_conv = transformer_flops(layers=m["n_layers"], d_model=m["d_model"], seq=m["seq_len"],
                                   vocab=m["vocab_size"], tokens=tokens, mlp_ratio=m["mlp_ratio"], recompute=False)
        pub_s = value
    else:                           # tokens/s per GPU: the published tokens per step over n GPUs
        pub_s = tokens / (n * value)
        if "hf" in m:               # model FLOPs (no recompute) of the real architecture, 2 per matrix element
            from shardlib.frontend.hf import meta_model
            f_conv = ModelDims.of(meta_model(run)).flops(seq=m["seq_len"], tokens=tokens, recompute=False)
        else:
            f_conv = transformer_flops(layers=m["n_layers"], d_model=m["d_model"], seq=m["seq_len"],
                                       vocab=m["vocab_size"], tokens=tokens, mlp_ratio=m["mlp_ratio"],
                                       recompute=False)
    comm = sum(est.comm_s.values())
    matmul_s = (pub_s - comm) * (1 - est.idle) - est.scores_s      # what the published time leaves the matmuls
    needed = est.flops_per_rank / max(1e-9, matmul_s) / 1e12 if matmul_s > 0 else float("nan")
    if row["v"] > 1:
        notes.append(f"interleaved v={row['v']}")
    acts = None
    if row["group"] == "Korthikanti":    # activations of the first pipe rank against the paper's formula
        acts = activations(dr.plan, m, row)
        acts["planned"] = dr.memory.get("activations")
    return {**{k: row[k] for k in ("group", "name", "t", "p", "d", "batch", "mbs", "source")}, "gpus": n,
            "model": m, "recompute_published": row["recompute"], "recompute_planned": rc,
            "zero": row["zero"], "published_kind": kind, "published_value": value, "published_s": pub_s,
            "predicted_s": est.total_s, "overlap_s": est.overlapped_s, "compute_s": est.compute_s,
            "bubble": est.idle, "comm_s": dict(est.comm_s), "error": est.total_s / pub_s - 1,
            "error_overlap": est.overlapped_s / pub_s - 1,
            "published_tflops": f_conv / (n * pub_s) / 1e12, "predicted_tflops": f_conv / (n * est.total_s) / 1e12,
            "needed_tflops": needed, "rank_tflops": est.flops_per_rank / (est.compute_s - est.scores_s) / 1e12,
            "scores_s": est.scores_s / (1 - est.idle),
            "fits": dr.fits, "notes": notes, "activations": acts}


def activations(plan, m: dict, row: dict) -> dict:
    """The planned bytes a block saves per micro-batch (measured on the meta device at the row's shard shapes)
    as a multiple of ``s·b·h/t``, and Korthikanti et al.'s per-GPU figure by their formula: a layer's bytes
    (``34sbh/t`` with SP and selective recompute, ``2sbh/t`` with full) times the layers in flight on the first
    stage: 1F1B with ``m >= p`` keeps its ``L/p`` layers for ``p`` micro-batches, and without a pipe the ``L``
    layers hold one micro-batch — ``L`` layers' worth either way."""
    pp = plan.pipeline
    block = pp.block_saved[0] if pp is not None and pp.block_saved else plan.stack_saved[1][0]
    s, b, h, t, L = m["seq_len"], row["mbs"], m["d_model"], row["t"], m["n_layers"]
    per = 34 if row["recompute"] == "selective" else 2
    return {"multiple": block * t / (s * b * h), "formula_multiple": per, "formula_bytes": per * s * b * h / t * L}


def table(rows: list[dict]) -> str:
    head = ("| source | model | GPUs | t/p/d | batch (micro) | recompute | published | published s | predicted s "
            "(full overlap) | error | compute / bubble / comm s | needed TF/s (of preset) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    out = [head]
    for r in rows:
        kind, val = r["published_kind"], r["published_value"]
        pub = {"tflops": f"{val} TFLOP/s/GPU", "iter_s": f"{val} s", "tps": f"{val:,} tok/s/GPU"}[kind]
        rc = r["recompute_published"] + ("" if r["recompute_planned"] == r["recompute_published"]
                                         else f" (planned {r['recompute_planned']})")
        zero = f", ZeRO-{r['zero']}" if r["zero"] else ""
        comm = " + ".join(f"{a} {s:.2f}" for a, s in sorted(r["comm_s"].items(), key=lambda x: -x[1]) if s >= 0.005)
        comp = r["compute_s"] / (1 - r["bubble"])
        out.append(f"| {r['group']} | {r['name']} | {r['gpus']} | {r['t']}/{r['p']}/{r['d']}{zero} | "
                   f"{r['batch']} ({r['mbs']}) | {rc} | {pub} | {r['published_s']:.2f} | {r['predicted_s']:.2f} "
                   f"({r['overlap_s']:.2f}) | **{100 * r['error']:+.0f}%** | {comp:.2f} / {r['bubble']:.3f} / "
                   f"{comm or '0'} | {r['needed_tflops']:.0f} ({r['needed_tflops'] / r['rank_tflops']:.2f}) |")
    return "\n".join(out)


def activation_table(rows: list[dict]) -> str:
    """The Korthikanti rows' activation memory per GPU (first pipe rank) against the paper's formula."""
    out = ["| model | t/p | recompute | a block saves (planned) | Korthikanti | planned per GPU GiB | formula GiB | "
           "planned / formula | why |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r.get("activations")
        if not a:
            continue
        t = r["t"]
        why = ("32·sbh/t: the sequence-parallel all-gathers' inputs kept as the 2sbh/t chunk and gathered again "
               "in backward, as Megatron (comm/sp_saved.py); no dropout masks (-2)") \
            if r["recompute_planned"] == "selective" else \
            "each block keeps its input only, as Megatron's full recompute"
        out.append(f"| {r['name']} | {t}/{r['p']} | {r['recompute_planned']} | {a['multiple']:.1f}·sbh/t | "
                   f"{a['formula_multiple']}·sbh/t | {(a['planned'] or 0) / 2**30:.2f} | "
                   f"{a['formula_bytes'] / 2**30:.2f} | {(a['planned'] or 0) / a['formula_bytes']:.2f} | {why} |")
    return "\n".join(out)


CALIBRATION_ROW = ("Korthikanti", "22B", "full")


def calibrate(rows: list[dict]) -> float:
    """``score_ns`` fitted on the calibration row: the gap between published and predicted, over its score
    elements (priced once at 1 ns each), stretched by the row's bubble."""
    row = next(r for r in ROWS if (r["group"], r["name"], r["recompute"]) == CALIBRATION_ROW)
    got = next(r for r in rows if (r["group"], r["name"], r["recompute_published"]) == CALIBRATION_ROW)
    per_ns = price(row, 1.0)["scores_s"]
    return (got["published_s"] - got["predicted_s"]) / per_ns


def why(before: dict, after: dict) -> str:
    """A row outside 15% after the calibration: what its figures show."""
    e = after["error"]
    if abs(e) <= 0.15:
        return ""
    comm = sum(after["comm_s"].values())
    if after["scores_s"] == 0 and after["error_overlap"] > -0.15 and comm > 0.1 * after["predicted_s"]:
        return (f"{comm:.2f} s of communication counted in series; {before['group']} overlaps it (the full-overlap "
                f"bound is {100 * after['error_overlap']:+.0f}%)")
    if e > 0 and after["scores_s"] > 0:
        return (f"the scores ({after['scores_s']:.2f} s, {after['mbs']} sequences per micro-batch, t={after['t']}) "
                f"priced at the 22B row's cost per element (1 sequence, t=8) overshoot; the cost per element at "
                f"this shape is not measured (needs a GPU: probe_layer_rate.py)")
    return (f"the matmuls need {after['needed_tflops']:.0f} TF/s ({after['needed_tflops'] / after['rank_tflops']:.2f} "
            f"of the preset's sustained rate) to meet the published time: these shards run below the A100's best "
            f"matmul rate; not measured here (needs a GPU: probe_layer_rate.py)")


def calibrated_table(rows: list[dict], after: list[dict], score_ns: float) -> str:
    out = [f"After one calibration: score_ns = {score_ns:.4f} ns per score element, fitted on "
           f"{' '.join(CALIBRATION_ROW)} recompute; applied to the rows whose stack materializes attention scores.",
           "", "| source | model | GPUs | t/p/d | batch (micro) | recompute | published s | before s | error before | "
           "scores s | after s | error after | within 15% | why not |", "|" + "---|" * 14]
    for b, a in zip(rows, after):
        cal = (b["group"], b["name"], b["recompute_published"]) == CALIBRATION_ROW
        zero = f", ZeRO-{a['zero']}" if a["zero"] else ""
        out.append(f"| {a['group']} | {a['name']} | {a['gpus']} | {a['t']}/{a['p']}/{a['d']}{zero} | {a['batch']} "
                   f"({a['mbs']}) | {a['recompute_published']} | {a['published_s']:.2f} | {b['predicted_s']:.2f} | "
                   f"{100 * b['error']:+.0f}% | {a['scores_s']:.2f} | {a['predicted_s']:.2f} | "
                   f"**{100 * a['error']:+.0f}%**{' (fitted)' if cal else ''} | "
                   f"{'yes' if abs(a['error']) <= 0.15 else 'no'} | {why(b, a)} |")
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    lines = []
    for g in dict.fromkeys(r["group"] for r in rows):
        errs = [100 * r["error"] for r in rows if r["group"] == g]
        lines.append(f"- {g}: {len(errs)} rows, error {min(errs):+.0f}% to {max(errs):+.0f}% "
                     f"(mean {sum(errs) / len(errs):+.0f}%, mean |error| {sum(map(abs, errs)) / len(errs):.0f}%)")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="also write the rows as JSON")
    ap.add_argument("--no-write", action="store_true", help="do not write benchmarks/results/bench_published-<date>.md")
    ap.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="only the uncalibrated estimate (no score_ns fitted)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = [price(r) for r in ROWS]
    cal_text = ""
    if args.calibrate:
        score_ns = calibrate(rows)
        after = [price(r, score_ns) for r in ROWS]
        cal_text = f"{calibrated_table(rows, after, score_ns)}\n\n{summary(after)}\n\n"
    secs = time.perf_counter() - t0
    md = table(rows)
    notes = sorted({f"{r['name']} ({r['gpus']} GPUs): {n}" for r in rows for n in r["notes"]})
    text = (f"{md}\n\nerror = predicted (no overlap) / published - 1; negative: the estimate is faster than "
            f"measured.\n\n{summary(rows)}\n\n{cal_text}activations per GPU, Korthikanti's rows (the first pipe rank; "
            f"embeddings and head not counted), bytes of 16-bit values:\n\n{activation_table(rows)}\n\nnotes:\n" + "\n".join(f"- {n}" for n in notes)
            + "\n\nsources:\n" + "\n".join(f"- {s}" for s in dict.fromkeys(r["source"] for r in rows))
            + f"\n\n{len(rows)} rows planned in {secs:.1f} s\n")
    print(text)
    if not args.no_write:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                            f"bench_published-{datetime.date.today().isoformat()}.md")
        with open(path, "w") as f:
            f.write("# bench_published: the dry run's step time against published measurements\n\n"
                    "`PYTHONPATH=. python3 benchmarks/bench_published.py` (rows, sources and conventions: the "
                    "script's docstring)\n\n" + text)
        print(f"wrote {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
