"""How long ``plan_redistribute`` takes on large meshes, with no processes (issue 7, item 6).

    python benchmarks/bench_planning.py                     # 10,240 devices, 1-d and 3-d meshes
    python benchmarks/bench_planning.py --repeat 20

Each redistribution is planned ``--repeat`` times with the plan cache cleared in between; the
median and the worst time are printed in milliseconds, with the plan itself. The first call of
the process (imports, numpy warm-up) is made beforehand and not counted. A size column shows
how the time grows with the mesh: linear in the number of ranks, never quadratic.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import shardlib as sl
from shardlib import P
from shardlib.comm import redistribute as redis

MESH_1D = {"data": 10240}
MESH_3D = {"data": 64, "pipe": 10, "tensor": 16}

CASES = [
    # (mesh, src spec, src partial, dst spec, global shape)
    (MESH_1D, P(), (), P("data"), (10240, 1024)),
    (MESH_1D, P("data"), (), P(), (10240, 1024)),
    (MESH_1D, P(), ("data",), P("data"), (10240, 1024)),
    (MESH_1D, P(), ("data",), P(), (10240, 1024)),
    (MESH_1D, P("data"), (), P(None, "data"), (10240, 10240)),
    (MESH_1D, P("data"), (), P(), (4096, 1024)),                 # uneven: the trailing ranks hold nothing
    (MESH_3D, P("data"), (), P("tensor"), (4096, 1024)),
    (MESH_3D, P("data", "tensor"), (), P("tensor", "data"), (4096, 1024)),
    (MESH_3D, P(("data", "tensor")), (), P(), (4096, 1024)),
    (MESH_3D, P(), ("pipe",), P("data", "tensor"), (4096, 1024)),
    (MESH_3D, P("data"), ("tensor",), P(("data", "tensor")), (4096, 1024)),
    (MESH_3D, P(("data", "tensor")), (), P("data"), (1000, 1000)),  # uneven, not nested: exchange
    ({"data": 2048}, P(), (), P("data"), (4096, 1024)),        # the 7.5 s case
    ({"data": 1024}, P("data"), (), P(None, "data"), (10240, 10240)),
]


def time_case(mesh_sizes, src_spec, partial, dst_spec, shape, repeat):
    mesh = sl.AbstractMesh(mesh_sizes)
    src, dst = sl.Layout(mesh, src_spec, partial=partial), sl.Layout(mesh, dst_spec)
    times = []
    for _ in range(repeat):
        redis._plan_cached.cache_clear()
        t = time.perf_counter()
        plan = sl.plan_redistribute(src, dst, shape, torch.float32)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), max(times), plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    m = sl.AbstractMesh({"data": 4})
    sl.plan_redistribute(sl.Layout(m, P(), partial="data"), sl.Layout(m, P("data")), (5, 3))   # warm-up
    print(f"{'ranks':>6} {'median':>9} {'worst':>9}  plan")
    for mesh_sizes, src_spec, partial, dst_spec, shape in CASES:
        med, worst, plan = time_case(mesh_sizes, src_spec, partial, dst_spec, shape, args.repeat)
        n = sl.AbstractMesh(mesh_sizes).size
        print(f"{n:>6} {med:>7.1f}ms {worst:>7.1f}ms  {plan}   shape {list(shape)} on {mesh_sizes}")


if __name__ == "__main__":
    main()
