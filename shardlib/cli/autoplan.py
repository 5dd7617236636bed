"""``python -m shardlib.autoplan <overrides> --devices N [--top K] [--json]``: search every plan of a model on
N devices of a machine and print the fastest that fit, each with the Hydra overrides that run it.

    python -m shardlib.autoplan model=175b mesh=h100_64 train.batch=512 --devices 64 --top 5
    python -m shardlib.autoplan model=1t mesh=h100_16384 train.batch=4096 --devices 16384 --json
    python -m shardlib.autoplan model=tiny mesh=dp4 --devices 4 --top 3    # this machine's figures

``model=`` picks the model, ``mesh=`` the machine (its figures: device_tflops, memory_gib, links, host
figures; its axes are ignored: the search picks them), ``train.batch`` / ``train.seq`` /
``train.precision`` the global batch, sequence and precision. ``--memory-gib`` overrides the device
memory budget. The search and its pruning: ``shardlib/planner/autoplan.py``. A bad input exits 2 with
a message naming the fix.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardlib.autoplan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, required=True, help="how many devices (ranks)")
    ap.add_argument("--top", type=int, default=5, help="how many plans to print")
    ap.add_argument("--memory-gib", type=float, default=None, help="the device memory budget (default: the mesh's)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    import torch._dynamo  # noqa: F401  (meta tensors' decompositions import it once per process)

    from ..errors import ShardingError
    from ..frontend.config import ConfigError
    from ..planner.autoplan import autoplan

    pick = {k: v for k, v in (o.split("=", 1) for o in args.overrides if "=" in o and not o.startswith(("+", "~")))}
    rest = [o for o in args.overrides if o.split("=", 1)[0] not in ("model", "mesh", "train.batch", "train.seq",
                                                                     "train.precision")]
    try:
        got = autoplan(model=pick.get("model", "tiny"), mesh=pick.get("mesh", "dp4"), devices=args.devices,
                       batch=int(pick["train.batch"]) if "train.batch" in pick else None,
                       seq=int(pick["train.seq"]) if "train.seq" in pick else None,
                       precision=pick.get("train.precision", "fp32"), top=args.top, memory_gib=args.memory_gib,
                       overrides_extra=tuple(rest))
    except (ConfigError, ShardingError, ValueError) as e:
        print("autoplan: " + str(e).removeprefix("autoplan: "), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(got, indent=1))
        return 0
    print(f"searched {got['searched']:,} plans in {got['seconds']:.1f} s; the {len(got['candidates'])} fastest that fit:")
    for i, c in enumerate(got["candidates"], 1):
        p = c["parallel"]
        words = [f"ZeRO-{p['zero']}"] + (["SP"] if p["sequence_parallel"] else []) \
            + ([f"{p['schedule']} m={p['microbatches']}" + (f" v={p['virtual_stages']}" if p['virtual_stages'] > 1 else "")]
               if p["schedule"] else ([f"accumulation {p['microbatches']}"] if p["microbatches"] > 1 else [])) \
            + (["recompute"] if p["recompute"] else []) + (["optimizer on the host"] if p["offload"] else []) \
            + ([f"HSDP replica {p['replica']}"] if p["replica"] > 1 else [])
        b = c["step_ms_bounds"]
        print(f"\n{i}. mesh {c['mesh']}: {', '.join(words)}\n   step {c['step_ms']:.0f} ms ({b['full_overlap']:.0f}-"
              f"{b['no_overlap']:.0f}), {c['tokens_per_s']:,.0f} tokens/s, {c['memory_gib']:.1f} GiB per device"
              f"{'' if c['exact'] else ' (analytic)'}\n   python examples/train_gpt.py " + " ".join(c["overrides"]))
    return 0
