"""What ``sl.autoplan`` searches over and with: a candidate plan (``Candidate``), its price (``Priced``), the
model's sizes the closed-form costs need (``ModelShape``) and the machine's figures (``Machine``). The
search itself and its costs: ``planner/autoplan.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ShardingError


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
    expert: int = 1               # experts split over it; the batch over data x expert (Megatron, torchtitan)
    context: int = 1              # each sequence split over it (zigzag chunks); a data axis for the states

    @property
    def batch_ranks(self) -> int:
        """The ranks the batch splits over: data x expert."""
        return self.data * self.expert

    @property
    def devices(self) -> int:
        return self.data * self.pipe * self.tensor * self.expert * self.context

    @property
    def axes(self) -> dict[str, int]:
        out = {"replica": self.replica} if self.replica > 1 else {}
        out["data"] = self.data // self.replica
        if self.expert > 1:
            out["expert"] = self.expert
        if self.context > 1:
            out["context"] = self.context
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
    experts: int = 0              # routed experts per MoE block (0: dense)
    top_k: int = 0                # experts each token is routed to
    expert_params: int = 0        # of ``block_params``, the routed experts' (split over the expert axis)

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
