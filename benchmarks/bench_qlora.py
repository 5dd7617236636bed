"""QLoRA from a folder: shardlib's quantize-while-loading at data d ZeRO-3 vs torchao NF4 + FSDP2 and
bitsandbytes 4-bit + FSDP2, each side in its own fresh world.

    PYTHONPATH=. python3 benchmarks/bench_qlora.py --json rows.json      # ~0.3B Llama at data 4 (slow on 2 cores)
    PYTHONPATH=. python3 benchmarks/bench_qlora.py --quick               # smoke run: tiny Llama, data 2, ~1 min

**Workload.** A transformers Llama folder written once, offline (``--folder``; random weights after
``torch.manual_seed(0)``, stored bf16 as released checkpoints are): ``FULL`` is hidden 1024, MLP 2816, 24
layers, 16 heads (8 KV), vocab 32000 — 0.35 B parameters. Every ``nn.Linear`` of the blocks is frozen in
NF4 (blocks of 64 values, the scales double-quantized in blocks of 256: torchao's ``to_nf4`` defaults,
QLoRA's), LoRA r = 16 on the same projections drawn after ``torch.manual_seed(1)``; embeddings, norms
and head stay fp32 and frozen; AdamW (lr 1e-4) on the adapters. ``batch`` sequences of ``seq`` random
tokens per rank per step.

**Sides**, each in a fresh world of ``d`` gloo ranks (1 thread each):

* ``shardlib``       the model on the meta device, ``sl.quantize(model, "nf4")``, ``get_peft_model``,
                     ``sl.plan(model, Mesh({"data": d}), zero=3)``, ``sl.parallelize(..., init=False)``,
                     ``engine.load_pretrained(folder)``: each rank reads its float rows and quantizes them;
* ``torchao-fsdp2``  torchtune's way: ``from_pretrained`` (fp32, whole, on every rank), each target's
                     weight replaced by ``to_nf4(weight)``, ``get_peft_model``, ``fully_shard`` on every
                     decoder layer and the root;
* ``bnb-fsdp2``      ``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True,
                     bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True))`` (bitsandbytes on the
                     CPU), ``get_peft_model``, ``fully_shard`` likewise — where it runs; its error is its row.

**Measured** per rank: the load (wall seconds from nothing to a model ready to step, and its peak RSS
above the RSS before it: ``VmHWM`` reset through ``/proc/self/clear_refs``), the steps' peak RSS above the
same starting point, and the step time (``--warmup`` steps, then the median of ``--steps``: the latest
end minus the earliest start over the ranks). Losses: each side's against ``torchao-fsdp2``'s (the same
NF4 codes and adapters: max relative difference over every step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from harness import launch, max_rel, write_rows

import shardlib as sl

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIDES = ("shardlib", "torchao-fsdp2", "shardlib-bnb", "bnb-fsdp2")
# each side's losses against the side holding the same codes
SAME_CODES = {"shardlib": "torchao-fsdp2", "shardlib-bnb": "bnb-fsdp2"}
LR, RANK = 1e-4, 16


@dataclass(frozen=True)
class Size:
    hidden: int = 1024
    inter: int = 2816
    layers: int = 24
    heads: int = 16
    kv: int = 8
    vocab: int = 32000
    seq: int = 64
    batch: int = 1


# QUICK: every weight holds a multiple of 2 x 256 x 64 values (FSDP2 splits torchao's scaler factors evenly)
FULL, QUICK = Size(), Size(hidden=256, inter=512, layers=2, heads=4, kv=4, vocab=512, seq=32, batch=2)


def llama_config(s: Size):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.inter,
                       num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv,
                       max_position_embeddings=s.seq, use_cache=False, tie_word_embeddings=False)


def write_folder(s: Size, folder: Path) -> None:
    """The workload's folder (bf16 safetensors, seed 0), written once (again where its sizes differ)."""
    import json
    want = llama_config(s).to_dict()
    if (folder / "config.json").is_file():
        have = json.loads((folder / "config.json").read_text())
        if all(have.get(k) == want[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads")):
            return
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(s)).to(torch.bfloat16).save_pretrained(folder)


def lora(model):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, lora_dropout=0.0,
                                            init_lora_weights=False))


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=LR)


def batch_of(s: Size, d: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, s.vocab, (s.batch * d, s.seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def build_shardlib(s: Size, d: int, folder: str):
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(s))
    model = lora(sl.quantize(model, "nf4", TARGETS))
    engine = sl.parallelize(model, sl.plan(model, sl.Mesh({"data": d}), zero=3), optimizer=optimizer, init=False)
    engine.load_pretrained(folder)
    return lambda batch: float(engine.step(batch))


def bnb_model(folder: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=q, device_map="cpu")


def build_shardlib_bnb(s: Size, d: int, folder: str):
    model = lora(bnb_model(folder)).train()
    engine = sl.parallelize(model, sl.plan(model, sl.Mesh({"data": d}), zero=3), optimizer=optimizer)
    return lambda batch: float(engine.step(batch))


def build_fsdp2(s: Size, d: int, folder: str, bnb: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    if bnb:
        model = bnb_model(folder)
    else:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and name.rpartition(".")[2] in TARGETS:
                m.weight = torch.nn.Parameter(to_nf4(m.weight.detach()), requires_grad=False)
    model = lora(model).train()
    mesh = init_device_mesh("cpu", (d,), mesh_dim_names=("data",))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer(model.parameters())
    rank = dist.get_rank()

    def step(batch) -> float:
        rows = {k: v[rank * s.batch:(rank + 1) * s.batch] for k, v in batch.items()}
        loss = model(**rows).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)                # the global batch's mean loss, as engine.step returns it
        return float(loss) / d

    return step


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(key)


def _reset_peak() -> int:
    import ctypes
    import gc
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def rank_main(side: str, s: Size, d: int, folder: str, warmup: int, steps: int) -> dict:
    torch.set_num_threads(1)
    import logging
    logging.getLogger("torchao").setLevel(logging.ERROR)
    from transformers.utils.logging import disable_progress_bar, set_verbosity_error
    disable_progress_bar()
    set_verbosity_error()
    import importlib
    for module in ("peft", "torchao.quantization.quantize_.workflows.nf4.nf4_tensor",
                   "transformers.models.llama.modeling_llama") + (("bitsandbytes",) if "bnb" in side else ()):
        importlib.import_module(module)      # the libraries' import is not the load: imported before measuring
    before = _reset_peak()
    dist.barrier()
    t0 = time.perf_counter()
    try:
        step = {"shardlib": build_shardlib, "shardlib-bnb": build_shardlib_bnb}.get(side)
        step = step(s, d, folder) if step else build_fsdp2(s, d, folder, side == "bnb-fsdp2")
    except Exception as e:       # noqa: BLE001  (a benchmark reports what a stack does, whatever it raises)
        return {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    load_s = time.perf_counter() - t0
    load_peak = _status("VmHWM") - before
    _reset_peak()
    losses, spans = [], []
    for k in range(warmup + steps):
        batch = batch_of(s, d, k)
        dist.barrier()
        t = time.perf_counter()
        losses.append(step(batch))
        if k >= warmup:
            spans.append((t, time.perf_counter()))
    return {"load_s": load_s, "load_peak": load_peak, "step_peak": _status("VmHWM") - before, "losses": losses,
            "spans": spans, "before": before}


def run_side(side: str, s: Size, d: int, folder: str, warmup: int, steps: int, timeout) -> dict:
    t0 = time.time()
    per, err = launch(rank_main, d, side, s, d, folder, warmup, steps, timeout=timeout)
    print(f"{side} at data {d}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    if per is None:
        return {"failed": err}
    if "failed" in per[0]:
        return {"failed": per[0]["failed"]}
    times = [max(r["spans"][k][1] for r in per) - min(r["spans"][k][0] for r in per) for k in range(steps)]
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"load_s": max(r["load_s"] for r in per), "load_peak_mb": [r["load_peak"] / 2**20 for r in per],
            "step_peak_mb": [r["step_peak"] / 2**20 for r in per], "step_s": statistics.median(times),
            "p25": q[0], "p75": q[2], "losses": per[0]["losses"], "before_mb": [r["before"] / 2**20 for r in per]}


def table(row: dict) -> str:
    res = row["results"]
    base = res.get("torchao-fsdp2", {})
    lines = ["| side | load s | load peak RSS MB per rank (above start) | step peak RSS MB per rank | step s "
             "(p25-p75) | ratio vs torchao + FSDP2 | max rel Δloss vs the same codes under FSDP2 |", "|" + "---|" * 7]
    for side in SIDES:
        r = res.get(side)
        if r is None:
            continue
        if "failed" in r:
            lines.append(f"| {side} | FAILED: {r['failed'].split(', types=')[0]} |" + " – |" * 5)
            continue
        ratio = f"**{r['step_s'] / base['step_s']:.2f}**" if "step_s" in base else "–"
        same = res.get(SAME_CODES.get(side), {})
        dl = f"{max_rel(r['losses'], same['losses']):.1e} ({SAME_CODES[side]})" if "losses" in same else "–"
        lines.append(f"| {side} | {r['load_s']:.1f} | {' / '.join(f'{x:.0f}' for x in r['load_peak_mb'])} | "
                     f"{' / '.join(f'{x:.0f}' for x in r['step_peak_mb'])} | {r['step_s']:.2f} "
                     f"({r['p25']:.2f}-{r['p75']:.2f}) | {ratio} | {dl} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=int, default=None, help="data ranks (default 4; --quick: 2)")
    ap.add_argument("--sides", nargs="*", default=list(SIDES), choices=list(SIDES))
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny Llama, data 2")
    ap.add_argument("--folder", default=None, help="where the workload's folder is written once (default: /tmp)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="collective timeout, seconds")
    ap.add_argument("--world-timeout", type=float, default=3600.0, help="one world's whole run, seconds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    s = QUICK if args.quick else FULL
    d = args.data or (2 if args.quick else 4)
    folder = Path(args.folder or f"/tmp/shardlib-bench-qlora-{'quick' if args.quick else 'full'}")
    write_folder(s, folder)
    n = sum(p.numel() for p in _meta_params(s))
    row = {"data": d, "size": asdict(s), "params": n, "results": {}, "load": [os.getloadavg()[0]]}
    for side in args.sides:
        row["results"][side] = run_side(side, s, d, str(folder), args.warmup, args.steps,
                                        (args.timeout, args.world_timeout))
    row["load"].append(os.getloadavg()[0])
    print(f"\nLlama {s.layers} layers, hidden {s.hidden}, heads {s.heads} (kv {s.kv}), MLP {s.inter}, vocab "
          f"{s.vocab}: {n / 1e9:.3f} B parameters (folder bf16, {sl.format_bytes(2 * n)}); NF4 base + LoRA r={RANK} "
          f"on {'/'.join(TARGETS)}; data {d}, {s.batch} x {s.seq} tokens per rank; median of {args.steps} steps "
          f"after {args.warmup} warm-up; torch {torch.__version__}, gloo, 1 thread per rank, {os.cpu_count()} "
          f"cores; load (1-min) {row['load'][0]:.1f}-{row['load'][1]:.1f}.\n")
    print(table(row))
    write_rows([row], args.json)


def _meta_params(s: Size):
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        return list(LlamaForCausalLM(llama_config(s)).parameters())


if __name__ == "__main__":
    main()
