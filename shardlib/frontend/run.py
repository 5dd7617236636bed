"""A training run from a ``RunConfig``: the body shared by the main job (``examples/train_gpt.py``)
and the parity matrix (``python -m shardlib.verify``).

* ``check(run)`` — every problem the ranks would hit, found in one process before any rank starts:
  the model built on the meta device and planned on an ``AbstractMesh`` with the run's options (a
  model the layout cannot split, a batch that does not divide, a bad schedule), and the data read;
* ``Trainer(run, mesh)`` — the model, plan and engine on a running mesh, the text, the learning-rate
  schedule; ``trainer.step(i)`` trains step ``i`` on ``batch_at(text, i)`` (a transformers folder,
  ``model.kind=hf``: on this data rank's rows of its own share of the text, tokenized by the folder's
  tokenizer — ``frontend/hf.py``, ``frontend/data/tokens.py``) and returns its metrics:
  loss, learning rate, gradient norm, step time, tokens/s, the bytes this rank sent per mesh axis
  (counted), and every rank's peak resident memory (one small all-gather). With ``lora`` set, the
  folder's model is quantized and wrapped in PEFT adapters first (``frontend/finetune.py``): checked
  on the meta device, built from the folder's values on each rank.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

import torch

from ..algebra.mesh import AbstractMesh, Mesh
from ..comm import core as comm
from ..errors import ShardingError, ShardingTypeError
from .config.checking import collapse
from .config.run_config import LR_SCHEDULES, ConfigError, RunConfig, TrainConfig
from .data.text import VOCAB, batch_at, load_text
from .finetune import loads_base


def lr_factor(train: TrainConfig, step: int) -> float:
    """The learning rate of step ``step`` (0-based) as a fraction of ``train.lr``: linear warm-up over
    ``warmup_steps``, then cosine / linear decay to ``min_lr`` over the rest, or constant."""
    assert train.lr_schedule in LR_SCHEDULES
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.lr_schedule == "constant":
        return 1.0
    span = max(1, train.steps - train.warmup_steps)
    t = min(1.0, (step - train.warmup_steps) / span)
    decay = 0.5 * (1 + math.cos(math.pi * t)) if train.lr_schedule == "cosine" else 1 - t
    return train.min_lr + (1 - train.min_lr) * decay


def example_batch(run: RunConfig) -> Any:
    """The shapes of a global batch (meta tensors): the planner traces activations and the stream from them."""
    if run.model.kind == "hf":
        from .hf import example_batch as hf_batch
        return hf_batch(run)
    ids = torch.zeros(run.train.batch, run.seq, dtype=torch.long, device="meta")
    return ids, ids


def make_plan(model: torch.nn.Module, mesh: AbstractMesh, run: RunConfig):
    from ..planner.build import plan
    return plan(model, mesh, batch=example_batch(run), **run.plan_kwargs())


def check(run: RunConfig) -> list[str]:
    """Every problem of ``run`` that the ranks would hit, found here (no process): the model on the
    meta device, planned on an ``AbstractMesh``; the data read and its bytes in the vocabulary."""
    from ..models.gpt import GPT

    from ..runtime.checkpoint.files import resume_problems

    problems: list[str] = []
    where = f"plan (mesh={run.mesh.name}, parallel={run.parallel.name}, model={run.model.name})"
    hf = run.model.kind == "hf"
    if hf:
        from . import hf as hf_folder
        problems += hf_folder.folder_problems(run)
        if problems:                         # no model to plan, no tokenizer to read the data with
            return problems + _data_problems(run)
    try:
        if hf:
            model = hf_folder.meta_model(run)
            if run.lora is not None:
                from .finetune import adapt
                model = adapt(model, run)
        else:
            with torch.device("meta"):
                model = GPT(run.model.gpt(), seed=None)
        if run.checkpoint.every or run.checkpoint.resume:
            problems += resume_problems(run.checkpoint.resume, run.checkpoint.dir,
                                        {n: tuple(p.shape) for n, p in model.named_parameters()})
        make_plan(model, AbstractMesh(run.mesh.shape), run)
    except ConfigError as e:                 # lora / quant against the model: named by key already
        problems += e.problems
    except (ShardingError, ShardingTypeError) as e:
        found = getattr(e, "problems", None) or [str(e)]
        problems += [f"{_keys_of(p, run)}{where}: {p.removeprefix('plan: ')}" for p in collapse(found)]
    except ValueError as e:
        problems.append(f"model: {e}")
    if not hf and run.model.vocab_size < VOCAB:
        problems.append(f"model.vocab_size: {run.model.vocab_size} is smaller than the data's {VOCAB} byte values — "
                        f"expected model.vocab_size >= {VOCAB}.")
    return problems + _data_problems(run)


def _data_problems(run: RunConfig) -> list[str]:
    """The data read (a dataset: opened, its rows counted against the data ranks; its cache built here)."""
    try:
        if run.data.source == "dataset":
            from .data.local_dataset import dataset_problems
            found = dataset_problems(run.data, run.mesh.shape.get("data", 1))
            if found or run.model.kind == "hf":
                return found
        load_text(run.data, run.seq)
    except ShardingError as e:
        return e.problems
    return []


# what a planner problem is about, in config keys (the message itself names the sizes and the fix)
_KEYS = ((r"quantization group", "quant.group_size with the mesh's tensor axis"),
         (r"pipeline_pre|pipeline_post|\(tied\)", "mesh (its pipe axis)"),
         (r"attention heads|KV heads", "model.n_heads with the mesh's tensor axis"),
         (r"blocks, fewer than the|layer stack", "model.n_layers with the mesh's pipe axis"),
         (r"schedule|micro-batches|microbatches", "parallel.schedule / parallel.microbatches"),
         (r"batch", "train.batch"),
         (r"sequence", "train.seq with the mesh's tensor axis"),
         (r"precision|dtype", "train.precision"))


def _keys_of(problem: str, run: RunConfig) -> str:
    for pattern, keys in _KEYS:
        if re.search(pattern, problem):
            if run.model.kind == "hf" and keys.startswith("model."):      # the folder's config sets the sizes
                keys = "model.path (its config.json)" + keys[keys.index(" with"):]
            return f"{keys}: "
    return ""


class Trainer:
    """The run on ``mesh`` (a ``Mesh`` over the running world): model, plan, engine, text."""

    def __init__(self, run: RunConfig, mesh: Mesh, *, text: torch.Tensor | None = None):
        from ..runtime.parallelize import parallelize

        self.run, self.mesh = run, mesh
        t = run.train
        self.hf = run.model.kind == "hf"
        self.tuned = self.hf and run.lora is not None      # LoRA adapters over the folder's base
        self.loads = loads_base(run)           # no values built: the folder read into the shards
        self.model = self._model()
        self.plan = make_plan(self.model, mesh, run)
        self.engine = parallelize(
            self.model, self.plan,
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=t.lr, weight_decay=t.weight_decay),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(t, i)),
            init=not self.loads)
        if self.hf:       # the weights into the shards; this data rank's share of the text, in the folder's tokens
            from .hf import load_tokenizer
            from .data.tokens import load_tokens
            if self.loads:
                self.engine.load_pretrained(run.model.path)
            self.tokenizer = load_tokenizer(run.model.path)
            self.text = text if text is not None else load_tokens(
                run.data, self.tokenizer, run.seq, self.engine.data_index, self.engine.rows_size)
        else:
            self.text = text if text is not None else load_text(run.data, run.seq)
        self.tokens_per_step = t.batch * run.seq

    def _model(self) -> torch.nn.Module:
        if self.tuned:
            from .finetune import build
            return build(self.run)
        if self.hf:
            from .hf import meta_model
            return meta_model(self.run)
        from ..models.gpt import GPT
        return GPT(self.run.model.gpt(), seed=self.run.train.seed)

    def batch(self, i: int) -> Any:
        """Step ``i``'s batch (the data position is the step): the global batch, or with a transformers
        folder this data rank's rows of it."""
        t = self.run.train
        if self.hf:
            from .data.tokens import local_batch
            return local_batch(self.text, i, t.batch // self.engine.rows_size, self.run.seq, t.seed,
                               self.engine.data_index)
        return batch_at(self.text, i, t.batch, self.run.seq, t.seed)

    def step(self, i: int, *, record: bool = True) -> dict[str, Any]:
        """Train step ``i`` (0-based); its metrics on this rank (``peak_rss`` of every rank)."""
        batch = self.batch(i)
        lr = self.engine.optimizer.param_groups[0]["lr"]
        t0 = time.perf_counter()
        with comm.count_collectives() as counter:
            loss = self.engine.step(batch, local=self.hf)
        dt = time.perf_counter() - t0
        out = {"step": i + 1, "loss": loss, "lr": lr, "grad_norm": self.engine.grad_norm, "step_ms": 1e3 * dt,
               "tokens_per_s": self.tokens_per_step / dt,
               "bytes_per_axis": {"+".join(k) or "local": v for k, v in sorted(counter.by_axes().items())}}
        if self.engine.tokens_per_expert:      # the expert axis: the batch's tokens per expert, and the imbalance
            out["tokens_per_expert"] = self.engine.tokens_per_expert
            out["expert_imbalance"] = self.engine.expert_imbalance
        if self.engine.dropped_tokens:         # a capacity's overflow, counted
            out["dropped_tokens"] = self.engine.dropped_tokens
        if record:
            out["peak_rss"] = self.peak_rss()
        return out

    def peak_rss(self) -> list[int]:
        """Every rank's peak resident memory so far (``VmHWM``), bytes."""
        mine = torch.tensor([_vm_hwm()], dtype=torch.float64)
        if self.mesh.size == 1:
            return [int(mine.item())]
        got = comm.all_gather(mine, self.mesh, self.mesh.axis_names)
        return [int(x) for x in got.tolist()]


def _vm_hwm() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class SavedActivations:
    """The most bytes autograd held saved for backward at once while active, parameters and buffers
    excluded, each storage once (``torch.autograd.graph.saved_tensors_hooks``): a step's measured
    activation memory, beside the plan's."""

    def __init__(self, model: torch.nn.Module):
        from ..quant.layout import inner_tensors            # a quantized weight: its components' storages
        from ..runtime.access import ShardedParameter       # a ZeRO-3 parameter at rest: no storage here
        mine = [t for t in [*model.parameters(), *model.buffers()] if not isinstance(t, ShardedParameter)]
        self.own = {t.untyped_storage().data_ptr() for t in inner_tensors(mine)
                    if not t.is_meta and t.untyped_storage().nbytes()}
        self.live: dict[int, list] = {}          # storage pointer -> [bytes, references]
        self.bytes = self.peak = 0

    def _pack(self, t: torch.Tensor):
        from ..quant.layout import inner_tensors
        if t.is_meta or isinstance(t, torch.nn.Parameter):
            return t
        stores = {s.data_ptr(): s.nbytes() for s in (c.untyped_storage() for c in inner_tensors([t]))}
        if stores.keys() <= self.own:
            return t
        for ptr, nbytes in stores.items():
            entry = self.live.setdefault(ptr, [nbytes, 0])
            if entry[1] == 0:
                self.bytes += entry[0]
            entry[1] += 1
        self.peak = max(self.peak, self.bytes)
        return _Held(self, tuple(stores), t)

    def _unpack(self, h):
        return h.t if isinstance(h, _Held) else h

    def release(self, ptrs: tuple[int, ...]) -> None:
        for ptr in ptrs:
            entry = self.live.get(ptr)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] == 0:
                self.bytes -= entry[0]
                del self.live[ptr]

    def __enter__(self) -> SavedActivations:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


class _Held:
    """A saved tensor; when autograd drops it, its bytes leave the count."""

    __slots__ = ("owner", "ptrs", "t")

    def __init__(self, owner: SavedActivations, ptrs: tuple[int, ...], t: torch.Tensor):
        self.owner, self.ptrs, self.t = owner, ptrs, t

    def __del__(self):
        self.owner.release(self.ptrs)
