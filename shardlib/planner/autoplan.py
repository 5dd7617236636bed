"""``sl.autoplan``: from a model, a device count and a machine to the fastest plans that fit.

The search has two stages.

1. **Analytic, over the whole space.** Every mesh shape ``data x pipe x tensor`` (x ``replica`` for HSDP)
   of the device count, with every ZeRO stage, sequence parallel, pipeline schedule (with virtual stages),
   micro-batch count, recompute (none, selective, full) and optimizer offload, is priced in closed form (``Costs``): model states
   per rank as ``memory_per_rank`` counts them, activations from one block's saved bytes measured once on
   the meta device (Korthikanti et al.'s split: with sequence parallel all of it divides by the tensor
   degree, without it 10 of its 34 parts stay whole), the worst pipeline stage's micro-batches in flight
   per schedule, ZeRO-3's two gathered units; the step from ``transformer_flops`` at the machine's rate
   stretched by the schedule's bubble (``bubble_formula``), plus each axis's traffic over its link, plus
   offload copies and the host update (``planner/estimate.py``'s figures).
   **Pruning.** A shape whose most frugal configurations (ZeRO-2 and ZeRO-3, full recompute, sequence
   parallel, the optimizer offloaded, one sequence per micro-batch; ``frugal``) do not fit is dropped
   whole: memory only falls along each of those (monotone; ZeRO-3 against ZeRO-2 is not, its gathered
   units can outweigh what it shards, so both are tried). A shape whose lower bound — the compute with no bubble and no
   recompute, against its unavoidable traffic (the tensor axis's and the data axis's gradient bytes) —
   cannot beat the ``keep``-th best found so far is dropped unpriced.
2. **Exact, for the best** (``cli/autoplan.py``). The best are planned for real (``frontend/dryrun.py``:
   the model on the meta device, ``sl.plan`` on an ``AbstractMesh``) and re-ranked by the plan's own
   memory and estimate; a candidate the planner refuses is dropped with its reason. Each result carries
   the Hydra overrides that run it (``python examples/train_gpt.py <overrides>``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from ..errors import ShardingError
from .candidates import Candidate, Machine, ModelShape, Priced
from .simulate import bubble_formula

SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "gpipe")
RECOMPUTE = ("none", "selective", "full")


@functools.cache
def _peaks(schedule: str, p: int, m: int, v: int) -> tuple[float, float]:
    from .pipeline_report import rank_peak
    from .schedules import schedule_actions
    acts = schedule_actions(schedule, p, m, v)
    weight = {stage: 1.0 / v for stage in range(p * v)}
    return float(rank_peak(acts[0], weight)), float(rank_peak(acts[p - 1], weight))


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


class Costs:
    """The closed-form price of a candidate (module doc, stage 1)."""

    def __init__(self, model: ModelShape, machine: Machine, *, batch: int, precision: str, block_fn=None):
        """``block_fn(t, sp, recompute)``: one block's saved bytes per sequence on a tensor-``t`` shard
        under a recompute policy, as the planner measures them; without it, Korthikanti's formula."""
        self.m, self.mc, self.batch = model, machine, batch
        self.c = 2 if precision in ("bf16", "fp16") else 4
        self.mixed = self.c == 2
        self.precision, self.block_fn = precision, block_fn
        self._block: dict[tuple[int, bool, str], float] = {}
        from .estimate import recompute_passes, transformer_flops
        self._flops = {rc: transformer_flops(layers=model.layers, d_model=model.d_model, seq=model.seq,
                                             vocab=model.vocab, tokens=batch * model.seq, mlp_ratio=model.mlp_ratio,
                                             recompute=rc, block_matrix=model.block_matrix) for rc in RECOMPUTE}
        self._passes = {rc: recompute_passes(rc) for rc in RECOMPUTE}

    # ---- memory ------------------------------------------------------------------------------------
    def states(self, k: Candidate, stage_params: float, stage_experts: float = 0.0) -> dict[str, float]:
        """Model states per rank of a stage of ``stage_params`` parameters, ``stage_experts`` of them routed
        experts: those split over expert (and tensor) and, under ZeRO, sharded over data; the rest
        sharded over data x expert (``planner/experts.py``)."""
        c, g = self.c, self.c
        per = self.sharded(k, stage_params, stage_experts)
        params = c * per(3)
        grads = g * per(2)
        master = 4 if self.mixed or k.offload else 0
        optim = (master + 8) * per(1)
        if k.offload:                   # on the host: the masters, moments and sharded gradients
            host = optim + (grads if k.zero >= 2 else 0)
            optim, grads = 0.0, grads if k.zero < 2 else 0.0
        else:
            host = 0.0
        return {"params": params, "grads": grads, "optimizer": optim, "host": host}

    @staticmethod
    def sharded(k: Candidate, stage_params: float, stage_experts: float = 0.0):
        """``per(stage)``: a rank's elements of the stage's parameters with ZeRO at ``stage`` or above
        sharding them — the experts' over data (x context), the rest over data x expert (x context)."""
        shard = k.data // k.replica * k.context
        dense = (stage_params - stage_experts) / k.tensor
        experts = stage_experts / (k.tensor * k.expert)
        return lambda stage: (dense / (shard * k.expert) + experts / shard) if k.zero >= stage else dense + experts

    def inflight(self, k: Candidate) -> tuple[float, float]:
        """Micro-batches' activations the first and the last pipe rank hold at once (in units of the
        rank's own layers'): the planner's ``rank_peak`` over the schedule's actions. The peak is reached
        in the warm-up, so a long schedule is walked at ``2p`` micro-batches (cached)."""
        if k.pipe == 1:
            return 1.0, 1.0
        p, v = k.pipe, k.virtual
        m = k.microbatches if k.schedule == "gpipe" else min(k.microbatches, 2 * p * v)
        if k.schedule == "interleaved_1f1b":
            m = -(-m // p) * p
        return _peaks(k.schedule, p, m, v)

    def activations(self, k: Candidate) -> tuple[float, float]:
        """(bytes the worst stage holds for backward, of which the last stage's head and loss). A block
        saves what the planner measures on the shards (``block_fn``: ``pipeline_report.block_saved_bytes``),
        or by Korthikanti et al.'s formula ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` bytes in 16-bit, ``/t``
        whole with sequence parallel, the ``5·a·s/h`` scores dropped with selective recompute; fully
        recomputed, its input only."""
        m = self.m
        b = self.batch // (k.batch_ranks * k.microbatches)
        t = k.tensor
        sbh = m.seq * b * m.d_model / k.context         # (a context rank holds S/C of each sequence)
        scores = 5 * m.heads * m.seq / m.d_model
        if k.recompute == "full":
            per = sbh * self.c / (t if k.sp else 1)
        elif self.block_fn is not None:     # the planner's own measurement of a block, per sequence
            per = self.block(t, k.sp, k.recompute) * b / k.context
        else:
            scores = 0.0 if k.recompute == "selective" else scores
            per = sbh * (34 / t + scores / t if k.sp else 10 + 24 / t + scores / t) * self.c / 2
        layers = m.layers / k.pipe
        post = m.post_act * b / t / k.context   # vocab-parallel logits and loss (measured in the compute dtype)
        in_first, in_last = self.inflight(k)
        first = per * layers * in_first
        last = (per * layers + post) * in_last
        return max(first, last), post

    def block(self, t: int, sp: bool, recompute: str = "none") -> float:
        """One block's saved bytes for one sequence on a tensor-``t`` shard (``block_fn``, cached)."""
        if (t, sp, recompute) not in self._block:
            self._block[(t, sp, recompute)] = float(self.block_fn(t, sp, recompute))
        return self._block[(t, sp, recompute)]

    def memory(self, k: Candidate) -> dict[str, float]:
        m = self.m
        stage = m.layers / k.pipe * m.block_params
        worst = stage + max(m.pre_params, m.post_params) if k.pipe > 1 else m.params
        st = self.states(k, worst, m.layers / k.pipe * m.expert_params)
        block = (m.block_params - m.expert_params) / k.tensor + m.expert_params / (k.tensor * k.expert)
        gathered = 2 * self.c * block if k.zero >= 3 else 0.0
        acts, _ = self.activations(k)
        out = {"params": st["params"], "grads": st["grads"], "optimizer": st["optimizer"], "gathered": gathered,
               "activations": acts}
        out["total"] = sum(out.values())
        out["host"] = st["host"]
        return out

    # ---- time --------------------------------------------------------------------------------------
    def compute_s(self, k: Candidate, *, bubble: bool = True) -> float:
        n = k.devices           # (routing spread evenly: each expert rank multiplies its share of the rows)
        flops = self._flops[k.recompute] / n
        if k.pipe > 1:          # the busiest stage sets the pace: its layers and the head on the last
            m = self.m
            head = 3 * 2 * m.d_model * m.vocab * self.batch * m.seq / (k.batch_ranks * k.context * k.tensor)
            flops = (self._flops[k.recompute] - 3 * 2 * m.d_model * m.vocab * self.batch * m.seq) / n + head
        per_rank = flops / self.mc.rank_flops(n)
        per_rank += self.mc.layer_s * self.m.layers / k.pipe * k.microbatches * self._passes[k.recompute]
        if not bubble or k.pipe == 1:
            return per_rank
        return per_rank / (1 - bubble_formula(k.schedule, k.pipe, k.microbatches, k.virtual))

    def comm_s(self, k: Candidate) -> dict[str, float]:
        m, c = self.m, self.c
        tokens = self.batch * m.seq / (k.batch_ranks * k.context)      # this rank's tokens per step
        out: dict[str, float] = {}
        if k.tensor > 1:        # per layer: 2 all-reduces forward, 2 backward (or RS + AG each with SP: same bytes)
            t = k.tensor
            bw, lat = self.mc.link("tensor")
            nbytes = 4 * 2 * (t - 1) / t * tokens * m.d_model * c * m.layers / k.pipe
            out["tensor"] = nbytes / bw + 4 * 2 * (t - 1) * lat * m.layers / k.pipe * k.microbatches
        if k.expert > 1:        # per MoE layer and micro-batch: dispatch and combine, forward and backward,
            e = k.expert        # each moving the rank's routed rows (top_k per token) but its own expert's
            bw, lat = self.mc.link("expert")
            layers = m.layers / k.pipe
            nbytes = 4 * (e - 1) / e * tokens * m.top_k * m.d_model * c * layers
            # 7 all-to-alls a layer (counts, rows, weights; each way), one message to each other rank
            out["expert"] = nbytes / bw + 7 * (e - 1) * lat * layers * k.microbatches
        if k.context > 1:       # per layer and micro-batch: attention's keys and values (all-gather forward,
            c_ = k.context      # reduce-scatter backward), or Ulysses' four all-to-alls each way where cheaper
            bw, lat = self.mc.link("context")
            layers = m.layers / k.pipe
            seqs = self.batch / k.batch_ranks                          # this rank's sequences per step
            gather = 2 * 2 * (c_ - 1) / c_ * seqs * m.seq * m.d_model / k.tensor * c
            ulysses = 2 * 4 * (c_ - 1) / c_ * seqs * m.seq / c_ * m.d_model / k.tensor * c
            fits = (m.heads // k.tensor) % c_ == 0
            nbytes, calls = min([(gather, 4 * (c_ - 1)), *([(ulysses, 8 * (c_ - 1))] if fits else [])])
            out["context"] = (nbytes / bw + calls * lat * k.microbatches) * layers
        if k.batch_ranks * k.context > 1:
            shard, rep = k.data // k.replica * k.context, k.replica
            bw, lat = self.mc.link("data" if k.data > 1 else "expert" if k.expert > 1 else "context")
            stage = m.layers / k.pipe
            experts = stage * m.expert_params / (k.tensor * k.expert)
            p = (stage * (m.block_params - m.expert_params) + max(m.pre_params, m.post_params)) / k.tensor
            reps = k.microbatches if k.zero >= 3 and k.pipe == 1 else 1
            # the gradients of what is not an expert over data x expert, an expert's over data alone
            ring = sum((n - 1) / n * q * c for n, q in ((shard * k.expert, p), (shard, experts)) if n > 1)
            # HSDP: each replica's shard of it all-reduced over the replicas — what is not an expert sharded over
            # data x expert, an expert's over data (whole without ZeRO)
            held = (p / (shard * k.expert) + experts / shard) if k.zero else p + experts
            shard = shard * k.expert if p else shard
            if ring:
                nbytes = ring * (2 if k.zero < 3 else 3 * reps)
                rs, ag = (self.mc.hop_s.get(op, lat) for op in ("reduce_scatter", "all_gather"))
                if k.zero >= 3:          # per unit (a block, and the root): gathered twice, reduce-scattered once
                    calls = (m.layers / k.pipe + 1) * reps * (shard - 1) * (2 * ag + rs)
                else:                    # per bucket (25 MB): one all-reduce, or a reduce-scatter and an all-gather
                    buckets = max(1, math.ceil(p * c / (25 * 2**20)))
                    calls = buckets * (shard - 1) * (2 * lat if k.zero == 0 else rs + ag)
                out["data"] = nbytes / bw + calls
            if rep > 1:
                bwr, latr = self.mc.link("replica")
                out["replica"] = 2 * (rep - 1) / rep * held * c / bwr + 2 * (rep - 1) * latr
        if k.pipe > 1:
            bw, lat = self.mc.link("pipe")
            b = self.batch // (k.batch_ranks * k.microbatches)
            msg = b * m.seq * m.d_model * c / (k.tensor if k.sp else 1)
            sends = 2 * k.microbatches * k.virtual
            out["pipe"] = sends * (msg / bw + lat)
        return out

    def host_s(self, k: Candidate) -> tuple[float, float]:
        """(seconds of device-host copies, of the host update) with the optimizer offloaded."""
        if not k.offload:
            return 0.0, 0.0
        n_opt = self.sharded(k, self.m.params / k.pipe, self.m.layers * self.m.expert_params / k.pipe)(1)
        copies = (self.c + self.c) * n_opt / self.mc.host if self.mc.host else 0.0
        update = 28 * n_opt / self.mc.host_update if self.mc.host_update else 0.0
        return copies, update

    def price(self, k: Candidate) -> Priced:
        mem = self.memory(k)
        compute = self.compute_s(k)
        comm = sum(self.comm_s(k).values())
        copies, update = self.host_s(k)
        no = compute + comm + copies + update
        full = max(compute, comm, copies) + update
        step = no - self.mc.overlap * (no - full)
        fits = mem["total"] <= self.mc.memory and (self.mc.host_memory is None or mem["host"] <= self.mc.host_memory)
        return Priced(k, mem, step, no, full, fits)

    def lower_bound(self, data: int, pipe: int, tensor: int, expert: int = 1, context: int = 1) -> float:
        """No configuration of this shape is faster: the compute with no bubble and no recompute, against
        the tensor axis's traffic, the expert axis's all-to-alls and the data axis's gradient all-reduce
        (ZeRO 0-2's bytes, the least)."""
        k = Candidate(data, pipe, tensor, zero=0, schedule="1f1b" if pipe > 1 else None, microbatches=1,
                      recompute="none", expert=expert, context=context)
        compute = self.compute_s(k, bubble=False)
        comm = self.comm_s(k)
        # the gradients' traffic at its least: ZeRO 0-2's bytes, over the cheapest replica split (HSDP)
        grads = min(sum(v for a, v in self.comm_s(replace(k, replica=r, zero=1 if r > 1 else 0)).items()
                        if a in ("data", "replica")) for r in divisors(data) if (r < data or r == 1)
                    and (r == 1 or context == 1))
        unavoidable = comm.get("tensor", 0.0) + comm.get("expert", 0.0) + comm.get("context", 0.0) + grads
        return max(compute, unavoidable) if self.mc.overlap >= 1 else compute + (1 - self.mc.overlap) * unavoidable


# ---- the space -------------------------------------------------------------------------------------

def shapes(n: int, model: ModelShape, *, max_tensor: int = 8) -> Iterator[tuple[int, int, int, int, int]]:
    """``(data, pipe, tensor, expert, context)`` with their product ``n``: tensor divides the heads (and d, the
    vocabulary's rows), pipe the layers, expert the routed experts (a dense model: 1), context the sequence
    into ``2·context`` chunks."""
    for e in divisors(n):
        if e > 1 and (not model.experts or model.experts % e):
            continue
        for t in divisors(n // e):
            if t > max_tensor or model.heads % t or model.d_model % t or model.vocab % t:
                continue
            for p in divisors(n // (e * t)):
                if model.layers % p:
                    continue
                for c in divisors(n // (e * t * p)):
                    if model.seq % (2 * c) and c > 1:
                        continue
                    yield n // (e * t * p * c), p, t, e, c


def configs(data: int, pipe: int, tensor: int, model: ModelShape, batch: int, *, hsdp: bool = True,
            offload: bool = True, expert: int = 1, context: int = 1) -> Iterator[Candidate]:
    """Every configuration of one shape (experts split over tensor too, sequence parallelism beside them as
    Megatron runs it; HSDP's replicas of the data axis beside an expert axis too, not beside a context axis)."""
    if batch % (data * expert):
        return
    per_rank = batch // (data * expert)
    replicas = [r for r in divisors(data) if 1 < r < data] if hsdp and context == 1 else []
    schedules = [None] if pipe == 1 else list(SCHEDULES)
    sps = (False, True) if tensor > 1 else (False,)
    for zero in ((0, 1, 2, 3) if data * expert * context > 1 else (0,)):   # one rank a stage: nothing to shard
        for rep in [1] + (replicas if zero >= 1 else []):
            for sp in sps:
                for sched in schedules:
                    virtuals = (2,) if sched == "interleaved_1f1b" else (1,)
                    for v in virtuals:
                        if model.layers % (pipe * v):
                            continue
                        for m in divisors(per_rank):
                            if sched == "interleaved_1f1b" and m % pipe:
                                continue
                            for rc in (RECOMPUTE[:2] if sched == "zb_h1" else RECOMPUTE):   # (W cannot split from a full recompute)
                                for off in ((False, True) if offload else (False,)):
                                    yield Candidate(data, pipe, tensor, rep, zero, sp, sched, v, m, rc, off,
                                                    expert, context)


def frugal(data: int, pipe: int, tensor: int, batch: int, expert: int = 1, context: int = 1) -> list[Candidate]:
    """The shape's least memory is one of these: full recompute, sequence parallel, the optimizer on the host, one sequence per micro-batch, and ZeRO-2 or ZeRO-3 (ZeRO-3 shards the
    parameters but holds two gathered units: on a small model or few data ranks ZeRO-2 holds less)."""
    sched = "1f1b" if pipe > 1 else None
    zeros = (2, 3) if data * expert * context > 1 else (0,)
    ranks = data * expert
    return [Candidate(data, pipe, tensor, 1, z, tensor > 1, sched, 1, max(1, batch // ranks), "full",
                      True, expert, context) for z in zeros]


def search(costs: Costs, n: int, *, keep: int = 8, prune: bool = True, hsdp: bool = True,
           offload: bool = True) -> tuple[list[Priced], int]:
    """The ``keep`` fastest candidates that fit (analytic), and how many were priced."""
    best: list[Priced] = []
    priced = 0
    shape_list = list(shapes(n, costs.m))
    if prune:                          # the most promising shapes first: their results prune the others
        shape_list.sort(key=lambda s: costs.lower_bound(*s))
    for d, p, t, e, cx in shape_list:
        if costs.batch % (d * e):
            continue
        if prune:
            if not any(costs.price(k).fits for k in frugal(d, p, t, costs.batch, e, cx)):
                continue
            if len(best) >= keep and costs.lower_bound(d, p, t, e, cx) >= best[-1].step_s:
                continue
        for k in configs(d, p, t, costs.m, costs.batch, hsdp=hsdp, offload=offload, expert=e, context=cx):
            got = costs.price(k)
            priced += 1
            if not got.fits:
                continue
            if len(best) < keep or got.step_s < best[-1].step_s:
                best.append(got)
                best.sort(key=lambda x: (x.step_s, tiebreak(x.cand)))
                del best[keep:]
    return best, priced



def plan_search(costs: Costs, n: int, *, keep: int = 8, prune: bool = True, model: str = "the model"
                ) -> tuple[list[Priced], int]:
    """``search`` of ``costs``'s model on ``n`` devices, refusing by name what cannot be searched: no mesh of
    ``n`` devices suits the model (its heads and layers), the global batch splits over no data degree, or
    nothing fits the machine's memory. Pure: the planner's half of ``sl.autoplan`` (the Hydra half, which
    composes the config and names overrides, is ``cli/autoplan.py``)."""
    shape, batch, machine = costs.m, costs.batch, costs.mc
    every = list(shapes(n, shape))
    if not every:
        raise ShardingError(f"autoplan: no mesh of {n} devices suits model={model}: the tensor degree must "
                            f"divide its {shape.heads} heads (at most 8, one node), the pipe degree its {shape.layers} "
                            f"layers — expected a device count such as {near_counts(n, shape)}.", api="autoplan")
    if not [s for s in every if batch % (s[0] * s[3]) == 0]:
        datas = sorted({s[0] * s[3] for s in every})
        raise ShardingError(f"autoplan: the global batch {batch} does not split over any data degree "
                            f"these {n} devices allow ({', '.join(map(str, datas))}) — expected a batch "
                            f"divisible by one of them, e.g. train.batch={lcm_batch(batch, datas)}.",
                            api="autoplan")
    best, priced = search(costs, n, keep=keep, prune=prune)
    if not best:
        need = smallest_memory(costs, n)
        raise ShardingError(f"autoplan: nothing fits {machine.memory / 2**30:.0f} GiB per device — the most frugal "
                            f"plan needs {need[0] / 2**30:.1f} GiB ({candidate_words(need[1])}). Use more devices, a "
                            f"machine with at least {math.ceil(need[0] / 2**30)} GiB, or a smaller global batch.",
                            api="autoplan")
    return best, priced


def tiebreak(k: Candidate) -> tuple:
    """Equal predicted steps: the simpler plan first (less sharding, no offload, no recompute)."""
    return (k.offload, RECOMPUTE.index(k.recompute), k.zero, k.replica, k.sp, k.pipe, k.expert, k.context,
            k.virtual, k.microbatches)


# ---- the overrides that run a candidate --------------------------------------------------------------

def overrides(k: Candidate, *, model: str, mesh: str, batch: int, precision: str, moe: bool = False) -> list[str]:
    """The Hydra overrides that run ``k`` (``moe``: the model has routed experts, split over tensor with
    the rest of the block where the tensor axis is: Megatron's tensor-parallel experts)."""
    axes = ",".join(f"{a}:{s}" for a, s in k.axes.items())
    rules = {}
    if k.pipe > 1:
        rules["layers"] = "pipe"
    if k.tensor > 1:
        rules.update(heads="tensor", mlp="tensor", vocab="tensor", **({"expert_mlp": "tensor"} if moe else {}))
    if k.expert > 1:
        rules["experts"] = "expert"
    if k.context > 1:
        rules["seq"] = "context"
    out = [f"model={model}", f"mesh={mesh}", f"mesh.axes={{{axes}}}", "parallel=zero3",
           f"parallel.zero={k.zero}", f"parallel.rules={{{','.join(f'{a}:{b}' for a, b in rules.items())}}}",
           f"train.batch={batch}", f"train.precision={precision}"]
    if k.sp:
        out.append("parallel.sequence_parallel=true")
    if k.replica > 1:
        out.append("parallel.replica_axis=replica")
    if k.pipe > 1:
        out += [f"parallel.schedule={k.schedule}", f"parallel.microbatches={k.microbatches}"]
        if k.virtual > 1:
            out.append(f"parallel.virtual_stages={k.virtual}")
    elif k.microbatches > 1:
        out.append(f"train.grad_accum={k.microbatches}")
    if k.recompute != "none":
        out.append(f"train.recompute={k.recompute}")
    if k.offload:
        out.append("+parallel.offload.optimizer=host")
    return out


def describe(k: Candidate) -> dict[str, Any]:
    return {"expert": k.expert, "context": k.context, "zero": k.zero, "sequence_parallel": k.sp, "schedule": k.schedule, "virtual_stages": k.virtual,
            "microbatches": k.microbatches, "replica": k.replica, "recompute": k.recompute,
            "offload": {"optimizer": "host"} if k.offload else {}}


def smallest_memory(costs: Costs, n: int) -> tuple[float, Candidate]:
    best = None
    for d, p, t, e, cx in shapes(n, costs.m):
        if costs.batch % (d * e):
            continue
        for k in frugal(d, p, t, costs.batch, e, cx):
            mem = costs.memory(k)["total"]
            if best is None or mem < best[0]:
                best = (mem, k)
    return best


def candidate_words(k: Candidate) -> str:
    return (f"mesh {k.axes}, ZeRO-{k.zero}, {k.recompute} recompute, {'sequence parallel, ' if k.sp else ''}"
            f"{k.microbatches} micro-batches, the optimizer on the host")


def near_counts(n: int, shape: ModelShape) -> str:
    good = [k for k in range(max(1, n - 8), n + 9) if list(shapes(k, shape))]
    return ", ".join(map(str, good[:4])) or "a power of two"


def lcm_batch(batch: int, datas: list[int]) -> int:
    return min(math.lcm(batch, d) for d in datas)
