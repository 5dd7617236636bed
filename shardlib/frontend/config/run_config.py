"""Run configurations as the library's own frozen dataclasses.

This is the edge where a front end's configuration (Hydra's composed ``conf/`` groups, a dict
written by hand, JSON) becomes typed values: ``run_config(d)`` takes a plain nested mapping —
``{"mesh": ..., "parallel": ..., "model": ..., "train": ..., "data": ...}``, what
``OmegaConf.to_container`` gives — checks every field and reports every bad one at once, each by
its config key (``train.precision: 'fp8' is unknown — expected one of ...``), as a ``ConfigError``.
The library never imports Hydra.

The groups (``conf/config.yaml`` composes one file of each):

* ``mesh`` (``meshes/*.yaml``, the one source of truth): axis names and sizes, device, backend, and
  for planning the device's sustained TFLOP/s, memory, and each axis's link (GB/s, µs);
* ``parallel``: layout rules and policies (ZeRO stage, sequence parallel, schedule, micro-batches);
* ``model``: the reference GPT's sizes, ``tiny`` to 1T-class; or ``kind: hf`` — a local transformers
  causal-LM folder (``model.path``), whose own config and tokenizer set the sizes;
* ``train``: steps, global batch, sequence, learning-rate schedule, precision, clipping,
  accumulation, recompute, seed;
* ``data``: the text to train on (the stdlib's source, a file of yours, or a local dataset — text,
  JSON lines, parquet — read through the ``datasets`` library);
* ``lora``, ``quant``: LoRA adapters over a frozen, optionally int8/int4 base (``frontend/finetune.py``;
  ``none`` by default).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ...models.gpt import GPTConfig
from ...validate import is_int, is_number
from .calibration import Calibration as Calibration, calibrated, fraction
from .checking import ConfigError as ConfigError, DataError as DataError, Checker, field_names
from .finetune import AdapterConfig, QuantConfig, adapter_config, cross_problems, quant_config
# ConfigError and DataError are this module's public names (the launcher and tests import them here)

PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
LR_SCHEDULES = ("cosine", "linear", "constant")
SOURCES = ("stdlib", "file", "dataset")
FORMATS = ("text", "json", "parquet")          # datasets.load_dataset's packaged builders
MODEL_KINDS = ("gpt", "hf")


@dataclass(frozen=True)
class Link:
    """One mesh axis's interconnect, for planning estimates: bytes/s a rank sends, seconds per message."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class MeshConfig:
    name: str
    axes: tuple[tuple[str, int], ...]
    device: str = "cpu"
    backend: str | None = None
    device_tflops: float | None = None      # sustained, per device (step-time estimates)
    memory_gib: float | None = None         # per device (does the plan fit?)
    host_memory_gib: float | None = None    # per rank's share of its host (do offloaded 'host' states fit?)
    host_gbps: float | None = None          # device <-> host copies, per rank (PCIe), GB/s
    disk_gbps: float | None = None          # host <-> disk under offload_dir, per rank's share, GB/s
    host_update_gbps: float | None = None   # the host's AdamW, per rank, GB/s at 28 B/element moved
    # measured per rank count (python -m shardlib.calibrate): ((ranks, Calibration), ...); the entry for
    # the mesh's own size replaces device_tflops, shared_cores and the default link (``at``)
    calibrated: tuple = ()
    hop_s: tuple = ()                       # (op, seconds per ring hop) measured for ops unlike the all-reduce
    layer_us: float | None = None           # a fixed cost per layer and micro-batch (forward + backward)
    # seconds x 1e9 per attention score element per layer's forward + backward where the attention kernel
    # writes its scores to memory (not flash attention): memory-bound work beside the FLOPs (planner/estimate.py)
    score_ns: float | None = None
    # the fraction of communication hidden behind compute (0: none, 1: all); the step is predicted between
    # the estimate's bounds by it: no_overlap - overlap x (no_overlap - full_overlap)
    overlap: float | None = None
    links: tuple[tuple[str, Link], ...] = ()
    shared_cores: int | None = None         # CPU meshes: every rank on one host of this many cores

    def at(self, ranks: int) -> MeshConfig:
        """These figures as ``ranks`` ranks see them: the calibrated entry for that many ranks, if any
        (its rate is already per rank, shared cores included; its link is every axis's)."""
        got = dict(self.calibrated).get(ranks)
        if got is None:
            return self
        links = (("default", Link(got.gbps * 1e9, got.latency_us * 1e-6)),) if got.gbps > 0 else self.links
        hops = tuple((op, us * 1e-6) for op, us in (("reduce_scatter", got.rs_latency_us),
                                                    ("all_gather", got.ag_latency_us)) if us)
        return replace(self, device_tflops=got.tflops, shared_cores=None, layer_us=got.layer_us, links=links,
                       hop_s=hops, overlap=got.overlap if got.overlap is not None else self.overlap)

    def process_kwargs(self) -> dict[str, Any]:
        """``sl.Mesh``'s keywords for this preset's device and backend (the defaults left to the mesh)."""
        return {**({"backend": self.backend} if self.backend else {}),
                **({"device": self.device} if self.device != "cpu" else {})}

    @property
    def rank_tflops(self) -> float | None:
        """A rank's sustained TFLOP/s: ``device_tflops``, shared out where more ranks than cores run on
        one host (``shared_cores``)."""
        if self.device_tflops is None:
            return None
        if self.shared_cores is None:
            return self.device_tflops
        return self.device_tflops * min(1.0, self.shared_cores / self.size)

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def size(self) -> int:
        return math.prod(s for _, s in self.axes)

    def link(self, axis: str) -> Link | None:
        return dict(self.links).get(axis, dict(self.links).get("default"))


@dataclass(frozen=True)
class ParallelConfig:
    name: str
    zero: int = 0
    rules: tuple[tuple[str, Any], ...] = ()
    sequence_parallel: bool = False
    context_attention: str | None = None        # allgather | ring | ulysses (null: the planner picks)
    schedule: str | None = None
    microbatches: int | None = None
    virtual_stages: int | None = None
    pipe_gather: str = "step"
    replica_axis: str | None = None
    offload: tuple[tuple[str, str], ...] = ()   # memory kinds (planner/offload.py): ((state, kind), ...)
    offload_dir: str | None = None
    delayed: bool = False                       # the host optimizer's delayed update (runtime/offload/core.py)


@dataclass(frozen=True, kw_only=True)
class ModelConfig(GPTConfig):
    """``kind: gpt`` — the reference GPT of these sizes: the fields of ``GPTConfig``, which this is (a field
    added there is a config key here); ``kind: hf`` — the transformers causal LM in the folder ``path`` (its
    config.json sets the sizes; ``seq_len`` is then the training sequence length)."""

    name: str
    kind: str = "gpt"
    path: str | None = None

    def gpt(self) -> GPTConfig:
        return GPTConfig(**{f.name: getattr(self, f.name) for f in fields(GPTConfig)})


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    batch: int = 16                 # global batch, sequences
    seq: int | None = None          # tokens per sequence (default: the model's seq_len)
    lr: float = 3e-3
    lr_schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr: float = 0.1             # the schedule's floor, a fraction of lr
    weight_decay: float = 0.0
    precision: str = "fp32"
    clip_grad_norm: float | None = 1.0
    grad_accum: int = 1
    recompute: str = "none"        # none | selective (attention's core) | full (true/false: full/none)
    seed: int = 0
    log_every: int = 10


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"
    path: str | None = None         # file: a text file; dataset: a file, a glob or a folder of them
    megabytes: float = 2.0          # how much text to read (dataset: per data rank)
    format: str | None = None       # dataset: text | json | parquet (null: from the file extension)
    text_field: str = "text"        # dataset: the column holding the text (json, parquet)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0                  # save every this many steps (0: never)
    dir: str = "checkpoints"        # step-000123 folders and a `latest` pointer
    resume: str | None = None       # "auto": from dir's latest if there is one; or a checkpoint path
    keep: int = 2                   # step folders kept


@dataclass(frozen=True)
class RunConfig:
    mesh: MeshConfig
    parallel: ParallelConfig
    model: ModelConfig
    train: TrainConfig
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: AdapterConfig | None = None       # frontend/finetune.py: None is lora=none
    quant: QuantConfig | None = None

    @property
    def seq(self) -> int:
        return self.train.seq if self.train.seq is not None else self.model.seq_len

    def rules(self) -> dict[str, Any]:
        return dict(self.parallel.rules)

    def plan_kwargs(self) -> dict[str, Any]:
        """``sl.plan``'s keywords for this run (with ``batch=`` left to the caller): the rules, and every key of
        ``parallel`` and ``train`` that is a keyword of ``sl.plan``, by the same name: each is the short form of
        one policy field (``planner/policies.SHORT_FORMS``: ``parallel.zero`` is ``MemoryPolicy.zero``,
        ``train.precision`` is ``TrainingPolicy.precision``), so no key is mapped here by hand. A pipeline's
        keys (``PipelinePolicy``'s, and ``parallel.microbatches``) apply only where the mesh has a pipe."""
        from ...planner.policies import SHORT_FORMS
        piped = self.mesh.shape.get("pipe", 1) > 1
        kw: dict[str, Any] = {"rules": self.rules() or None, "optimizer": "adamw"}
        for section in (self.parallel, self.train):
            for f in fields(section):
                if f.name not in SHORT_FORMS:
                    continue
                if section is self.parallel and not piped and (SHORT_FORMS[f.name][0] == "pipeline"
                                                               or f.name == "microbatches"):
                    continue
                value = getattr(section, f.name)
                kw[f.name] = (dict(value) or None) if f.name == "offload" else value
        return kw

    @property
    def microbatches(self) -> int:
        """Micro-batches per step and data rank (the pipeline's, else ``grad_accum``)."""
        if self.mesh.shape.get("pipe", 1) > 1 and self.parallel.microbatches is not None:
            return self.parallel.microbatches
        return self.train.grad_accum


def _mesh(raw: Any, problems: list[str]) -> MeshConfig:
    c = Checker("mesh", raw, problems, field_names(MeshConfig))
    axes_raw = c.get("axes")
    axes: list[tuple[str, int]] = []
    if not isinstance(axes_raw, Mapping) or not axes_raw:
        c.bad("axes", axes_raw, "a mapping of axis name to size, e.g. {data: 2, tensor: 2}")
    else:
        for name, size in axes_raw.items():
            if not isinstance(name, str) or not name.isidentifier():
                problems.append(f"mesh.axes: axis name {name!r} is not a valid name — expected an identifier.")
            elif not is_int(size) or size < 1:
                problems.append(f"mesh.axes.{name}: got {size!r}; expected a positive int.")
            else:
                axes.append((name, size))
    links: list[tuple[str, Link]] = []
    links_raw = c.get("links") or {}
    if not isinstance(links_raw, Mapping):
        c.bad("links", links_raw, "a mapping of axis name (or 'default') to {gbps, latency_us}")
        links_raw = {}
    for axis, spec in links_raw.items():
        key = f"mesh.links.{axis}"
        if axis != "default" and axis not in dict(axes):
            problems.append(f"{key}: the mesh has no axis {axis!r} — expected one of {[a for a, _ in axes]} or "
                            "'default'.")
            continue
        if not isinstance(spec, Mapping) or set(spec) - {"gbps", "latency_us"}:
            problems.append(f"{key}: got {spec!r}; expected {{gbps: <GB/s>, latency_us: <µs>}}.")
            continue
        gbps, lat = spec.get("gbps"), spec.get("latency_us", 0)
        if not all(is_number(x) for x in (gbps, lat)) or gbps <= 0 \
                or lat < 0:
            problems.append(f"{key}: got {dict(spec)!r}; expected gbps > 0 and latency_us >= 0.")
            continue
        links.append((axis, Link(gbps * 1e9, lat * 1e-6)))
    return MeshConfig(name=c.str("name", "mesh"), axes=tuple(axes),
                      device=c.choice("device", "cpu", ("cpu", "cuda")),
                      backend=c.choice("backend", None, ("gloo", "nccl", "mpi"), optional=True),
                      device_tflops=c.number("device_tflops", None, strict=True, optional=True),
                      memory_gib=c.number("memory_gib", None, strict=True, optional=True), links=tuple(links),
                      host_memory_gib=c.number("host_memory_gib", None, strict=True, optional=True),
                      host_gbps=c.number("host_gbps", None, strict=True, optional=True),
                      disk_gbps=c.number("disk_gbps", None, strict=True, optional=True),
                      host_update_gbps=c.number("host_update_gbps", None, strict=True, optional=True),
                      shared_cores=c.int("shared_cores", None, optional=True),
                      layer_us=c.number("layer_us", None, strict=True, optional=True),
                      score_ns=c.number("score_ns", None, strict=True, optional=True),
                      overlap=fraction(c, "overlap"),
                      calibrated=calibrated(c.get("calibrated"), problems))


def _rules(raw: Any, problems: list[str]) -> tuple[tuple[str, Any], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        problems.append(f"parallel.rules: got {raw!r}; expected a mapping of logical dim to mesh axis, e.g. "
                        "{heads: tensor, mlp: tensor}.")
        return ()
    out = []
    for dim, axis in raw.items():
        if isinstance(axis, (list, tuple)):
            axis = tuple(axis)
        if not (axis is None or isinstance(axis, str) or (isinstance(axis, tuple) and all(isinstance(a, str)
                                                                                           for a in axis))):
            problems.append(f"parallel.rules.{dim}: got {axis!r}; expected a mesh axis name, a list of them, or null.")
            continue
        out.append((str(dim), axis))
    return tuple(out)


def _parallel(raw: Any, problems: list[str]) -> ParallelConfig:
    from ...planner.context import METHODS as CONTEXT_METHODS
    c = Checker("parallel", raw, problems, field_names(ParallelConfig))
    zero = c.get("zero", 0)
    if isinstance(zero, bool) or zero not in (0, 1, 2, 3):
        c.bad("zero", zero, "0, 1, 2 or 3")
        zero = 0
    return ParallelConfig(name=c.str("name", "parallel"), zero=zero, rules=_rules(c.get("rules"), problems),
                          sequence_parallel=c.bool("sequence_parallel", False),
                          context_attention=c.choice("context_attention", None, CONTEXT_METHODS, optional=True),
                          schedule=c.choice("schedule", None, SCHEDULES, optional=True),
                          microbatches=c.int("microbatches", None, optional=True),
                          virtual_stages=c.int("virtual_stages", None, optional=True),
                          pipe_gather=c.choice("pipe_gather", "step", ("step", "microbatch")),
                          replica_axis=c.str("replica_axis", None, optional=True),
                          offload=_offload(c), offload_dir=c.str("offload_dir", None, optional=True),
                          delayed=c.bool("delayed", False))


def _offload(c: Checker) -> tuple[tuple[str, str], ...]:
    """``parallel.offload``: state -> memory kind, checked by key (``parallel.offload.<state>``)."""
    from ...planner.offload import KINDS, STATES
    raw = c.get("offload") or {}
    if not isinstance(raw, Mapping):
        c.bad("offload", raw, f"a mapping of state ({', '.join(STATES)}) to memory kind ({', '.join(KINDS)})")
        return ()
    out = []
    for state, kind in raw.items():
        if state not in STATES:
            near = difflib.get_close_matches(str(state), STATES, n=1)
            c.problems.append(f"parallel.offload.{state}: unknown state — expected one of {', '.join(STATES)}."
                              + (f" Did you mean parallel.offload.{near[0]}?" if near else ""))
        elif kind not in KINDS:
            c.bad(f"offload.{state}", kind, f"a memory kind among {', '.join(KINDS)}")
        else:
            out.append((state, kind))
    return tuple(out)


def _model(raw: Any, problems: list[str]) -> ModelConfig:
    c = Checker("model", raw, problems, field_names(ModelConfig))
    kind = c.choice("kind", "gpt", MODEL_KINDS)
    path = c.get("path")
    if kind == "hf":
        if path in (None, "???", ""):
            problems.append("model.path: missing — model=hf trains a local transformers causal-LM folder "
                            "(config.json, safetensors, tokenizer files): give model.path=<folder>. Make a small one "
                            "offline with python examples/make_tiny_hf.py <folder>.")
            path = None
        for key in (f.name for f in fields(GPTConfig) if f.name != "seq_len"):
            if key in c.raw:
                problems.append(f"model.{key}: not used with model.kind=hf — the folder's config.json sets the "
                                "model's sizes. Remove it, or edit the folder's config.")
    elif path is not None:
        problems.append(f"model.path: {path!r} is only read with model.kind=hf — expected model=hf "
                        f"model.path=<folder>, or no path for the reference GPT.")
    sizes = {f.name: _gpt_field(c, f.name, f.default) for f in fields(GPTConfig)}
    out = ModelConfig(name=c.str("name", "model"), kind=kind, path=c.str("path", None, optional=True)
                      if path is not None else None, **sizes)
    if kind == "gpt" and out.n_experts and out.top_k > out.n_experts:
        problems.append(f"model.top_k: {out.top_k} experts per token is more than model.n_experts={out.n_experts} — "
                        "expected at most n_experts.")
    if kind == "gpt" and out.d_model % out.n_heads:
        problems.append(f"model.n_heads: {out.n_heads} heads do not divide model.d_model={out.d_model} — expected a "
                        "divisor of d_model.")
    return out


def _gpt_field(c: Checker, key: str, default: Any) -> Any:
    """One ``GPTConfig`` field checked by its default's kind: a flag, a choice (the router's scoring), a number
    (>= 0: the aux loss's coefficient, the routed scale, the bias rate), or an int (>= 1; 0 allowed where the
    default is 0: no experts, no shared experts)."""
    if isinstance(default, bool):
        return c.bool(key, default)
    if isinstance(default, str):            # the router's scoring
        return c.choice(key, default, ("softmax", "sigmoid"))
    if isinstance(default, float):
        return c.number(key, default)
    return c.int(key, default, low=0 if default == 0 else 1, optional=default is None)


RECOMPUTE = ("none", "selective", "full", False, True)


def _recompute(v: Any) -> str:
    return {False: "none", True: "full"}.get(v, v) if isinstance(v, bool) else v


def _train(raw: Any, problems: list[str]) -> TrainConfig:
    c = Checker("train", raw, problems, field_names(TrainConfig))
    d = TrainConfig()
    return TrainConfig(
        steps=c.int("steps", d.steps), batch=c.int("batch", d.batch), seq=c.int("seq", None, optional=True),
        lr=c.number("lr", d.lr, strict=True), lr_schedule=c.choice("lr_schedule", d.lr_schedule, LR_SCHEDULES),
        warmup_steps=c.int("warmup_steps", d.warmup_steps, low=0), min_lr=c.number("min_lr", d.min_lr),
        weight_decay=c.number("weight_decay", d.weight_decay), precision=c.choice("precision", d.precision, PRECISIONS),
        clip_grad_norm=c.number("clip_grad_norm", d.clip_grad_norm, strict=True, optional=True),
        grad_accum=c.int("grad_accum", d.grad_accum), recompute=_recompute(c.choice("recompute", d.recompute, RECOMPUTE)),
        seed=c.int("seed", d.seed, low=0), log_every=c.int("log_every", d.log_every))


def _data(raw: Any, problems: list[str]) -> DataConfig:
    c = Checker("data", raw if raw is not None else {}, problems, field_names(DataConfig))
    out = DataConfig(source=c.choice("source", "stdlib", SOURCES), path=c.str("path", None, optional=True),
                     megabytes=c.number("megabytes", 2.0, strict=True),
                     format=c.choice("format", None, FORMATS, optional=True), text_field=c.str("text_field", "text"))
    if out.source == "file" and out.path in (None, "???"):
        problems.append("data.path: missing — data=file reads a text file of yours: give data.path=<file>.")
    if out.source == "dataset" and out.path in (None, "???"):
        problems.append("data.path: missing — data=dataset reads a local dataset (text, JSON lines or parquet "
                        "files): give data.path=<file, glob or folder>.")
    return out


def _checkpoint(raw: Any, problems: list[str]) -> CheckpointConfig:
    c = Checker("checkpoint", raw if raw is not None else {}, problems, field_names(CheckpointConfig))
    return CheckpointConfig(every=c.int("every", 0, low=0), dir=c.str("dir", "checkpoints"),
                            resume=c.str("resume", None, optional=True), keep=c.int("keep", 2))


def run_config(d: Mapping[str, Any]) -> RunConfig:
    """The ``RunConfig`` of a plain nested mapping, or a ``ConfigError`` listing every bad key (and
    the cross-group problems: a rule naming an axis the mesh lacks, a sequence longer than the
    model's positions, a batch that the data ranks and micro-batches do not divide)."""
    problems: list[str] = []
    if not isinstance(d, Mapping):
        raise ConfigError(f"config: expected a mapping with mesh, parallel, model, train, data — got {type(d).__name__}.")
    for key in d:
        if key not in ("mesh", "parallel", "model", "train", "data", "checkpoint", "lora", "quant"):
            problems.append(f"{key}: unknown config group — expected mesh, parallel, model, train, data, checkpoint, "
                            "lora, quant.")
    for key in ("mesh", "parallel", "model", "train"):
        if key not in d:
            problems.append(f"{key}: missing — pick one (e.g. {key}=<preset>) or give its fields.")
    run = RunConfig(mesh=_mesh(d.get("mesh", {}), problems), parallel=_parallel(d.get("parallel", {}), problems),
                    model=_model(d.get("model", {}), problems), train=_train(d.get("train", {}), problems),
                    data=_data(d.get("data"), problems), checkpoint=_checkpoint(d.get("checkpoint"), problems),
                    lora=adapter_config(d.get("lora"), problems),
                    quant=quant_config(d.get("quant"), problems))
    problems += _cross(run) + cross_problems(run.lora, run.quant, run.model)
    if problems:
        raise ConfigError(problems, api="config")
    return run


def _cross(run: RunConfig) -> list[str]:
    out = []
    shape = run.mesh.shape
    missing: dict[str, list[str]] = {}
    for dim, axis in run.parallel.rules:
        for a in (axis if isinstance(axis, tuple) else (axis,)):
            if a is not None and a not in shape:
                missing.setdefault(a, []).append(dim)
    for a, dims in missing.items():
        out.append(f"parallel.rules: parallel={run.parallel.name} maps {', '.join(dims)} to the axis {a!r}, but "
                   f"mesh={run.mesh.name} has axes {tuple(shape)} — expected a mesh with a {a!r} axis, or another "
                   "parallel preset.")
    ra = run.parallel.replica_axis
    if ra is not None and ra not in shape:
        out.append(f"parallel.replica_axis: parallel={run.parallel.name} replicates over {ra!r}, but "
                   f"mesh={run.mesh.name} has axes {tuple(shape)} — expected a mesh with a {ra!r} axis (e.g. "
                   "mesh=hsdp2x2).")
    for axis, size in shape.items():
        used = {a for _, x in run.parallel.rules for a in (x if isinstance(x, tuple) else (x,))}
        if size > 1 and axis in ("tensor", "pipe", "expert", "context") and axis not in used:
            out.append(f"parallel: mesh={run.mesh.name} has {axis}={size}, but parallel={run.parallel.name} maps no "
                       f"logical dim to {axis!r} — expected a preset that uses it (e.g. "
                       f"parallel={ {'expert': 'ep', 'context': 'cp'}.get(axis, '3d')}), or a mesh without it.")
    if shape.get("context", 1) > 1 and run.seq % (2 * shape["context"]):
        n = 2 * shape["context"]
        lo, hi = run.seq // n * n, (run.seq // n + 1) * n
        out.append(f"train.seq: {run.seq} tokens do not split over context={shape['context']} — expected a multiple "
                   f"of 2 x {shape['context']} = {n} (zigzag chunks). Use train.seq={f'{lo} or {hi}' if lo else hi}.")
    if "expert" in shape and shape["expert"] > 1 and run.model.kind == "gpt":
        if not run.model.n_experts:
            out.append(f"model: mesh={run.mesh.name} splits experts over expert={shape['expert']}, but model="
                       f"{run.model.name} has none — expected a mixture-of-experts model (e.g. model=moe_tiny).")
        elif run.model.n_experts % shape["expert"]:
            out.append(f"model.n_experts: {run.model.n_experts} experts do not split over expert={shape['expert']} — "
                       "expected a multiple of the expert axis.")
    if run.model.kind == "gpt" and run.train.seq is not None and run.train.seq > run.model.seq_len:
        out.append(f"train.seq: {run.train.seq} tokens is longer than model.seq_len={run.model.seq_len} positions — "
                   "expected train.seq <= model.seq_len.")
    dp = shape.get("data", 1) * (shape.get(ra, 1) if ra else shape.get("replica", 1)) * shape.get("expert", 1)
    need = dp * run.microbatches
    if run.train.batch % need:
        lo, hi = run.train.batch // need * need, (run.train.batch // need + 1) * need
        out.append(f"train.batch: {run.train.batch} sequences do not split over {dp} data-parallel ranks x "
                   f"{run.microbatches} micro-batches = {need} — expected a multiple of {need}. Use "
                   f"train.batch={f'{lo} or {hi}' if lo else hi}.")
    return out
