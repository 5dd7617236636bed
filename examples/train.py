"""The main job: data-parallel training of the reference GPT on real text, on CPU processes.

The text is the Python standard library's own source (ships with every Python, no download),
read as bytes. Every rank draws the same global batch from the same seed; the engine takes
each rank's rows by the plan's batch layout. Rank 0 prints the plan, then the loss.

    python examples/train.py                                   # ZeRO-2, 2 processes
    python examples/train.py mesh=dp4 zero=3 precision=bf16    # any stage, any precision
    python examples/train.py mesh=2x2 sequence_parallel=true   # data 2 x tensor 2 (Megatron TP + SP)

The whole configuration is checked before any process starts (``check_config``): a bad value
prints one message and exits with code 2.
"""

from __future__ import annotations

import pathlib
import sys
import sysconfig
import time

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

import shardlib as sl
from shardlib.models import GPT, GPTConfig


def load_text(megabytes: float) -> torch.Tensor:
    """The stdlib's .py files, sorted, concatenated as bytes (deterministic on every rank)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= megabytes * 2**20:
            break
    return torch.frombuffer(bytearray(b"".join(out)), dtype=torch.uint8).long()


def batch(text: torch.Tensor, n: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(text) - seq - 1, (n,), generator=gen)
    windows = torch.stack([text[s:s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def _plan(model: torch.nn.Module, mesh: sl.AbstractMesh, cfg: dict) -> sl.Plan:
    # the model names its dims; the rules whose axis the mesh has make it Megatron TP (tensor) and a
    # pipeline of its blocks (pipe, with grad_accum micro-batches run by `schedule`)
    rules = {k: v for k, v in dict(cfg["rules"]).items() if mesh.axis_sizes.get(v, 1) > 1} or None
    piped = mesh.axis_sizes.get("pipe", 1) > 1
    extra = {"schedule": cfg.get("schedule", "1f1b"), "microbatches": cfg["grad_accum"]} if piped else {}
    return sl.plan(model, mesh, zero=cfg["zero"], precision=cfg["precision"], grad_accum=cfg["grad_accum"],
                   clip_grad_norm=cfg["clip_grad_norm"], recompute=cfg["recompute"], rules=rules,
                   sequence_parallel=cfg["sequence_parallel"], batch=_example_batch(cfg) if rules else None,
                   **extra)


def _example_batch(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The shapes of a global batch (meta tensors): the planner traces the tensor axis's activation
    collectives from them."""
    ids = torch.zeros(cfg["batch"], cfg["model"]["seq_len"], dtype=torch.long, device="meta")
    return ids, ids


def check_config(cfg: dict) -> list[str]:
    """Every problem the ranks would hit, found in this process before any rank starts.

    The model is built on the meta device (shapes only: no memory, no initialization) and
    planned on an ``AbstractMesh`` with the run's options, so a bad stage, precision, mesh or
    model shape fails the same way it would on the ranks; the global batch must split into
    ``data x grad_accum`` equal micro-batches."""
    problems: list[str] = []
    try:
        mesh = sl.AbstractMesh(cfg["mesh"])
    except (ValueError, TypeError) as e:
        return [str(e)]
    try:
        with torch.device("meta"):
            model = GPT(GPTConfig(**cfg["model"]), seed=None)
    except (ValueError, TypeError) as e:
        problems.append(f"model: {e}")
        model = None
    if model is not None:
        try:
            _plan(model, mesh, cfg)
        except sl.ShardingError as e:
            problems.extend(e.problems)
        except TypeError as e:
            problems.append(str(e))
    for key in ("steps", "batch", "log_every"):
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            problems.append(f"{key} must be a positive int — got {v!r}.")
    n = mesh.axis_size("data") if "data" in mesh.axis_names else 1
    m, b = cfg["grad_accum"], cfg["batch"]
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (m, b)) and b % (n * m):
        need = n * m
        lo, hi = (b // need) * need, (b // need + 1) * need
        problems.append(f"batch={b} does not split over data={n} ranks x grad_accum={m} micro-batches — expected "
                        f"a multiple of {need}. Use batch={f'{lo} or {hi}' if lo else hi}, or change grad_accum "
                        "or the mesh.")
    return problems


def rank_main(cfg: dict) -> list[float]:
    torch.set_num_threads(1)
    mesh = sl.Mesh(cfg["mesh"])
    model = GPT(GPTConfig(**cfg["model"]), seed=cfg["seed"])
    plan = _plan(model, mesh, cfg)
    engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=cfg["lr"]),
                            lr_scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg["steps"]))
    text = load_text(cfg["text_mb"])
    gen = torch.Generator().manual_seed(cfg["seed"])
    if mesh.rank == 0:
        print(plan.explain(max_params=12), flush=True)
        print(f"\ntext: {len(text) / 2**20:.1f} MiB of the stdlib's source; {cfg['steps']} steps of "
              f"{cfg['batch']} x {cfg['model']['seq_len']} tokens\n", flush=True)
    losses = []
    t0 = time.perf_counter()
    for step in range(1, cfg["steps"] + 1):
        loss = engine.step(batch(text, cfg["batch"], cfg["model"]["seq_len"], gen))
        losses.append(loss)
        if mesh.rank == 0 and (step % cfg["log_every"] == 0 or step == 1):
            dt = time.perf_counter() - t0
            tok = step * cfg["batch"] * cfg["model"]["seq_len"]
            scale = f", loss scale {engine.loss_scale:g}" if engine.loss_scale else ""
            print(f"step {step:4d}  loss {loss:.4f}  {1e3 * dt / step:6.1f} ms/step  {tok / dt:8.0f} tok/s{scale}",
                  flush=True)
    if mesh.rank == 0:
        held = engine.memory_held()
        print(f"\nmodel states held per rank: {sl.format_bytes(held['total'])} "
              f"(planned {sl.format_bytes(plan.memory_per_rank()['total'])})", flush=True)
    return losses


@hydra.main(version_base=None, config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    conf = OmegaConf.to_container(cfg, resolve=True)
    problems = check_config(conf)
    if problems:
        print("train.py: " + (problems[0] if len(problems) == 1 else f"{len(problems)} problems in the "
              "configuration:\n" + "\n".join(f"  - {p}" for p in problems)), file=sys.stderr)
        raise SystemExit(2)
    n = sl.AbstractMesh(conf["mesh"]).size
    losses = sl.launch(rank_main, n, conf)
    if any(r != losses[0] for r in losses):
        raise SystemExit("ranks disagree on the loss")
    first, last = losses[0][0], losses[0][-1]
    print(f"loss {first:.3f} -> {last:.3f} over {len(losses[0])} steps, the same on all {n} ranks")
    if not last < first:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
