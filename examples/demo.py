"""Main demo: a mesh over CPU processes, a tensor laid out by specs, redistributed.

Every rank holds its shard of the same global tensor (``arange``, so shards are readable);
each step plans the redistribution (pure data, printed), runs it on the process groups,
checks the result against the global tensor, and reports the collectives each rank ran.

    python examples/demo.py                # mesh=dp2_tp2: 4 processes
    python examples/demo.py mesh=2x2x2     # 8 processes on a 3-axis mesh

The configuration is checked before any process starts (``check_config``: every step planned on
an ``AbstractMesh``); a bad one prints one message and exits with code 2.
"""

from __future__ import annotations

import sys

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

import shardlib as sl


def to_spec(entries) -> sl.P:
    return sl.P(*[tuple(e) if isinstance(e, (list, tuple)) else e for e in (entries or [])])


def check_config(mesh_shape: dict, shape: object, steps: object) -> list[str]:
    """Every problem the ranks would hit, found here: each step's layouts and redistribution are
    built on an ``AbstractMesh`` (plans are data; no process needed)."""
    try:
        mesh = sl.AbstractMesh(mesh_shape)
    except (ValueError, TypeError) as e:
        return [str(e)]
    if (not isinstance(shape, list) or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        return [f"shape must be a list of positive ints — got {shape!r}."]
    if not isinstance(steps, list) or not steps:
        return [f"steps must be a non-empty list of {{from: spec, to: spec}} — got {steps!r}."]
    problems = []
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or not {"from", "to"} <= set(step) or set(step) - {"from", "to", "partial"}:
            problems.append(f"steps[{i}] must have keys from, to (and optionally partial) — got {step!r}.")
            continue
        try:
            src = sl.Layout(mesh, to_spec(step["from"]), partial=step.get("partial") or ())
            dst = sl.Layout(mesh, to_spec(step["to"]))
            sl.plan_redistribute(src, dst, shape)
        except sl.ShardingError as e:
            problems.extend(f"steps[{i}]: {p}" for p in e.problems)
        except TypeError as e:
            problems.append(f"steps[{i}]: {e}")
    return problems


def rank_main(mesh_shape: dict, shape: list[int], steps: list[dict]) -> list[dict]:
    """Runs on every rank; returns what this rank saw, for the parent to print."""
    mesh = sl.Mesh(mesh_shape)
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    report = []
    for step in steps:
        src = sl.Layout(mesh, to_spec(step["from"]), partial=step.get("partial") or ())
        dst = sl.Layout(mesh, to_spec(step["to"]))
        local = full[src.local_slices(shape)].clone()
        if src.partial:  # a partial sum: coordinate 0 holds the value, the others zeros
            if any(mesh.coord(mesh.rank, a) for a in src.partial):
                local.zero_()
        plan = sl.plan_redistribute(src, dst, shape)
        with sl.count_collectives() as counter:
            out = plan.execute(local)
        ok = torch.equal(out, full[dst.local_slices(shape)])
        report.append({"plan": str(plan), "explain": plan.explain(), "before": local.tolist(),
                       "after": out.tolist(), "ok": ok,
                       "collectives": [str(r) for r in counter.records]})
    return report


def show_shard(rows: list) -> str:
    """A 2-D shard as ``[0 1 2; 5 6 7]``; ``[]`` for an empty one."""
    if not rows or not rows[0]:
        return f"[] (empty, {len(rows)} rows)"
    return "[" + "; ".join(" ".join(f"{v:g}" for v in row) for row in rows) + "]"


@hydra.main(version_base=None, config_path="../conf", config_name="demo")
def main(cfg: DictConfig) -> None:
    mesh_shape = OmegaConf.to_container(cfg.mesh.axes)   # meshes/*.yaml: the axes of the mesh preset
    shape = OmegaConf.to_container(cfg.shape) if OmegaConf.is_list(cfg.shape) else cfg.shape
    steps = OmegaConf.to_container(cfg.steps)
    problems = check_config(mesh_shape, shape, steps)
    if problems:
        print("demo.py: " + (problems[0] if len(problems) == 1 else f"{len(problems)} problems in the "
              "configuration:\n" + "\n".join(f"  - {p}" for p in problems)), file=sys.stderr)
        raise SystemExit(2)
    mesh = sl.AbstractMesh(mesh_shape)
    print(f"shardlib demo: mesh {mesh_shape} over {mesh.size} CPU processes (gloo), "
          f"global tensor arange({shape})")
    reports = sl.launch(rank_main, mesh.size, mesh_shape, shape, steps)
    all_ok = True
    for i, step in enumerate(steps):
        print("\n" + "=" * 88)
        print(reports[0][i]["explain"])
        for r in range(mesh.size):
            rep = reports[r][i]
            coords = dict(zip(mesh.axis_names, mesh.coords(r)))
            all_ok &= rep["ok"]
            print(f"  rank {r} {coords}: {show_shard(rep['before'])} -> {show_shard(rep['after'])} "
                  f"{'ok' if rep['ok'] else 'WRONG'}")
            print(f"      ran: {', '.join(rep['collectives']) or 'nothing (local slice)'}")
    print("\n" + ("every shard matches the global tensor" if all_ok else "SOME SHARDS ARE WRONG"))
    if not all_ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
