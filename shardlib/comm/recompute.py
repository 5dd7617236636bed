"""Selective recompute: attention's core is recomputed in backward, the rest of a block is saved.

Megatron's default (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models"): of what a transformer block saves for backward, attention's core — the
scores ``QKᵀ``, the softmax, its dropout and the weighting of ``V`` — is large (``5·a·s²·b``
bytes in 16-bit with an unfused kernel) and cheap to redo (no weights, ``4·s²·d`` FLOPs per
sequence against the block's ``24·s·d²``). ``recompute="selective"`` keeps only the core's inputs
``Q, K, V`` (and its mask) and runs the core again when backward reaches it.

**Where the core is.** A call of ``torch.nn.functional.scaled_dot_product_attention`` — the
reference GPT's attention and a transformers model's with ``attn_implementation="sdpa"``.
``SelectiveRecompute`` is a ``TorchFunctionMode`` entered around each selective unit's forward; it
routes those calls through ``AttentionCore``, an autograd function that runs the kernel without
recording a graph, saves its inputs with ``save_for_backward`` (so ``saved_tensors_hooks`` see
them: the planner counts them, the activation offload moves them) and recomputes in backward with
the RNG state of the forward (dropout draws the same mask). Attention written as separate ops
(``attn_implementation="eager"``) has no such call: the mode finds no core (``calls == 0``), and the
planner says so.

**Measuring on the meta device.** The planner measures saved bytes with meta tensors, where
``scaled_dot_product_attention`` runs its math decomposition (it saves the ``s × s`` scores); the
CPU runs a fused kernel that saves the output and the log-sum-exp instead. ``FusedOnMeta`` routes
a meta call to the fused kernel the CPU would choose for the same dtype, mask and dropout
(``torch._fused_sdp_choice``), so planned bytes are what a CPU step saves.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

SDPA = F.scaled_dot_product_attention
_FLASH = 1                                    # torch.nn.attention.SDPBackend.FLASH_ATTENTION's value


def _sdpa_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    q, k, v, *rest = args
    opts = dict(zip(names, rest))
    opts.update(kwargs)
    return q, k, v, opts


def _modes_now() -> list[TorchFunctionMode]:
    from torch.overrides import _get_current_function_mode_stack
    return list(_get_current_function_mode_stack())


@contextmanager
def replayed(modes: list[TorchFunctionMode]) -> Iterator[None]:
    """The torch function modes ``modes`` (those a forward ran under) entered again where not active: a
    recompute in backward — where the autograd engine runs without them — runs as its forward did (the
    context axis's attention, ``runtime/context.py``, is such a mode)."""
    now = _modes_now()
    with ExitStack() as stack:
        for m in modes:
            if not any(m is n for n in now):
                stack.enter_context(m)
        yield


class AttentionCore(torch.autograd.Function):
    """``scaled_dot_product_attention`` that saves its inputs and recomputes itself in backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, opts):
        ctx.opts = opts
        ctx.modes = _modes_now()           # (this call's own mode is off while it runs; the outer ones are on)
        ctx.rng = None
        if opts.get("dropout_p", 0.0) > 0.0 and q.device.type != "meta":
            ctx.rng = (torch.get_rng_state(),
                       torch.cuda.get_rng_state(q.device) if q.device.type == "cuda" else None)
        ctx.save_for_backward(q, k, v, mask)
        return SDPA(q, k, v, attn_mask=mask, **opts)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) if t is not None else None
                  for t, need in zip((q, k, v, mask), ctx.needs_input_grad)]
        wanted = [t for t, need in zip(inputs, ctx.needs_input_grad) if t is not None and need]
        devices = [q.device] if q.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=ctx.rng is not None), torch.enable_grad(), \
                replayed(ctx.modes):
            if ctx.rng is not None:
                torch.set_rng_state(ctx.rng[0])
                if ctx.rng[1] is not None:
                    torch.cuda.set_rng_state(ctx.rng[1], q.device)
            out = SDPA(inputs[0], inputs[1], inputs[2], attn_mask=inputs[3], **ctx.opts)
            got = iter(torch.autograd.grad(out, wanted, grad)) if wanted else iter(())
        return tuple(next(got) if t is not None and need else None
                     for t, need in zip(inputs, ctx.needs_input_grad)) + (None,)


class SelectiveRecompute(TorchFunctionMode):
    """Inside it, attention's core (``scaled_dot_product_attention``) saves only its inputs and is
    recomputed in backward. ``calls`` counts the cores it routed."""

    active = 0                                  # entered instances (FusedOnMeta leaves the core to them)

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __enter__(self):
        SelectiveRecompute.active += 1
        return super().__enter__()

    def __exit__(self, *exc):
        SelectiveRecompute.active -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SDPA and torch.is_grad_enabled():
            self.calls += 1
            q, k, v, opts = _sdpa_args(args, kwargs)
            mask = opts.pop("attn_mask", None)
            return AttentionCore.apply(q, k, v, mask, opts)
        return func(*args, **kwargs)


class FusedOnMeta(TorchFunctionMode):
    """On meta tensors, ``scaled_dot_product_attention`` runs the fused CPU kernel where the CPU
    would choose it, so what autograd saves is what a CPU step saves (not the math decomposition's
    ``s × s`` scores). Inside a ``SelectiveRecompute`` (entered in either order) the core is left to
    it: it saves its inputs only, whatever the kernel."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SDPA:
            q, k, v, opts = _sdpa_args(args, kwargs)
            if (q.device.type == "meta" and not SelectiveRecompute.active and torch.is_grad_enabled()
                    and _cpu_choice(q, k, v, opts) == _FLASH):
                out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, opts.get("dropout_p", 0.0), opts.get("is_causal", False),
                    attn_mask=opts.get("attn_mask"), scale=opts.get("scale"))
                return out
        return func(*args, **kwargs)


def _cpu_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: dict[str, Any]) -> int:
    """The kernel the CPU picks for these shapes' kinds (tiny CPU stand-ins: the choice reads dtypes,
    ranks, the mask's presence and dtype, dropout and causality, not sizes)."""
    if opts.get("enable_gqa") and q.shape[-3] != k.shape[-3]:
        return -1
    small = [torch.zeros(t.shape[:-3] + (1, 2, t.shape[-1]) if t.dim() >= 3 else t.shape, dtype=t.dtype)
             for t in (q, k, v)]
    mask = opts.get("attn_mask")
    m = None if mask is None else torch.zeros((2, 2), dtype=mask.dtype)
    return int(torch._fused_sdp_choice(*small, m, float(opts.get("dropout_p", 0.0)),
                                       bool(opts.get("is_causal", False))))


def recomputed(inner: Callable, policy: str, *, early_stop: bool = True, name: str | None = None) -> Callable:
    """``inner`` (a unit's forward) under a recompute ``policy``: ``"full"`` in a checkpoint (it keeps
    its input; ``early_stop=False`` replays it whole, collectives included), ``"selective"`` with
    attention's core routed through ``AttentionCore``. With ``name``, a selective unit whose first
    forward under grad runs no core (attention written as separate ops) is named once, in a warning."""
    if policy == "full":
        from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

        def full(*args, **kwargs):
            modes = _modes_now()
            with set_checkpoint_early_stop(early_stop):
                return checkpoint(inner, *args, use_reentrant=False,
                                  context_fn=lambda: (nullcontext(), replayed(modes)), **kwargs)
        return full
    seen = [name is None]

    def selective(*args, **kwargs):
        with SelectiveRecompute() as mode:
            out = inner(*args, **kwargs)
        if not seen[0] and torch.is_grad_enabled():
            seen[0] = True
            if mode.calls == 0:
                warnings.warn(f"recompute='selective': unit {name!r} ran no attention core "
                              "(torch.nn.functional.scaled_dot_product_attention) — nothing of it is recomputed. "
                              "A transformers model needs attn_implementation='sdpa'; or use recompute='full'.",
                              stacklevel=2)
        return out
    return selective
