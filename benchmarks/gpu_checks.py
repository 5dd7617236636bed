"""The GPU checks of ``shared/GPU_CHECKS.md`` (items 2, 3, 5 and 4) in one time-boxed run.

    python3 benchmarks/gpu_checks.py --out DIR            # on a GPU machine (~4 minutes on an H200)
    python3 benchmarks/gpu_checks.py --smoke --out DIR    # tiny models, the CPU where there is no GPU: the plumbing

Each part runs in its own subprocess with its own timeout, so a crash or a hang loses that part
only; the whole run stays inside ``--budget`` seconds (parts that no longer fit are skipped and
said so). Writes ``DIR/gpu_checks.md`` (tables), ``DIR/gpu_checks.json`` (every number) and
``DIR/gpu_checks.log`` (every part's output). Progress goes to stdout, flushed.

* **2, single-GPU speed**: the reference GPT (``shardlib.models.GPT``; by default the ``model=1b``
  preset's shape, 1.42 B parameters) in bf16 with fused AdamW, through the engine at world 1
  (``sl.plan(precision="bf16")``) and as plain PyTorch (the same model, ``torch.autocast`` bf16,
  ``AdamW(fused=True)``), each in its own process: warm-up steps, then the median of the timed
  steps. tokens/s and MFU by Megatron's count (``shardlib.planner.estimate.transformer_flops``:
  ``tokens * (3 * layers * (24 d^2 + 4 s d) + 6 d V)``) over the dense bf16 peak of 989 TFLOP/s
  (H100/H200 SXM). CUDA's peak memory beside the plan's ``peak_per_rank``.
* **3, offload**: a 0.6 B GPT, ZeRO-2 at world 1, bf16, the optimizer on ``host`` (ZeRO-Offload)
  against the same plan without offload, and FSDP2's ``CPUOffloadPolicy`` on the same model: step
  time ratio, the copies counted on a step (``engine.copies``) against the plan's
  (``plan.copy_bytes_per_step``), the host update's time, CUDA's peak against the plan's.
* **5, the estimator**: ``python -m shardlib.explain --json`` for the configurations of 2 and 3 with
  the ``h100_64`` preset's figures (one device: ``mesh.axes={data:1,tensor:1}``): measured / estimated
  step time and memory.
* **4, several ranks on one GPU**: 2 ranks over gloo with ``sl.Mesh({"data": 2}, device="cuda")``,
  ZeRO 0-3, losses against one process on the same device; and whether ``python -m shardlib.verify``
  runs on a one-GPU machine at all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEAK_BF16 = 989e12          # dense bf16 TFLOP/s of an H100/H200 SXM (the datasheet's, without sparsity)

# the shapes: (vocab, seq, d_model, heads, layers, batch rows)
FULL = {
    "2": dict(vocab=50304, seq=2048, d=2048, heads=16, layers=24, batch=8, warmup=3, steps=6),
    "3": dict(vocab=50304, seq=1024, d=2048, heads=16, layers=8, batch=16, warmup=2, steps=4),
    "4": dict(vocab=64, seq=16, d=32, heads=4, layers=2, batch=8, warmup=0, steps=4),
}
SMOKE = {
    "2": dict(vocab=256, seq=64, d=64, heads=4, layers=2, batch=2, warmup=1, steps=2),
    "3": dict(vocab=256, seq=64, d=64, heads=4, layers=2, batch=4, warmup=1, steps=2),
    "4": dict(vocab=64, seq=16, d=32, heads=4, layers=2, batch=8, warmup=0, steps=3),
}
# part name -> (item, timeout seconds on the GPU)
PARTS = {
    "2-shardlib": ("2", 150), "2-torch": ("2", 120),
    "3-plain": ("3", 100), "3-host": ("3", 150), "3-fsdp2": ("3", 120),
    "5-explain": ("5", 60), "4-gloo": ("4", 90), "4-verify": ("4", 60),
}


def say(*a) -> None:
    print(*a, flush=True)


# ---------------------------------------------------------------------------------------------
# Shared by the workers
# ---------------------------------------------------------------------------------------------

def device():
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def gpt_config(c: dict):
    from shardlib.models import GPTConfig
    return GPTConfig(vocab_size=c["vocab"], seq_len=c["seq"], d_model=c["d"], n_heads=c["heads"], n_layers=c["layers"])


def build_gpt(c: dict, dev: str):
    """The GPT (seed 0), built straight on ``dev`` (CUDA's generator draws its values: fast)."""
    import torch

    from shardlib.models import GPT
    with torch.device(dev):
        return GPT(gpt_config(c), seed=0)


def batches(c: dict, dev: str, count: int):
    from shardlib.models import token_batch
    return [tuple(t.to(dev) for t in token_batch(gpt_config(c), c["batch"], seed=s)) for s in range(count)]


def flops(c: dict) -> float:
    from shardlib.planner.estimate import transformer_flops
    return transformer_flops(layers=c["layers"], d_model=c["d"], seq=c["seq"], vocab=c["vocab"],
                             tokens=c["batch"] * c["seq"])


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_steps(step, data: list, warmup: int) -> dict:
    """``step(batch) -> loss`` over ``data``: the first ``warmup`` untimed, the rest timed one by one
    (synchronized before and after), CUDA's peak memory over the timed steps."""
    import torch
    losses, times = [], []
    cuda = torch.cuda.is_available()
    for i, b in enumerate(data):
        if i == warmup and cuda:
            sync()
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        losses.append(float(step(b)))
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        say(f"    step {i}: loss {losses[-1]:.4f}  {1e3 * (time.perf_counter() - t0):.1f} ms"
            + ("" if i >= warmup else " (warm-up)"))
    out = {"losses": losses, "step_s": times, "median_s": statistics.median(times) if times else None}
    if cuda:
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        out["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
        out["cuda_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
    return out


def speed(c: dict, median_s: float | None) -> dict:
    if not median_s:
        return {}
    f = flops(c)
    n = c["layers"] * (12 * c["d"] ** 2 + 13 * c["d"]) + c["vocab"] * c["d"] * 2 + c["seq"] * c["d"] + 2 * c["d"]
    return {"tokens_per_s": c["batch"] * c["seq"] / median_s, "flops_per_step": f,
            "mfu_6nd": 6 * n * c["batch"] * c["seq"] / median_s / PEAK_BF16,
            "achieved_tflops": f / median_s / 1e12, "mfu": f / median_s / PEAK_BF16}


def plan_memory(plan, c: dict, dev: str, rows: int) -> dict:
    """The plan's statement: model states per kind and the peak with one micro-batch's activations
    (``activation_bytes`` of the GPT on the meta device in the plan's compute dtype, on fake tensors
    of ``dev``; also in fp32, as the dry run counts them)."""
    import torch

    from shardlib.models import GPT
    from shardlib.planner.peak import activation_bytes
    out = {"memory_per_rank_device": dict(plan.memory_per_rank(0, kind="device")),
           "memory_per_rank_host": dict(plan.memory_per_rank(0, kind="host"))}
    try:
        with torch.device("meta"):
            shadow = GPT(gpt_config(c), seed=None)
        ids = torch.zeros(rows, c["seq"], dtype=torch.long, device="meta")
        out["activation_bytes_fp32_model"] = activation_bytes(shadow, (ids, ids), device=dev)
        act = activation_bytes(shadow.to(plan.compute_dtype), (ids, ids), device=dev)
        out["activation_bytes"] = act
        out["peak_per_rank"] = dict(plan.peak_per_rank(0, activation_bytes=act))
    except Exception as e:   # the statement is a nice-to-have beside the measurement
        out["error"] = f"{type(e).__name__}: {e}"
    return out


# ---------------------------------------------------------------------------------------------
# Workers (each in its own process)
# ---------------------------------------------------------------------------------------------

def w_2_shardlib(c: dict) -> dict:
    import torch

    import shardlib as sl
    dev = device()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    try:
        model = build_gpt(c, dev)
        built_on = dev
    except Exception:
        model = build_gpt(c, "cpu")
        built_on = "cpu"
    n = sum(p.numel() for p in model.parameters())
    say(f"    built {n / 1e9:.3f} B parameters on {built_on} in {time.perf_counter() - t0:.1f} s")
    mesh = sl.Mesh({"data": 1}, device=dev)
    plan = sl.plan(model, mesh, zero=0, precision="bf16")
    mem_plan = plan_memory(plan, c, dev, c["batch"])
    t0 = time.perf_counter()
    fallback = None
    try:
        eng = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))
    except Exception as e:       # a model already on the device refused: build on the CPU, as the tests do
        if built_on == "cpu":
            raise
        fallback = f"parallelize of a {built_on}-built model: {type(e).__name__}: {str(e)[:500]}"
        say(f"    {fallback}; building on the CPU instead")
        del model
        model, built_on = build_gpt(c, "cpu"), "cpu"
        plan = sl.plan(model, mesh, zero=0, precision="bf16")
        eng = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))
    setup_s = time.perf_counter() - t0
    say(f"    parallelize: {setup_s:.1f} s")
    data = batches(c, dev, c["warmup"] + c["steps"])
    r = timed_steps(eng.step, data, c["warmup"])
    r.update(params=n, built_on=built_on, setup_s=setup_s, plan=mem_plan, fallback=fallback,
             memory_held=dict(eng.memory_held()), **speed(c, r["median_s"]))
    return r


def w_2_torch(c: dict) -> dict:
    import torch
    dev = device()
    model = build_gpt(c, dev)
    n = sum(p.numel() for p in model.parameters())
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    except Exception:      # a torch without fused AdamW on this device
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(b):
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = model(*b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    r = timed_steps(step, batches(c, dev, c["warmup"] + c["steps"]), c["warmup"])
    r.update(params=n, fused=opt.defaults.get("fused"), **speed(c, r["median_s"]))
    return r


def _offload_engine(c: dict, offload: dict | None) -> dict:
    import torch

    import shardlib as sl
    dev = device()
    model = build_gpt(c, dev)
    n = sum(p.numel() for p in model.parameters())
    mesh = sl.Mesh({"data": 1}, device=dev)
    plan = sl.plan(model, mesh, zero=2, precision="bf16", offload=offload or {})
    mem_plan = plan_memory(plan, c, dev, c["batch"])
    t0 = time.perf_counter()
    eng = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))
    setup_s = time.perf_counter() - t0
    del model
    update = []                                  # the optimizer's own step (on the host, offloaded)
    opt = eng.optimizer
    marks = {}
    opt.register_step_pre_hook(lambda *a: marks.__setitem__("t", time.perf_counter()))
    opt.register_step_post_hook(lambda *a: update.append(time.perf_counter() - marks["t"]))
    data = batches(c, dev, c["warmup"] + c["steps"])
    r = timed_steps(eng.step, data, c["warmup"])
    copies = {f"{op} {what}": v[0] for (op, what), v in eng.copies.step.items()}
    counted = {}
    for (op, _), v in eng.copies.step.items():
        counted[op] = counted.get(op, 0) + v[0]
    r.update(params=n, setup_s=setup_s, plan=mem_plan, copies_last_step=copies, copies_counted=counted,
             copies_planned=dict(plan.copy_bytes_per_step(0)), optimizer_step_s=update[c["warmup"]:],
             memory_held={k: dict(eng.memory_held(kind=k)) for k in ("device", "host")},
             offload=offload or {}, **speed(c, r["median_s"]))
    if getattr(eng, "offload", None) is not None and hasattr(eng.offload, "close"):
        eng.offload.close()
    return r


def w_3_plain(c: dict) -> dict:
    return _offload_engine(c, None)


def w_3_host(c: dict) -> dict:
    return _offload_engine(c, {"optimizer": "host"})


def w_3_fsdp2(c: dict) -> dict:
    import socket

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    dev = device()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if dev == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        dmesh = init_device_mesh(dev, (1,))
        model = build_gpt(c, dev)
        n = sum(p.numel() for p in model.parameters())
        kw = dict(mesh=dmesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                  offload_policy=CPUOffloadPolicy(pin_memory=dev == "cuda"))
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        update, marks, state = [], {}, {"fused": True, "fused_error": None}

        def make_opt(fused: bool):
            o = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused else {}))
            o.register_step_pre_hook(lambda *a: marks.__setitem__("t", time.perf_counter()))
            o.register_step_post_hook(lambda *a: update.append(time.perf_counter() - marks["t"]))
            return o

        try:
            opt = make_opt(True)
        except Exception as e:
            opt, state["fused"], state["fused_error"] = make_opt(False), False, f"{type(e).__name__}: {e}"

        def step(b):
            nonlocal opt
            loss = model(*b)
            loss.backward()
            try:
                opt.step()
            except Exception as e:      # fused AdamW refused on offloaded DTensors: torch's default (foreach)
                if not state["fused"] or opt.state:
                    raise
                say(f"    fused AdamW failed ({type(e).__name__}: {str(e)[:200]}); using the default")
                opt, state["fused"], state["fused_error"] = make_opt(False), False, f"{type(e).__name__}: {e}"
                update.clear()
                opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        r = timed_steps(step, batches(c, dev, c["warmup"] + c["steps"]), c["warmup"])
        r.update(params=n, optimizer_step_s=update[c["warmup"]:], **state, **speed(c, r["median_s"]))
        return r
    finally:
        dist.destroy_process_group()


def _explain(overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "shardlib.explain", *overrides, "--json"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=40)
    if p.returncode != 0:
        return {"cmd": " ".join(cmd[2:]), "error": (p.stderr or p.stdout).strip()[-800:]}
    return {"cmd": " ".join(cmd[2:]), "result": json.loads(p.stdout.strip().splitlines()[-1])}


def explain_overrides(c: dict, parallel: str, extra: list[str]) -> list[str]:
    return ["mesh=h100_64", "mesh.axes={data:1,tensor:1}", f"parallel={parallel}", "model=1b",
            f"model.vocab_size={c['vocab']}", f"model.seq_len={c['seq']}", f"model.d_model={c['d']}",
            f"model.n_heads={c['heads']}", f"model.n_layers={c['layers']}", f"train.batch={c['batch']}",
            "train.precision=bf16", *extra]


def w_5_explain(cfgs: dict) -> dict:
    out = {}
    out["2"] = _explain(explain_overrides(cfgs["2"], "dp", []))
    out["3-plain"] = _explain(explain_overrides(cfgs["3"], "zero2", []))
    out["3-host"] = _explain(explain_overrides(cfgs["3"], "zero_offload", []))
    return out


def rank_gloo(c: dict, zero: int) -> list[float]:
    import torch

    import shardlib as sl
    from shardlib.testing import get_mesh
    mesh = get_mesh({"data": 2}, device=device())
    model = build_gpt(c, "cpu")
    plan = sl.plan(model, mesh, zero=zero)
    eng = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-6))
    return [eng.step(b) for b in batches(c, "cpu", c["steps"])]


def rank_all_zero(c: dict) -> dict:
    out = {}
    for z in range(4):
        try:
            out[z] = {"losses": rank_gloo(c, z)}
        except Exception as e:
            import traceback
            out[z] = {"error": f"{type(e).__name__}: {str(e)[:600]}",
                      "trace": "".join(traceback.format_exception(e))[-1500:]}
    return out


def w_4_gloo(c: dict) -> dict:
    import torch

    import shardlib as sl
    dev = device()
    mesh = sl.Mesh({"data": 1}, device=dev)
    model = build_gpt(c, "cpu")
    eng = sl.parallelize(model, sl.plan(model, mesh),
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-6))
    one = [eng.step(b) for b in batches(c, "cpu", c["steps"])]
    sys.path.insert(0, HERE)                     # the ranks import this module by name
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")])
    import gpu_checks
    try:
        per_rank = sl.launch(gpu_checks.rank_all_zero, 2, c, backend="gloo", timeout=60, run_timeout=75)
    except Exception as e:
        return {"one_process": one, "error": f"{type(e).__name__}: {str(e)[:1500]}"}
    rows = {}
    for z in range(4):
        rs = [pr[z] for pr in per_rank]
        if any("error" in r for r in rs):
            rows[z] = {"error": " | ".join(f"rank {i}: {r['error']}" for i, r in enumerate(rs) if "error" in r),
                       "trace": [r.get("trace") for r in rs]}
            continue
        rel = max(abs(a - b) / abs(b) for a, b in zip(rs[0]["losses"], one))
        rows[z] = {"losses": rs[0]["losses"], "ranks_agree": all(r["losses"] == rs[0]["losses"] for r in rs),
                   "max_rel_vs_one_process": rel}
    return {"one_process": one, "device": dev, "zero": rows}


def w_4_verify(c: dict) -> dict:
    cmd = [sys.executable, "-m", "shardlib.verify", "train.steps=3", "--cases", "single", "dp4"]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=c.get("timeout", 50))
        return {"cmd": " ".join(cmd[2:]), "rc": p.returncode, "tail": (p.stdout + p.stderr)[-2500:]}
    except subprocess.TimeoutExpired as e:
        return {"cmd": " ".join(cmd[2:]), "rc": "timeout", "tail": str(e.stdout or "")[-1500:]}


WORKERS = {"2-shardlib": w_2_shardlib, "2-torch": w_2_torch, "3-plain": w_3_plain, "3-host": w_3_host,
           "3-fsdp2": w_3_fsdp2, "5-explain": w_5_explain, "4-gloo": w_4_gloo, "4-verify": w_4_verify}


def worker_main(name: str, cfg_json: str, result: str) -> int:
    cfg = json.loads(cfg_json)
    try:
        out = {"ok": True, "result": WORKERS[name](cfg)}
    except BaseException as e:
        traceback.print_exc()
        out = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}", "traceback": traceback.format_exc()[-4000:]}
    with open(result, "w") as f:
        json.dump(out, f, default=str)
    return 0 if out["ok"] else 1


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

def environment() -> dict:
    import platform

    import torch
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=p.total_memory / 2**30, sm_count=p.multi_processor_count,
                   capability=f"{p.major}.{p.minor}")
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        env["commit"] = out.stdout.strip()
    except OSError:
        pass
    return env


def run_part(name: str, cfg: dict, timeout: float, log) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tf:
        result = tf.name
    os.unlink(result)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--cfg", json.dumps(cfg), "--result", result]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    t0 = time.perf_counter()
    log.write(f"\n===== {name} (timeout {timeout:.0f} s) =====\n")
    log.flush()
    tail: list[str] = []
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             start_new_session=True)
        deadline = t0 + timeout
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        timed_out = False
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                timed_out = True
                break
            if sel.select(timeout=min(left, 1.0)):
                line = p.stdout.readline()
                if not line:
                    break
                log.write(line)
                log.flush()
                tail = (tail + [line.rstrip()])[-40:]
                if line.startswith("    "):
                    say(f"  [{name}] {line.strip()}")
        if timed_out:
            os.killpg(p.pid, 9)
        p.wait()
        if timed_out:
            out = {"ok": False, "error": f"timed out after {timeout:.0f} s", "tail": tail[-20:]}
        elif os.path.exists(result):
            with open(result) as f:
                out = json.load(f)
            if not out["ok"]:
                out["tail"] = tail[-20:]
        else:
            out = {"ok": False, "error": f"no result (exit code {p.returncode})", "tail": tail[-20:]}
    finally:
        if os.path.exists(result):
            os.unlink(result)
    out["wall_s"] = time.perf_counter() - t0
    return out


def fmt_b(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**28 else f"{n / 2**20:.1f} MiB"


def fmt_ms(s) -> str:
    return "-" if s is None else f"{1e3 * s:.1f}"


def report(env: dict, cfgs: dict, results: dict, smoke: bool) -> str:
    L = [f"# GPU checks ({'SMOKE: tiny models, not measurements' if smoke else 'measured'})", "",
         f"Device: {env.get('gpu', 'no GPU (' + str(env.get('cpu_count')) + ' CPUs)')}"
         + (f", {env['gpu_memory_gib']:.0f} GiB, {env['sm_count']} SMs" if "gpu" in env else "")
         + f"; torch {env['torch']} (CUDA {env['cuda']}), Python {env['python']}, commit {env.get('commit', '?')}.",
         f"MFU: Megatron's FLOP count (`transformer_flops`) over {PEAK_BF16 / 1e12:.0f} TFLOP/s dense bf16 peak.", ""]

    def r(name):
        return results.get(name, {})

    def err(name):
        x = r(name)
        if not x:
            return "not run"
        return None if x.get("ok") else (x.get("error") or "failed").splitlines()[0][:300]

    def head(cols: list[str]) -> list[str]:
        """A Markdown table's head: the column names and the rule under them."""
        return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def side_rows(parts, cols: list[str]):
        """``(name, label, result)`` of each part of ``parts`` (name, label) that ran; a failed part's row
        (its first error line, the other cells empty) goes into the table instead."""
        for name, label in parts:
            if err(name):
                L.append(f"| {label} | failed: {err(name)} " + "|" * (len(cols) - 1) + " ")
                continue
            yield name, label, r(name)["result"]

    # item 2
    c = cfgs["2"]
    cols = ["side", "params", "step ms (median)", "tokens/s", "TFLOP/s", "MFU", "MFU by 6NT", "CUDA peak", "first loss",
            "last loss"]
    L += ["## 2. Single-GPU speed", "",
          f"GPT vocab {c['vocab']}, seq {c['seq']}, d_model {c['d']}, {c['heads']} heads, {c['layers']} layers; "
          f"batch {c['batch']} x {c['seq']} tokens; bf16; AdamW fused; {c['warmup']} warm-up + median of {c['steps']} steps.", "",
          *head(cols)]
    for name, label, y in side_rows((("2-shardlib", "shardlib engine (precision=bf16)"),
                                     ("2-torch", "PyTorch autocast bf16")), cols):
        L.append(f"| {label} | {y['params'] / 1e9:.3f} B | {fmt_ms(y['median_s'])} | {y.get('tokens_per_s', 0):,.0f} | "
                 f"{y.get('achieved_tflops', 0):.1f} | {100 * y.get('mfu', 0):.1f}% | {100 * y.get('mfu_6nd', 0):.1f}% | "
                 f"{fmt_b(y.get('cuda_peak_bytes'))} | "
                 f"{y['losses'][0]:.4f} | {y['losses'][-1]:.4f} |")
    if not err("2-shardlib") and not err("2-torch"):
        a, b = r("2-shardlib")["result"], r("2-torch")["result"]
        L.append("")
        L.append(f"Ratio shardlib / PyTorch step time: **{a['median_s'] / b['median_s']:.3f}** (goal <= 1.0); "
                 f"MFU {100 * a.get('mfu', 0):.1f}% (goal >= 50%).")
        pm = a.get("plan", {})
        if "peak_per_rank" in pm:
            L.append(f"Plan: peak {fmt_b(pm['peak_per_rank'].get('peak'))} (states {fmt_b(pm['peak_per_rank'].get('states'))}, "
                     f"activations {fmt_b(pm.get('activation_bytes'))} in bf16, {fmt_b(pm.get('activation_bytes_fp32_model'))} "
                     f"counted on the fp32 model as the dry run does); measured CUDA peak {fmt_b(a.get('cuda_peak_bytes'))} "
                     f"= {a.get('cuda_peak_bytes', 0) / max(pm['peak_per_rank'].get('peak', 1), 1):.2f}x the plan's peak. "
                     f"Held between steps {fmt_b(a['memory_held'].get('total'))} vs planned "
                     f"{fmt_b(pm['memory_per_rank_device'].get('total'))}.")
        elif pm.get("error"):
            L.append(f"Plan's peak: not computed ({pm['error'][:200]}).")
    L.append("")

    # item 3
    c = cfgs["3"]
    cols = ["side", "step ms", "tokens/s", "vs no offload", "optimizer.step ms", "CUDA peak", "plan's peak",
            "copies counted (d2h / h2d)", "planned (d2h / h2d)"]
    L += ["## 3. Offload", "",
          f"GPT vocab {c['vocab']}, seq {c['seq']}, d_model {c['d']}, {c['layers']} layers; batch {c['batch']} x {c['seq']}; "
          f"bf16, ZeRO-2 at world 1; AdamW fused; {c['warmup']} warm-up + median of {c['steps']} steps.", "",
          *head(cols)]
    base = r("3-plain").get("result", {}).get("median_s") if not err("3-plain") else None
    for name, label, y in side_rows((("3-plain", "shardlib, no offload"), ("3-host", "shardlib, optimizer on host"),
                                     ("3-fsdp2", "FSDP2 CPUOffloadPolicy")), cols):
        rel = f"{base / y['median_s']:.2f}x throughput" if base and y.get("median_s") else "-"
        upd = y.get("optimizer_step_s") or []
        pk = y.get("plan", {}).get("peak_per_rank", {}).get("peak")
        cc, cp = y.get("copies_counted", {}), y.get("copies_planned", {})
        L.append(f"| {label} | {fmt_ms(y['median_s'])} | {y.get('tokens_per_s', 0):,.0f} | {rel} | "
                 f"{fmt_ms(statistics.median(upd)) if upd else '-'} | {fmt_b(y.get('cuda_peak_bytes'))} | {fmt_b(pk)} | "
                 + (f"{fmt_b(cc.get('d2h', 0))} / {fmt_b(cc.get('h2d', 0))} | {fmt_b(cp.get('d2h', 0))} / {fmt_b(cp.get('h2d', 0))} |"
                    if name != "3-fsdp2" else "- | - |"))
    if not err("3-host"):
        y = r("3-host")["result"]
        same = {k: v for k, v in y["copies_counted"].items() if v} == {k: v for k, v in y["copies_planned"].items() if v}
        L += ["", f"Copies counted on the last step {'EQUAL' if same else 'DIFFER FROM'} the plan's: counted "
                  f"{y['copies_counted']}, planned {y['copies_planned']}; by entry {y['copies_last_step']}.",
              f"Held on the host: {fmt_b(y['memory_held']['host'].get('total'))} (planned "
              f"{fmt_b(y['plan']['memory_per_rank_host'].get('total'))}); on the device "
              f"{fmt_b(y['memory_held']['device'].get('total'))} (planned {fmt_b(y['plan']['memory_per_rank_device'].get('total'))})."]
    L.append("")

    # item 5
    L += ["## 5. The estimator (`python -m shardlib.explain`, h100_64's figures on one device)", "",
          *head(["config", "estimated step ms", "measured ms", "measured / estimated", "estimated memory",
                 "measured CUDA peak"])]
    if err("5-explain"):
        L.append(f"| failed: {err('5-explain')} ||||||")
    else:
        ex = r("5-explain")["result"]
        for key, meas in (("2", "2-shardlib"), ("3-plain", "3-plain"), ("3-host", "3-host")):
            e = ex.get(key, {})
            if "error" in e:
                L.append(f"| {key} | explain failed: {e['error'].splitlines()[-1][:200]} |||||")
                continue
            est = (e["result"].get("step_ms") or {}).get("no_overlap")
            m = r(meas).get("result", {}).get("median_s") if not err(meas) else None
            ratio = f"{1e3 * m / est:.2f}" if m and est else "-"
            L.append(f"| {key} | {est:.4g} | {fmt_ms(m)} | {ratio} | {fmt_b(e['result']['memory_per_rank'].get('total'))} | "
                     f"{fmt_b(r(meas).get('result', {}).get('cuda_peak_bytes'))} |" if est is not None else
                     f"| {key} | - | {fmt_ms(m)} | - | - | - |")
        L += ["", "Commands: " + "; ".join(f"`python -m {ex[k]['cmd']}`" for k in ex if "cmd" in ex[k])]
    L.append("")

    # item 4
    L += ["## 4. Two ranks on one GPU (gloo, `sl.Mesh({'data': 2}, device='cuda')`)", ""]
    if err("4-gloo"):
        L.append(f"failed: {err('4-gloo')}")
    else:
        y = r("4-gloo")["result"]
        if "error" in y:
            L.append(f"the 2-rank world failed: {y['error'][:600]}")
        else:
            L += head(["ZeRO", "max rel. loss diff vs one process", "ranks agree"])
            for z, row in y["zero"].items():
                L.append(f"| {z} | {row['max_rel_vs_one_process']:.2e} | {row['ranks_agree']} |" if "error" not in row
                         else f"| {z} | failed: {row['error'][:300]} | |")
    v = r("4-verify")
    if v.get("ok"):
        y = v["result"]
        L += ["", f"`python -m {y['cmd']}`: exit {y['rc']}", "", "```", y["tail"][-1500:], "```"]
    elif v:
        L += ["", f"verify: {err('4-verify')}"]
    L.append("")
    L += ["## Parts", "", *head(["part", "ok", "wall s", "error"])]
    for name, x in results.items():
        L.append(f"| {name} | {x.get('ok')} | {x.get('wall_s', 0):.1f} | {(x.get('error') or '').splitlines()[0][:200] if x.get('error') else ''} |")
    return "\n".join(L) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu_checks_out"))
    ap.add_argument("--smoke", action="store_true", help="tiny models (the CPU where there is no GPU): the plumbing")
    ap.add_argument("--parts", nargs="*", default=list(PARTS), help=f"of {', '.join(PARTS)}")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run (parts that no longer fit are skipped)")
    ap.add_argument("--batch2", type=int, default=None, help="item 2's batch rows (default 8 on a GPU of > 100 GiB, else 4)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cfg", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args.worker, args.cfg, args.result)

    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    say(f"gpu_checks: {env}")
    cfgs = {k: dict(v) for k, v in (SMOKE if args.smoke else FULL).items()}
    if args.batch2:
        cfgs["2"]["batch"] = args.batch2
    elif not args.smoke and env.get("gpu_memory_gib", 0) < 100:
        cfgs["2"]["batch"] = 4
    results: dict[str, dict] = {}
    json_path, md_path = os.path.join(args.out, "gpu_checks.json"), os.path.join(args.out, "gpu_checks.md")

    def write():
        with open(json_path, "w") as f:
            json.dump({"env": env, "smoke": args.smoke, "configs": cfgs, "results": results}, f, indent=1, default=str)
        try:
            text = report(env, cfgs, results, args.smoke)
        except Exception:
            text = "# GPU checks\n\nreport failed:\n```\n" + traceback.format_exc() + "```\n"
        with open(md_path, "w") as f:
            f.write(text)

    with open(os.path.join(args.out, "gpu_checks.log"), "w") as log:
        for name in args.parts:
            item, timeout = PARTS[name]
            left = args.budget - (time.perf_counter() - t_start)
            if left < 20:
                results[name] = {"ok": False, "error": f"skipped: {left:.0f} s of the budget left"}
                say(f"[{name}] skipped ({left:.0f} s left)")
                continue
            timeout = min(timeout, left - 5)
            cfg = cfgs if name == "5-explain" else dict(cfgs[item], smoke=args.smoke, timeout=timeout - 10)
            say(f"[{name}] start (timeout {timeout:.0f} s, {left:.0f} s of the budget left)")
            x = run_part(name, cfg, timeout, log)
            results[name] = x
            if x.get("ok"):
                y = x["result"]
                brief = {k: y[k] for k in ("median_s", "tokens_per_s", "mfu", "cuda_peak_bytes", "copies_counted",
                                           "copies_planned") if isinstance(y, dict) and k in y}
                say(f"[{name}] ok in {x['wall_s']:.1f} s {json.dumps(brief, default=str)}")
            else:
                say(f"[{name}] FAILED in {x['wall_s']:.1f} s: {x.get('error')}")
                for line in x.get("tail", [])[-12:]:
                    say(f"    | {line}")
            write()
    write()
    say(f"gpu_checks: done in {time.perf_counter() - t_start:.0f} s; wrote {md_path}, {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
