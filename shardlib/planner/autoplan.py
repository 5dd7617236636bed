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
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ShardingError
from .simulate import bubble_formula

SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "gpipe")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    data: int
    pipe: int
    tensor: int
    replica: int = 1              # HSDP: data = replica x shard, the states sharded over the shard part
    zero: int = 0
    sp: bool = False
    schedule: str | None = None
    virtual: int = 1
    microbatches: int = 1         # per data rank: pipeline micro-batches, or gradient accumulation steps
    recompute: str = "none"       # none | selective (attention's core) | full (every block)
    offload: bool = False         # the optimizer's states on the host

    @property
    def axes(self) -> dict[str, int]:
        out = {"replica": self.replica} if self.replica > 1 else {}
        out["data"] = self.data // self.replica
        if self.pipe > 1:
            out["pipe"] = self.pipe
        if self.tensor > 1:
            out["tensor"] = self.tensor
        return out


@dataclass
class Priced:
    cand: Candidate
    memory: dict[str, float]      # bytes per rank (the worst stage): params, grads, optimizer, gathered, activations, total
    step_s: float                 # the predicted step (see Costs.step)
    no_overlap_s: float
    full_overlap_s: float
    fits: bool
    exact: bool = False           # planned by sl.plan (numbers are the plan's own)
    notes: list[str] = field(default_factory=list)


@functools.cache
def _peaks(schedule: str, p: int, m: int, v: int) -> tuple[float, float]:
    from .pipeline_report import rank_peak
    from .schedules import schedule_actions
    acts = schedule_actions(schedule, p, m, v)
    weight = {stage: 1.0 / v for stage in range(p * v)}
    return float(rank_peak(acts[0], weight)), float(rank_peak(acts[p - 1], weight))


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class ModelShape:
    """What the analytic costs need of a GPT: its sizes, parameters per block and outside them, and what
    the embeddings, head and loss save for backward per sequence (measured on the meta device in the
    compute dtype). A block's saved bytes come from the planner's own measurement (``Costs.block_fn``)."""

    layers: int
    d_model: int
    heads: int
    vocab: int
    seq: int
    mlp_ratio: int
    block_params: int
    pre_params: int               # embeddings (the first stage)
    post_params: int              # final norm and head (the last stage)
    post_act: int                 # embeddings, head and loss: bytes per sequence, in the compute dtype
    block_matrix: int | None = None   # one block's matrix elements where not GPT's (4 + 2r)·d² (a transformers model)

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.pre_params + self.post_params


@dataclass(frozen=True)
class Machine:
    """A machine's figures (a ``mesh=`` preset's, its axes ignored): per device sustained FLOP/s and
    memory, per axis link ``(bytes/s, seconds per hop)`` (``default`` for the others), host copies,
    disk and host update rates (bytes/s, or None), and the fraction of communication that overlaps
    compute (0: none, 1: all)."""

    name: str
    flops: float
    memory: float
    links: dict[str, tuple[float, float]]
    host: float | None = None
    host_update: float | None = None
    host_memory: float | None = None
    overlap: float = 0.0
    shared_cores: int | None = None   # CPU machines: every rank on one host of this many cores
    layer_s: float = 0.0              # a fixed cost per layer and micro-batch, forward and backward (calibrated)
    hop_s: dict[str, float] = field(default_factory=dict)   # per-op seconds per ring hop, where calibrated

    def rank_flops(self, n: int) -> float:
        """A rank's sustained rate when ``n`` ranks run: ranks beyond the cores share them."""
        return self.flops * (1.0 if self.shared_cores is None else min(1.0, self.shared_cores / n))

    @staticmethod
    def of_mesh(mesh, devices: int | None = None) -> Machine:
        """``mesh``'s figures, as ``devices`` ranks see them where the mesh is calibrated for that many."""
        if devices is not None:
            mesh = mesh.at(devices)
        missing = [k for k in ("device_tflops", "memory_gib") if getattr(mesh, k) is None]
        if missing or not mesh.links:
            raise ShardingError(
                f"autoplan: mesh={mesh.name} gives no {', '.join(missing + ([] if mesh.links else ['links']))} — "
                "expected the machine's figures (device_tflops, memory_gib, links: the per-axis bandwidth and "
                "latency). Add them to meshes/<name>.yaml, or measure them with python -m shardlib.calibrate.",
                api="autoplan")
        links = {a: (lk.bandwidth, lk.latency) for a, lk in mesh.links}
        gb = lambda x: None if x is None else x * 1e9        # noqa: E731
        return Machine(mesh.name, mesh.device_tflops * 1e12, mesh.memory_gib * 2**30, links, gb(mesh.host_gbps),
                       gb(mesh.host_update_gbps), None if mesh.host_memory_gib is None else mesh.host_memory_gib * 2**30,
                       mesh.overlap or 0.0, mesh.shared_cores, (mesh.layer_us or 0.0) * 1e-6,
                       dict(mesh.hop_s))

    def link(self, axis: str) -> tuple[float, float]:
        got = self.links.get(axis, self.links.get("default"))
        if got is None:
            raise ShardingError(f"autoplan: no link figures for axis {axis!r} on mesh={self.name} — expected the "
                                "axis or 'default' under links.", api="autoplan")
        return got


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
    def states(self, k: Candidate, stage_params: float) -> dict[str, float]:
        shard = k.data // k.replica
        c, g = self.c, self.c
        p = stage_params / k.tensor
        params = c * p / (shard if k.zero >= 3 else 1)
        grads = g * p / (shard if k.zero >= 2 else 1)
        master = 4 if self.mixed or k.offload else 0
        optim = (master + 8) * p / (shard if k.zero >= 1 else 1)
        if k.offload:                   # on the host: the masters, moments and sharded gradients
            host = optim + (grads if k.zero >= 2 else 0)
            optim, grads = 0.0, grads if k.zero < 2 else 0.0
        else:
            host = 0.0
        return {"params": params, "grads": grads, "optimizer": optim, "host": host}

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
        b = self.batch // (k.data * k.microbatches)
        t = k.tensor
        sbh = m.seq * b * m.d_model
        scores = 5 * m.heads * m.seq / m.d_model
        if k.recompute == "full":
            per = sbh * self.c / (t if k.sp else 1)
        elif self.block_fn is not None:     # the planner's own measurement of a block, per sequence
            per = self.block(t, k.sp, k.recompute) * b
        else:
            scores = 0.0 if k.recompute == "selective" else scores
            per = sbh * (34 / t + scores / t if k.sp else 10 + 24 / t + scores / t) * self.c / 2
        layers = m.layers / k.pipe
        post = m.post_act * b / t          # vocab-parallel logits and loss (measured in the compute dtype)
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
        stage = self.m.layers / k.pipe * self.m.block_params
        worst = stage + max(self.m.pre_params, self.m.post_params) if k.pipe > 1 else self.m.params
        st = self.states(k, worst)
        gathered = 2 * self.c * self.m.block_params / k.tensor if k.zero >= 3 else 0.0
        acts, _ = self.activations(k)
        out = {"params": st["params"], "grads": st["grads"], "optimizer": st["optimizer"], "gathered": gathered,
               "activations": acts}
        out["total"] = sum(out.values())
        out["host"] = st["host"]
        return out

    # ---- time --------------------------------------------------------------------------------------
    def compute_s(self, k: Candidate, *, bubble: bool = True) -> float:
        n = k.data * k.pipe * k.tensor
        flops = self._flops[k.recompute] / n
        if k.pipe > 1:          # the busiest stage sets the pace: its layers and the head on the last
            m = self.m
            head = 3 * 2 * m.d_model * m.vocab * self.batch * m.seq / (k.data * k.tensor)
            flops = (self._flops[k.recompute] - 3 * 2 * m.d_model * m.vocab * self.batch * m.seq) / n + head
        per_rank = flops / self.mc.rank_flops(n)
        per_rank += self.mc.layer_s * self.m.layers / k.pipe * k.microbatches * self._passes[k.recompute]
        if not bubble or k.pipe == 1:
            return per_rank
        return per_rank / (1 - bubble_formula(k.schedule, k.pipe, k.microbatches, k.virtual))

    def comm_s(self, k: Candidate) -> dict[str, float]:
        m, c = self.m, self.c
        tokens = self.batch * m.seq / k.data                           # this rank's tokens per step
        out: dict[str, float] = {}
        if k.tensor > 1:        # per layer: 2 all-reduces forward, 2 backward (or RS + AG each with SP: same bytes)
            t = k.tensor
            bw, lat = self.mc.link("tensor")
            nbytes = 4 * 2 * (t - 1) / t * tokens * m.d_model * c * m.layers / k.pipe
            out["tensor"] = nbytes / bw + 4 * 2 * (t - 1) * lat * m.layers / k.pipe * k.microbatches
        if k.data > 1:
            shard, rep = k.data // k.replica, k.replica
            bw, lat = self.mc.link("data")
            p = (m.layers / k.pipe * m.block_params + max(m.pre_params, m.post_params)) / k.tensor
            reps = k.microbatches if k.zero >= 3 and k.pipe == 1 else 1
            if shard > 1:
                ring = (shard - 1) / shard * p * c
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
                out["replica"] = 2 * (rep - 1) / rep * p * c / (shard if k.zero else 1) / bwr + 2 * (rep - 1) * latr
        if k.pipe > 1:
            bw, lat = self.mc.link("pipe")
            b = self.batch // (k.data * k.microbatches)
            msg = b * m.seq * m.d_model * c / (k.tensor if k.sp else 1)
            sends = 2 * k.microbatches * k.virtual
            out["pipe"] = sends * (msg / bw + lat)
        return out

    def host_s(self, k: Candidate) -> tuple[float, float]:
        """(seconds of device-host copies, of the host update) with the optimizer offloaded."""
        if not k.offload:
            return 0.0, 0.0
        n_opt = self.m.params / k.pipe / k.tensor / ((k.data // k.replica) if k.zero >= 1 else 1)
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

    def lower_bound(self, data: int, pipe: int, tensor: int) -> float:
        """No configuration of this shape is faster: the compute with no bubble and no recompute, against
        the tensor axis's traffic and the data axis's gradient all-reduce (ZeRO 0-2's bytes, the least)."""
        k = Candidate(data, pipe, tensor, zero=0, schedule="1f1b" if pipe > 1 else None, microbatches=1,
                      recompute="none")
        compute = self.compute_s(k, bubble=False)
        comm = self.comm_s(k)
        # the gradients' traffic at its least: ZeRO 0-2's bytes, over the cheapest replica split (HSDP)
        grads = min(sum(v for a, v in self.comm_s(replace(k, replica=r, zero=1 if r > 1 else 0)).items()
                        if a in ("data", "replica")) for r in divisors(data) if r < data or r == 1)
        unavoidable = comm.get("tensor", 0.0) + grads
        return max(compute, unavoidable) if self.mc.overlap >= 1 else compute + (1 - self.mc.overlap) * unavoidable


# ---- the space -------------------------------------------------------------------------------------

def shapes(n: int, model: ModelShape, *, max_tensor: int = 8) -> Iterator[tuple[int, int, int]]:
    """``(data, pipe, tensor)`` with ``data·pipe·tensor = n``: tensor divides the heads (and d, the
    vocabulary's rows), pipe the layers."""
    for t in divisors(n):
        if t > max_tensor or model.heads % t or model.d_model % t or model.vocab % t:
            continue
        for p in divisors(n // t):
            if model.layers % p:
                continue
            yield n // (t * p), p, t


def configs(data: int, pipe: int, tensor: int, model: ModelShape, batch: int, *, hsdp: bool = True,
            offload: bool = True) -> Iterator[Candidate]:
    """Every configuration of one shape."""
    if batch % data:
        return
    per_rank = batch // data
    replicas = [r for r in divisors(data) if 1 < r < data] if hsdp else []
    schedules = [None] if pipe == 1 else list(SCHEDULES)
    for zero in ((0, 1, 2, 3) if data > 1 else (0,)):          # one data rank: nothing to shard
        for rep in [1] + (replicas if zero >= 1 else []):
            for sp in ((False, True) if tensor > 1 else (False,)):
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
                                    yield Candidate(data, pipe, tensor, rep, zero, sp, sched, v, m, rc, off)


def frugal(data: int, pipe: int, tensor: int, batch: int) -> list[Candidate]:
    """The shape's least memory is one of these: full recompute, sequence parallel, the optimizer on the
    host, one sequence per micro-batch, and ZeRO-2 or ZeRO-3 (ZeRO-3 shards the parameters but holds
    two gathered units: on a small model or few data ranks ZeRO-2 holds less)."""
    sched = "1f1b" if pipe > 1 else None
    zeros = (2, 3) if data > 1 else (0,)
    return [Candidate(data, pipe, tensor, 1, z, tensor > 1, sched, 1, max(1, batch // data), "full", True)
            for z in zeros]


def search(costs: Costs, n: int, *, keep: int = 8, prune: bool = True, hsdp: bool = True,
           offload: bool = True) -> tuple[list[Priced], int]:
    """The ``keep`` fastest candidates that fit (analytic), and how many were priced."""
    best: list[Priced] = []
    priced = 0
    shape_list = list(shapes(n, costs.m))
    if prune:                          # the most promising shapes first: their results prune the others
        shape_list.sort(key=lambda s: costs.lower_bound(*s))
    for d, p, t in shape_list:
        if costs.batch % d:
            continue
        if prune:
            if not any(costs.price(k).fits for k in frugal(d, p, t, costs.batch)):
                continue
            if len(best) >= keep and costs.lower_bound(d, p, t) >= best[-1].step_s:
                continue
        for k in configs(d, p, t, costs.m, costs.batch, hsdp=hsdp, offload=offload):
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
    if not [s for s in every if batch % s[0] == 0]:
        datas = sorted({s[0] for s in every})
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
    return (k.offload, RECOMPUTE.index(k.recompute), k.zero, k.replica, k.sp, k.pipe, k.virtual, k.microbatches)


# ---- the overrides that run a candidate --------------------------------------------------------------

def overrides(k: Candidate, *, model: str, mesh: str, batch: int, precision: str) -> list[str]:
    axes = ",".join(f"{a}:{s}" for a, s in k.axes.items())
    rules = {}
    if k.pipe > 1:
        rules["layers"] = "pipe"
    if k.tensor > 1:
        rules.update(heads="tensor", mlp="tensor", vocab="tensor")
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
    return {"zero": k.zero, "sequence_parallel": k.sp, "schedule": k.schedule, "virtual_stages": k.virtual,
            "microbatches": k.microbatches, "replica": k.replica, "recompute": k.recompute,
            "offload": {"optimizer": "host"} if k.offload else {}}


def smallest_memory(costs: Costs, n: int) -> tuple[float, Candidate]:
    best = None
    for d, p, t in shapes(n, costs.m):
        if costs.batch % d:
            continue
        for k in frugal(d, p, t, costs.batch):
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
