"""Expert parallel: a transformers Mixtral and Qwen3-MoE, unchanged, on an ``expert`` axis of 2 and 4 ranks —
shardlib vs the same model with replicated experts under FSDP2, and vs a hand-written ``all_to_all_single``
dispatch as torchtitan writes it, side by side in the same processes.

    PYTHONPATH=. python3 benchmarks/bench_moe.py                          # 4 configs, prints Markdown tables
    PYTHONPATH=. python3 benchmarks/bench_moe.py --configs mixtral-e2 --steps 6 --json rows.json

Models (``MODELS``): 4 decoder layers, hidden 128, 8 heads (4 KV), 8 experts of width 128, top 2 (Mixtral:
renormalized softmax top-k; Qwen3-MoE: ``norm_topk_prob=True``), vocab 512, no router aux loss
(``output_router_logits=False``), the eager experts (``experts_implementation="eager"``: a loop over the
experts the rank holds). Global batch 16 sequences of 64 tokens, fp32 AdamW (lr 1e-3), the same everywhere.

Sides, each built on every rank from the same seed:

* ``shardlib``  ``sl.plan(model, sl.Mesh({"expert": n}), rules={"experts": "expert"})`` (ZeRO-0: each rank holds
  ``E/n`` experts; the rest replicated, its gradients all-reduced over ``expert`` in buckets during backward),
  ``engine.step(global_batch)``: the model's own loss, no code.
* ``a2a``       torchtitan's expert parallel written by hand: each rank keeps its ``E/n`` experts' slices of the
  fused 3-D weights, the experts module's forward wrapped with a dispatch — the tokens' (token, expert) pairs
  sorted by expert, the per-expert counts exchanged by ``all_to_all_single``, the rows and routing weights
  moved by ``all_to_all_single_autograd`` (``torch.distributed._functional_collectives``), the model's own
  experts forward on the received rows, the outputs moved back and added into their tokens — and
  ``DistributedDataParallel`` over the rest (the experts ignored; their gradients divided by ``n`` by hand, as
  DDP divides the rest).
* ``fsdp2``     no expert axis: every expert on every rank, ``fully_shard`` per decoder layer and on the root over
  the ``n`` ranks as data parallel (FSDP2's default: resharded after forward).

Each rank feeds its ``16/n`` rows of the global batch (shardlib splits the global batch itself). Both torch
sides divide by ``n`` as the mean over ranks of the rank's mean loss, which is the global mean (equal rows).

**Reported** per config: the median step time of each side (``harness.alternate``: warm-up, then stepped in
turn after a barrier; a step is the latest end minus the earliest start over the ranks) and the ratios
shardlib / a2a and shardlib / fsdp2; the largest relative loss gap to one process over all steps; the
all-to-all bytes rank 0 sent in one step — shardlib's counted (``sl.count_collectives``), the formula on the
rows it routed that step (``engine.routed_rows``: rows sent to and received from other ranks per layer,
``planner/traffic.routing_bytes``) and the plan's figure for uniform routing — and the expert parameters a rank
holds against the whole model's (``1/n``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from harness import common_options, gathered_alternate, launch, max_rel, step_times, train_losses, write_rows

import shardlib as sl
from shardlib.planner.traffic import routing_bytes

LAYERS, HIDDEN, HEADS, KV, EXPERTS, WIDTH, TOP_K, VOCAB, SEQ, BATCH = 4, 128, 8, 4, 8, 128, 2, 512, 64, 16
CONFIGS = {f"{m}-e{n}": (m, n) for m in ("mixtral", "qwen3_moe") for n in (2, 4)}


def build(family: str) -> torch.nn.Module:
    """The tiny model of ``family``, seed 0, fp32."""
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV, max_position_embeddings=SEQ, num_experts_per_tok=TOP_K,
                  output_router_logits=False, tie_word_embeddings=False, use_cache=False,
                  attn_implementation="sdpa", experts_implementation="eager")
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM
        cfg, cls = MixtralConfig(intermediate_size=WIDTH, num_local_experts=EXPERTS, router_jitter_noise=0.0,
                                 **common), MixtralForCausalLM
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        cfg, cls = Qwen3MoeConfig(moe_intermediate_size=WIDTH, num_experts=EXPERTS, norm_topk_prob=True,
                                  head_dim=HIDDEN // HEADS, decoder_sparse_step=1, **common), Qwen3MoeForCausalLM
    torch.manual_seed(0)
    return cls(cfg)


def batch_at(step: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _opt(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _rows(batch: dict, n: int) -> dict:
    r = dist.get_rank()
    return {k: v[r * BATCH // n:(r + 1) * BATCH // n] for k, v in batch.items()}


def _experts_modules(model) -> list[tuple[str, torch.nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter)]


class Side:
    """One side on this rank: ``step(global_batch) -> loss`` (the global batch's mean, on every rank)."""

    def __init__(self, step, engine=None, plan=None, expert_bytes=None):
        self.step, self.engine, self.plan, self.expert_bytes = step, engine, plan, expert_bytes


def run_shardlib(family: str, n: int) -> Side:
    model = build(family)
    mesh = sl.Mesh({"expert": n})
    plan = sl.plan(model, mesh, rules={"experts": "expert"}, batch=batch_at(0))
    engine = sl.parallelize(model, plan, optimizer=_opt)
    held = sum(p.numel() * p.element_size() for name, m in _experts_modules(model) for p in m.parameters())
    return Side(lambda b: float(engine.step(b)), engine, plan, held)


def _dispatched(forward, n: int, per: int):
    """torchtitan's dispatch around the model's own experts forward (``forward(rows, local ids, weights)``)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    def routed(hidden, top_k_index, top_k_weights):
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = torch.arange(hidden.shape[0]).repeat_interleave(k)[order]
        counts = torch.bincount(flat, minlength=n * per)                     # rows per expert, this rank's tokens
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts)                                  # per source rank: rows per local expert
        got = got.view(n, per)
        ins, outs = counts.view(n, per).sum(1).tolist(), got.sum(1).tolist()
        rows = all_to_all_single_autograd(hidden[token], outs, ins, dist.group.WORLD)
        weights = all_to_all_single_autograd(top_k_weights.reshape(-1)[order], outs, ins, dist.group.WORLD)
        local = torch.cat([torch.arange(per).repeat_interleave(got[s]) for s in range(n)])
        y = forward(rows, local[:, None], weights[:, None])
        back = all_to_all_single_autograd(y, ins, outs, dist.group.WORLD)
        return torch.zeros_like(hidden).index_add(0, token, back)
    return routed


def run_a2a(family: str, n: int) -> Side:
    from torch.nn.parallel import DistributedDataParallel
    model = build(family)
    me, per = dist.get_rank(), EXPERTS // n
    ignored = []
    for name, m in _experts_modules(model):
        for pname, p in list(m.named_parameters(recurse=False)):
            setattr(m, pname, torch.nn.Parameter(p.detach()[me * per:(me + 1) * per].clone()))
            ignored.append(f"{name}.{pname}")
        if hasattr(m, "num_experts"):
            m.num_experts = per
        m.forward = _dispatched(m.forward, n, per)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = DistributedDataParallel(model)
    experts = [p for name, m in _experts_modules(model) for p in m.parameters()]
    # the experts' gradients: the sum over the ranks' losses, divided as DDP's mean divides the rest
    return Side(_torch_step(ddp, _opt(model.parameters()), n, divide=experts))


def _torch_step(model, opt, n: int, divide=()):
    """A torch side's step on this rank's rows: its loss, backward, ``divide``'s gradients by ``n``, AdamW; the
    global batch's mean loss."""
    def step(batch):
        loss = model(**_rows(batch, n)).loss
        loss.backward()
        for p in divide:
            p.grad.div_(n)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out = loss.detach().clone()
        dist.all_reduce(out)
        return float(out) / n
    return step


def run_fsdp2(family: str, n: int) -> Side:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = build(family)
    mesh = init_device_mesh("cpu", (n,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Side(_torch_step(model, _opt(model.parameters()), n))


SIDES = {"shardlib": run_shardlib, "a2a": run_a2a, "fsdp2": run_fsdp2}


def _counted(side: str, built: Side, batch) -> tuple[float, dict | None]:
    """The last warm-up step with shardlib's all-to-all bytes counted, beside the formula on its routed rows."""
    if side != "shardlib":
        return built.step(batch), None
    with sl.count_collectives() as c:
        loss = built.step(batch)
    counted = sum(r.bytes for r in c.records if r.op == "all_to_all")
    plan, engine = built.plan, built.engine
    layers = {layer.name: layer for layer in plan.expert_layers}
    routed = engine.routed_rows
    formula = sum(routing_bytes(layers[name].experts, layers[name].hidden, plan.expert_size, 4, sent, received)
                  for name, (sent, received) in routed.items())
    uniform = sum(e.total for e in plan.comm_per_step(dist.get_rank()) if e.op == "all_to_all")
    whole = sum(p.numel() * 4 for p in build("mixtral" if "Mixtral" in type(engine.model).__name__ else "qwen3_moe")
                .parameters() if p.dim() == 3)
    return loss, {"counted": counted, "formula": formula, "uniform": uniform, "expert_bytes": built.expert_bytes,
                  "whole_expert_bytes": whole, "routed": routed}


def rank_main(label: str, sides: list[str], warmup: int, steps: int) -> list[dict]:
    torch.set_num_threads(1)
    family, n = CONFIGS[label]
    built = {s: SIDES[s](family, n) for s in sides}
    batches = [batch_at(i) for i in range(warmup + steps)]
    return gathered_alternate(built, batches, warmup, count=_counted)


def run_config(label: str, sides: list[str], warmup: int, steps: int, timeout: tuple[float, float]) -> dict:
    family, n = CONFIGS[label]
    row = {"config": label, "family": family, "experts": n, "results": {}, "failed": {}, "load": [os.getloadavg()[0]]}
    per, err = launch(rank_main, n, label, sides, warmup, steps, timeout=timeout)
    if per is None:
        row["failed"] = {s: err for s in sides}
        return row
    per = per[0]                 # every rank's record, gathered (the same list on every rank)
    ref = train_losses(build(family), _opt, [batch_at(i) for i in range(warmup + steps)],
                       loss_of=lambda m, b: m(**b).loss)
    for side in sides:
        recs = [r[side] for r in per]
        times = step_times(recs, steps)
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        row["results"][side] = {"ms": 1e3 * statistics.median(times), "p25": 1e3 * q[0], "p75": 1e3 * q[2],
                                "dloss": max_rel(recs[0]["losses"], ref), "bytes": recs[0]["bytes"]}
    res = row["results"]
    for other in ("a2a", "fsdp2"):
        if "shardlib" in res and other in res:
            row[f"ratio_{other}"] = res["shardlib"]["ms"] / res[other]["ms"]
    row["load"].append(os.getloadavg()[0])
    return row


def table(rows: list[dict]) -> str:
    fb = sl.format_bytes
    out = ["| config | shardlib ms | a2a ms | fsdp2 ms | shardlib / a2a | shardlib / fsdp2 | Δloss vs 1 process "
           "(sl / a2a / fsdp2) | all-to-all bytes rank 0, one step: counted / formula on routed rows / uniform "
           "plan | expert params per rank / whole | load |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        res = row["results"]
        ms = [f"{res[s]['ms']:.0f} ({res[s]['p25']:.0f}-{res[s]['p75']:.0f})" if s in res
              else f"FAILED ({row['failed'].get(s, '–')})" for s in SIDES]
        ratios = [f"**{row[k]:.2f}**" if k in row else "–" for k in ("ratio_a2a", "ratio_fsdp2")]
        dloss = " / ".join(f"{res[s]['dloss']:.1e}" if s in res else "–" for s in SIDES)
        b = res.get("shardlib", {}).get("bytes")
        a2a = (f"{fb(b['counted'])} / {fb(b['formula'])}{' (=)' if b['counted'] == b['formula'] else ' (≠)'} / "
               f"{fb(b['uniform'])}") if b else "–"
        mem = (f"{fb(b['expert_bytes'])} / {fb(b['whole_expert_bytes'])} = 1/"
               f"{b['whole_expert_bytes'] / b['expert_bytes']:.0f}") if b else "–"
        out.append(f"| {row['config']} | {' | '.join(ms)} | {' | '.join(ratios)} | {dloss} | {a2a} | {mem} | "
                   f"{'–'.join(f'{x:.1f}' for x in row['load'])} |")
    return "\n".join(out)


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--sides", nargs="*", default=list(SIDES), choices=list(SIDES))
    common_options(ap, steps=8, rss=False)
    args = ap.parse_args()
    rows = []
    for label in args.configs:
        t0 = time.time()
        row = run_config(label, args.sides, args.warmup, args.steps, (args.timeout, args.world_timeout))
        rows.append(row)
        for side, err in row["failed"].items():
            print(f"{label}: {side}: {err}", file=sys.stderr, flush=True)
        print(f"{label}: done in {time.time() - t0:.0f} s, load {row['load']}", file=sys.stderr, flush=True)
    print(table(rows))
    write_rows(rows, args.json)


if __name__ == "__main__":
    main()
