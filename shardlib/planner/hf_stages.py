"""Pipeline stages of a transformers causal LM, derived from the model's own ``forward`` (no code).

A decoder-only causal LM of transformers (Llama, Qwen2, Mistral, GPT-2, GPT-NeoX, ...) computes,
inside its own ``forward``: the embeddings (and GPT-2's learned positions), the rotary tables and
masks, ``for block in stack: x = block(x, **kwargs)``, the final norm, the head, any
post-processing of the logits, and the loss. ``CausalLMStages`` keeps all of that the family's
code: it runs ``model.forward`` with the layer stack swapped for stubs (``_Stub``) that record
what each block is called with.

* ``pre`` (first stage): ``model.forward(**batch)`` without ``labels``, ``use_cache=False``; the
  stubs pass their input through and the run stops after the last one. ``x`` is what block 0 was
  given; the context is every block's keyword arguments (``position_embeddings``, the causal or
  padding mask, ``position_ids``, ...), bound by name to the block's signature.
* ``context`` (every other stage): the same run with ``inputs_embeds`` of zeros (the stream's
  shape and dtype) in place of ``input_ids``, under ``no_grad``: the block arguments depend on the
  batch's shape and mask only, so each stage computes its own and only the hidden state crosses
  stages. Parameters of other stages (on the meta device, ``strip_to_stage``) are read as zeros of
  stride 0 (no storage) — GPT-2's ``wpe``, which its forward adds to ``inputs_embeds``.
* ``post`` (last stage): ``model.forward(**batch)`` with ``inputs_embeds`` of zeros and the last
  stub returning the stage's ``x``: the model's own final norm, head, logit post-processing and
  ``loss_function`` (its label shift and ignore index). What runs before the stack there is the
  mask and rotary arithmetic on zeros, nothing with this stage's parameters.

**The loss** is ``model(**micro_batch).loss``, exactly what one process computes on the micro-batch:
for transformers' causal LMs the micro-batch's summed token losses over ``num_items_in_batch``,
which the engine puts in every micro-batch (``runtime/batches.py``: the global batch's count of
non-ignored shifted labels over ``data · m``), so the engine's mean of the micro-batch losses is
the whole batch's token mean, padding and ``-100`` labels included — ``model(**batch).loss`` of
one process. ``num_items_in_batch`` goes to the loss only (``LOSS_KEYS``), not to the runs up to
the stack.

**Checked at plan time** (``check``, on one row of the example batch, parameters read as zeros of
stride 0 on the CPU): the forward calls each block once, in order, passing the previous block's
output on unchanged; no block argument is computed from parameters or from the embeddings'
values (it would be wrong on the stages that do not hold them); every argument is a tensor,
``None`` or a plain value (a cache shared between blocks is not); a block returns the hidden
state, of its input's shape, alone or first in a tuple (GPT-J, BLOOM, MPT: the plan records the
tuple's length, the stubs return one, the stages keep its first item). A block the meta device cannot
run (an MoE block's ``nonzero``) is run on zeros on the CPU instead (``meta_or_zeros``). The modules that run before the stack are the first stage's,
the rest the last stage's (execution order, not registration order).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from ..errors import ShardingError
from .functional import functional_call
from .hf_zeros import concrete, meta_or_zeros, shapes_of, zeros_for
from .peft import peft_base

Context = list          # per block of the stack, in order: the keyword arguments it is called with
PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)
# what only the loss reads: kept from the runs up to the stack (transformers' loss_function takes
# ``num_items_in_batch`` to divide the summed loss by a token count given from outside)
LOSS_KEYS = ("labels", "num_items_in_batch")


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers-style causal LM: a ``config`` with ``hidden_size`` and a ``forward`` taking
    ``input_ids``, ``inputs_embeds`` and ``labels`` (a PEFT model: its base model is one)."""
    model = peft_base(model)[0]
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    width = getattr(getattr(model, "config", None), "hidden_size", None)
    return isinstance(width, int) and {"input_ids", "inputs_embeds", "labels"} <= set(params)


class _Stop(Exception):
    """Ends the model's forward after the stack's last stub."""


class _Stub(nn.Module):
    """Stands in for block ``index`` while the model's forward runs: ``fn(index, args, kwargs)``
    returns what the block would. Attributes it lacks are read from the real block (a family's loop
    may read ``layer.attention_type``); the real block is not registered (its hooks do not run)."""

    def __init__(self, index: int, real: nn.Module, fn: Callable):
        super().__init__()
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_fn", fn)
        self.index = index

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_real"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(self.index, args, kwargs)


class CausalLMStages:
    """``pre`` / ``context`` / ``block_kwargs`` / ``post`` of a transformers causal LM whose layer
    stack is the ``nn.ModuleList`` named ``stack`` (see the module doc)."""

    kind = "transformers"

    def __init__(self, model: nn.Module, stack: str):
        # a PEFT model runs its base model's forward (PEFT's LoRA layers sit inside it); names here
        # are relative to that model, ``prefix`` leads back to the PEFT model's own
        model, self.prefix = peft_base(model)
        stack = stack.removeprefix(self.prefix)
        self.model, self.stack = model, stack
        parent, _, self.attr = stack.rpartition(".")
        self.parent = model.get_submodule(parent) if parent else model
        self.blocks = list(model.get_submodule(stack))
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        dim = getattr(emb, "embedding_dim", None)
        # what inputs_embeds holds: the input embeddings' width (OPT's word_embed_proj_dim, projected up
        # before the stack), which the stream's need not be
        self.width = int(dim) if isinstance(dim, int) else int(model.config.hidden_size)
        # a block returning a tuple whose first item is the hidden state (GPT-J, BLOOM, Falcon, MPT, ...):
        # its length, 0 for a block returning the tensor; None until a block has run (``_block_out``)
        self.tuple_out: int | None = None
        self._sigs: dict[type, inspect.Signature] = {}
        self._stubs: nn.ModuleList | None = None
        self._zeros: dict = {}         # _zeros_for's places and zeros, kept (see there)
        self._fn: Callable | None = None
        # a stage's block arguments by batch shape, where they cannot depend on anything else: the batch
        # holds only input_ids and LOSS_KEYS, and no dropout runs (its draws would be skipped)
        self._contexts: dict[tuple, Context] = {}
        self._random = any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())

    # ---- what a step runs ------------------------------------------------------------------------
    def pre(self, batch: Mapping[str, Any], dtype: torch.dtype) -> tuple[torch.Tensor, Context]:
        """The first stage: the stream entering block 0 (through the embeddings, with their
        gradient) and every block's keyword arguments."""
        kwargs = {k: v for k, v in batch.items() if k not in LOSS_KEYS}
        calls = self._record(kwargs, "meta", dtype)
        return self._hidden(0, calls[0]), [self._kwargs(i, c) for i, c in enumerate(calls)]

    def context(self, batch: Mapping[str, Any], dtype: torch.dtype) -> Context:
        """Another stage: every block's keyword arguments, from the batch's shape and mask alone (the
        same for every micro-batch of a shape when the batch has no mask or positions of its own: kept,
        and read only by the blocks)."""
        ids = batch["input_ids"]
        key = None
        if not (self.model.training and self._random) and all(k == "input_ids" or k in LOSS_KEYS for k in batch):
            key = (tuple(ids.shape), dtype, ids.device)
            hit = self._contexts.get(key)
            if hit is not None:
                return hit
        kwargs = self._embedded(batch, dtype, labels=False)
        with torch.no_grad():
            calls = self._record(kwargs, "meta", dtype)
        ctx = [self._kwargs(i, c) for i, c in enumerate(calls)]
        if key is not None:
            if len(self._contexts) >= 4:          # a few shapes (a dataset of many lengths: the latest)
                self._contexts.pop(next(iter(self._contexts)))
            self._contexts[key] = ctx
        return ctx

    @staticmethod
    def block_kwargs(ctx: Context, index: int) -> dict[str, Any]:
        return ctx[index]

    def post(self, x: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
        """The last stage: the model's own forward after the stack on ``x`` — norm, head, loss."""
        last = len(self.blocks) - 1

        def fn(i: int, args: tuple, kwargs: dict) -> Any:
            return self._as_block(x if i == last else self._hidden(i, (args, kwargs)))
        with self._swapped(fn), zeros_for(self.model, "meta", x.dtype, x.device, memo=self._zeros):
            out = self.model.forward(**self._embedded(batch, x.dtype, labels=True), use_cache=False)
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if loss is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) \
                and out[0].dim() == 0:
            loss = out[0]
        if loss is None:
            raise ShardingError(f"pipeline: {type(self.model).__name__} returned no loss — expected the batch "
                                f"to hold 'labels' (got {sorted(batch)}). Give the batch its labels.")
        return loss

    # ---- shapes on the meta device -----------------------------------------------------------------
    def probe(self, batch: Mapping[str, Any], rows: int, dtype: torch.dtype) -> tuple[torch.Size, Context]:
        """``(shape of the stream entering the stack, the blocks' keyword arguments on the meta
        device)`` for a micro-batch of ``rows`` rows of ``batch`` (tensors or meta tensors): the
        arguments are computed on the CPU from zeros (cheap: masks and rotary tables), then given
        the meta device — for the stream's shape and the activation-memory probe."""
        small = concrete(batch, rows)
        kwargs = self._embedded(small, dtype, labels=False)
        with torch.no_grad():
            calls = self._record(kwargs, "all", dtype)
        ctx = [self._kwargs(i, c) for i, c in enumerate(calls)]
        meta = tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), ctx)
        return self._hidden(0, calls[0]).shape, meta

    # ---- plan-time checks -------------------------------------------------------------------------
    def batch_problems(self, batch: Any, api: str, what: str) -> list[str]:
        """What ``batch`` lacks to be fed to the stages: a dict of what ``model(**batch)`` takes,
        with ``input_ids`` (the first stage's) and ``labels`` (the last stage's loss). Checked at
        plan time on the example batch and by ``engine.step`` on every rank before any collective:
        otherwise stage 0 fails in ``pre`` (or the last in ``post``) while its peers wait."""
        name = type(self.model).__name__
        if not isinstance(batch, Mapping):
            return [f"{api}: the {what} of {name} is a {type(batch).__name__} — expected a dict of what "
                    "model(**batch) takes ('input_ids', 'labels', optional 'attention_mask'): a pipelined "
                    "transformers model is fed the keyword arguments of its forward. Give dicts."]
        return [f"{api}: the {what} of {name} has no {key!r} — got {sorted(batch)}; expected 'input_ids' and "
                "'labels' (the loss is the model's own, on the last stage). Add it."
                for key in ("input_ids", "labels") if key not in batch]

    def check(self, batch: Any) -> tuple[list[str], list[str], list[str]]:
        """``(modules run before the stack, the others, problems)``: modules are those holding
        parameters directly, outside the stack (see the module doc for what is checked)."""
        if batch is None:
            batch = {"input_ids": torch.zeros(1, 2, dtype=torch.long)}
        else:
            problems = self.batch_problems(batch, "plan", "example batch")
            if problems:
                return [], [], problems
        problems: list[str] = []
        owners = {n: m for n, m in self.model.named_modules()
                  if m._parameters and not (n == self.stack or n.startswith(self.stack + "."))}
        ran: list[str] = []
        handles = [m.register_forward_pre_hook(lambda mod, args, n=n: ran.append(n)) for n, m in owners.items()]
        small = concrete(batch, 1)
        try:
            with zeros_for(self.model, "all", torch.float32, small["input_ids"].device, grad=True):
                by_ids = self._record({k: v for k, v in small.items() if k not in LOSS_KEYS}, None, torch.float32,
                                      problems)
                embedded = self._embedded(small, torch.float32, labels=False)
                embedded["inputs_embeds"].requires_grad_(True)
                by_embeds = self._record(embedded, None, torch.float32, problems)
        finally:
            for h in handles:
                h.remove()
        pre = list(dict.fromkeys(ran))
        post = [self.prefix + n for n in owners if n not in set(pre)]
        pre = [self.prefix + n for n in pre]
        if problems:
            return pre, post, problems
        try:
            problems += self._check_calls(by_ids)
            if not problems:
                problems += self._check_args(by_ids, by_embeds)
            if not problems:
                problems += self._check_block(by_embeds)
        except ShardingError as e:       # a block's arguments that cannot be passed by name
            problems.append(str(e).replace("pipeline:", "plan:", 1))
        return pre, post, problems

    def _check_calls(self, calls: dict[int, tuple]) -> list[str]:
        n, name = len(self.blocks), type(self.model).__name__
        if sorted(calls) != list(range(n)) or any(len(v) != 1 for v in calls.values()) or list(calls) != sorted(calls):
            seen = [(i, len(v)) for i, v in calls.items()]
            return [f"plan: {name}'s forward calls the blocks of {self.stack!r} as {seen} (index, times) — "
                    f"expected each of its {n} blocks once, in order, so that the stack can be cut into stages. "
                    "Declare the stack the forward runs block by block, or plan without the pipe axis."]
        out = []
        for i in range(1, n):
            if self._hidden(i, calls[i][0]) is not self._hidden(i - 1, calls[i - 1][0]):
                out.append(f"plan: {name}'s forward changes the hidden state between blocks {i - 1} and {i} of "
                           f"{self.stack!r} — expected each block's output passed to the next unchanged (only the "
                           "blocks run between stages). Plan without the pipe axis for this model.")
                break
        return out

    def _check_args(self, by_ids: dict[int, tuple], by_embeds: dict[int, tuple]) -> list[str]:
        name, out = type(self.model).__name__, []
        for i in range(len(self.blocks)):
            a, b = self._kwargs(i, by_ids[i][0]), self._kwargs(i, by_embeds[i][0])
            for key, value in a.items():
                leaves = tree_flatten(value)[0]
                odd = [type(v).__name__ for v in leaves if not isinstance(v, (torch.Tensor, *PLAIN))]
                if odd:
                    out.append(f"plan: block {i} of {self.stack!r} needs {key!r}, a {'/'.join(odd)} — expected "
                               "tensors or plain values the adapter recomputes on every stage; an object shared "
                               "between blocks (a cache) cannot cross stages. Train with use_cache=False, or plan "
                               "without the pipe axis.")
                elif any(isinstance(v, torch.Tensor) and v.requires_grad
                         for v in (*leaves, *tree_flatten(b.get(key))[0])):
                    out.append(f"plan: block {i} of {self.stack!r} needs {key!r}, computed from parameters or from "
                               "the embeddings' values before the stack — expected only tensors each stage derives "
                               "from the batch (masks, positions, rotary tables): only the hidden state crosses "
                               f"stages. {name} cannot be pipelined by the transformers adapter; plan without the "
                               "pipe axis.")
            shapes, other = shapes_of(a), shapes_of(b)
            if shapes != other:
                out.append(f"plan: block {i} of {self.stack!r} gets {shapes} from input_ids but {other} from "
                           "inputs_embeds — expected the same arguments either way (the stages after the first "
                           f"compute theirs from inputs_embeds). {name} cannot be pipelined by the transformers "
                           "adapter; plan without the pipe axis.")
            if out:
                break
        return out

    def run_block(self, call: tuple, index: int = 0) -> tuple[Any, torch.Tensor]:
        """``(output, input)`` of block ``index`` run on ``call``'s arguments with its parameters as
        placeholders on the meta device (``meta_or_zeros``: zeros on the CPU for a block meta cannot run)."""
        block = self.blocks[index]
        x = self._hidden(index, call)

        def meta(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, device="meta")
        kwargs = tree_map_only(torch.Tensor, meta, self._kwargs(index, call))
        values = {n: meta(t) for n, t in [*block.named_parameters(), *block.named_buffers()]}
        xm = meta(x)

        def run(values, xm, kwargs):
            with torch.no_grad():
                return functional_call(block, values, (xm,), kwargs, strict=False), xm
        return meta_or_zeros(run, values, xm, kwargs)

    def _block_out(self, call: tuple) -> None:
        """Learn whether the blocks return a tuple (``tuple_out``), from block 0 on ``call``."""
        if self.tuple_out is not None:
            return
        try:
            out, _ = self.run_block(call)
        except Exception:            # reported by the plan's check; run as a tensor-returning block
            self.tuple_out = 0
            return
        self.tuple_out = len(out) if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) else 0

    def _as_block(self, x: Any) -> Any:
        """What a stub returns in place of the block: the hidden state, or the block's tuple around it."""
        return (x, *(None,) * (self.tuple_out - 1)) if self.tuple_out else x

    @staticmethod
    def hidden_out(out: Any) -> Any:
        """The hidden state in what a block returned (the first item of a tuple)."""
        return out[0] if isinstance(out, tuple) else out

    def _check_block(self, calls: dict[int, tuple]) -> list[str]:
        block = self.blocks[0]
        try:
            out, xm = self.run_block(calls[0][0])
        except Exception as e:         # the family's own code: report what it said
            return [f"plan: block 0 of {self.stack!r} ({type(block).__name__}) failed on the meta device and on zeros "
                    f"with the arguments the model's forward gives it — got {type(e).__name__}: {str(e)[:300]}. Plan "
                    "without the pipe axis for this model."]
        out = self.hidden_out(out)
        if not isinstance(out, torch.Tensor) or out.shape != xm.shape:
            got = type(out).__name__ + (str(tuple(out.shape)) if isinstance(out, torch.Tensor) else "")
            return [f"plan: block 0 of {self.stack!r} ({type(block).__name__}) returns {got} — expected the hidden "
                    f"state (alone or first in a tuple), of its input's shape {tuple(xm.shape)}: only it crosses stages. Plan without the "
                    "pipe axis for this model."]
        return []

    # ---- the swapped forward -----------------------------------------------------------------------
    def _embedded(self, batch: Mapping[str, Any], dtype: torch.dtype, *, labels: bool) -> dict[str, Any]:
        """``batch`` with ``inputs_embeds`` of zeros in place of ``input_ids`` (and without
        ``LOSS_KEYS`` unless ``labels``)."""
        ids = batch["input_ids"]
        out = {k: v for k, v in batch.items() if k != "input_ids" and (labels or k not in LOSS_KEYS)}
        out["inputs_embeds"] = torch.zeros((*ids.shape, self.width), dtype=dtype, device=ids.device)
        return out

    def _record(self, kwargs: dict[str, Any], params: str | None, dtype: torch.dtype,
                problems: list[str] | None = None) -> dict[int, list[tuple]] | list[tuple]:
        """Run the forward up to the stack's last block, each stub passing its input on, with
        ``params`` (``zeros_for``; None: as they are) read as zeros of ``dtype``; return each
        block's ``(args, kwargs)`` — a list in order, or with ``problems`` (the plan's check) every
        call by index (the forward's errors added to ``problems``)."""
        calls: dict[int, list[tuple]] = {}
        last = len(self.blocks) - 1

        def fn(i: int, args: tuple, kw: dict) -> Any:
            calls.setdefault(i, []).append((args, kw))
            if i == last:
                raise _Stop
            if i == 0 and self.tuple_out is None:       # the blocks' output structure, before the next call
                self._block_out((args, kw))
            return self._as_block(self._hidden(i, (args, kw)))
        leaves = [t for t in kwargs.values() if isinstance(t, torch.Tensor)]
        device = leaves[0].device if leaves else torch.device("cpu")
        try:
            memo = self._zeros if params == "meta" else None
            with self._swapped(fn), (zeros_for(self.model, params, dtype, device, memo=memo) if params else nullcontext()):
                self.model.forward(**kwargs, use_cache=False)
        except _Stop:
            pass
        except Exception as e:
            if problems is None:
                raise
            problems.append(f"plan: {type(self.model).__name__}'s forward failed before its layer stack "
                            f"{self.stack!r} — got {type(e).__name__}: {str(e)[:300]}; expected it to run with "
                            "the example batch. Fix the batch, or plan without the pipe axis.")
            return calls
        if problems is not None:
            return calls
        if sorted(calls) != list(range(last + 1)):
            raise ShardingError(f"pipeline: {type(self.model).__name__}'s forward called blocks of {self.stack!r} — "
                                f"got {sorted(calls)}; expected all {last + 1}, as the plan checked. Plan again for "
                                "this batch.")
        return [calls[i][0] for i in range(last + 1)]

    @contextmanager
    def _swapped(self, fn: Callable) -> Iterator[None]:
        """The stack replaced by stubs calling ``fn`` (built once: every micro-batch's stage runs this)."""
        if self._stubs is None:
            self._stubs = nn.ModuleList([_Stub(i, b, self._dispatch) for i, b in enumerate(self.blocks)])
        real = self.parent._modules[self.attr]
        self.parent._modules[self.attr] = self._stubs
        self._fn = fn
        try:
            yield
        finally:
            self.parent._modules[self.attr] = real
            self._fn = None

    def _dispatch(self, i: int, args: tuple, kwargs: dict) -> Any:
        return self._fn(i, args, kwargs)

    def _bound(self, i: int, call: tuple) -> tuple[Any, dict[str, Any]]:
        args, kwargs = call
        block = self.blocks[i]
        cls = type(block)
        sig = self._sigs.get(cls)
        if sig is None:
            # the class's forward, bound: the instance's may be a wrapper (recompute's checkpoint,
            # runtime/setup.py) whose signature is ``(*args, **kwargs)``
            sig = self._sigs[cls] = inspect.signature(cls.forward.__get__(block))
        bound = sig.bind(*args, **kwargs).arguments
        names = list(sig.parameters)
        x = bound.pop(names[0])
        out: dict[str, Any] = {}
        for k, v in bound.items():
            kind = sig.parameters[k].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                out.update(v)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                if v:
                    raise ShardingError(f"pipeline: block {i} of {self.stack!r} is given extra positional arguments "
                                        f"— got {len(v)}; expected arguments the adapter can pass by name. Plan "
                                        "without the pipe axis for this model.")
            else:
                out[k] = v
        return x, out

    def _hidden(self, i: int, call: tuple) -> Any:
        args = call[0]
        return args[0] if args else self._bound(i, call)[0]      # given by position: the first parameter

    def _kwargs(self, i: int, call: tuple) -> dict[str, Any]:
        return self._bound(i, call)[1]
