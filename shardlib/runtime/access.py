"""Touching parameters between steps: safe under every stage, full values on request.

Under ZeRO-3 a parameter's full tensor exists only while its unit is gathered inside a step.
Between steps the modules hold a ``ShardedParameter`` in its place: the same name, shape, dtype
and ``requires_grad``, no data; any operation on it (``model.fc.weight.sum()``, ``.data``,
``print``, ``torch.save``) raises a ``ShardingError`` that names the parameter and the fix, where
the freed tensor itself (full shape, 0 bytes of storage) would crash the process. This is FSDP2's
design (the module holds the sharded parameter at rest and the unsharded one during forward and
backward) with an error in place of a DTensor: a DTensor would compute — with a collective that
hangs when one rank alone prints a weight. (FSDP1's size-0 views are worse: ``p.sum()`` is 0.)
The engine swaps the real parameters in for ``step`` and for a forward called outside it.

``engine.gathered(writable=False)`` (FSDP's ``summon_full_params``): inside, every module holds
full fp32 parameters — the masters' values where the optimizer keeps fp32 masters, the only copy
otherwise (frozen parameters in bf16/fp16) — new tensors, the same on every rank. Read-only: edits
are discarded on exit. ``writable=True``: on exit each rank writes the values the model then
holds into everything that stores the parameter — fp32 masters (its part under ZeRO-1/2/3), the
compute-dtype copies (full under DP and ZeRO-1/2, its shard under ZeRO-3) — so the masters and
the compute copies stay consistent; the optimizer's state is kept. Edits must be the same on
every rank (each rank keeps its own part of them under ZeRO). Every rank must enter: it is a
collective.

``model.state_dict()`` under ZeRO-3 raises outside ``gathered()`` (a saved file of empty tensors
would not load) and returns full tensors inside it; ``model.load_state_dict`` likewise works
inside ``gathered(writable=True)``. ``engine.full_state_dict()`` is the checkpoint form.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..algebra.layout import Layout
from ..algebra.spec import PartitionSpec
from ..comm import core as comm
from ..comm.redistribute import redistribute
from ..errors import ShardingError
from ..quant import formats
from ..validate import flag
from .checkpoint.pieces import quant_shard
from .sync import broadcast_coalesced

if TYPE_CHECKING:
    from ..algebra.mesh import Mesh
    from ..planner.plan import Plan
    from .state import ParamState
    from .units import UnitRunner

_FIX = ("Read full values inside `with engine.gathered(): ...` (writable=True keeps edits), or take "
        "engine.full_state_dict() (every parameter and buffer, full, e.g. to torch.save).")


class ShardedParameter(torch.Tensor):
    """A ZeRO-3 parameter between steps: metadata only; every operation raises naming the fix."""

    _is_param = True                  # isinstance(p, nn.Parameter) holds, as for what it stands for
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, like: torch.Tensor, name: str, axis: str):
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device,
                                                requires_grad=like.requires_grad)
        t._sl_name, t._sl_axis = name, axis
        return t

    def _error(self, what: str) -> ShardingError:
        return ShardingError(
            f"{self._sl_name}: a ZeRO-3 parameter is sharded over {self._sl_axis!r} between steps (this rank "
            f"holds only its part; the full tensor exists inside engine.step) — got {what} on it; expected "
            f"no access to full values outside a step. {_FIX}")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        mine = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, ShardedParameter)]
        raise mine[0]._error(f"torch op {func.overloadpacket.__name__!r}")

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"ShardedParameter({self._sl_name}, shape={tuple(self.shape)}, dtype={self.dtype}: sharded over "
                f"{self._sl_axis!r} between steps; see engine.gathered())")

    def _raiser(what: str):           # builds the methods below
        def method(self, *args, **kwargs):
            raise self._error(what)
        return method

    tolist = _raiser(".tolist()")
    item = _raiser(".item()")
    numpy = _raiser(".numpy()")
    __array__ = _raiser("numpy.asarray()")
    data_ptr = _raiser(".data_ptr()")
    untyped_storage = _raiser(".untyped_storage()")
    storage = _raiser(".storage()")
    __reduce_ex__ = _raiser("pickling (torch.save)")
    __deepcopy__ = _raiser("copy.deepcopy")
    del _raiser


class ParamAccess:
    """Parameter access between steps, a part of the engine: what the modules hold (the compute
    parameters, ZeRO-3's resting placeholders, or full values inside ``gathered``), and full values on
    request. Built with what it reads: the model, this rank's plan and the whole-mesh one (its pipeline
    stages), the mesh, the parameters' states, ZeRO-3's units, and ``offload_mapped`` (which makes
    offloaded masters readable)."""

    def __init__(self, model: nn.Module, plan: Plan, global_plan: Plan, mesh: Mesh, states: list[ParamState],
                 units: UnitRunner | None, offload_mapped: Callable[[], AbstractContextManager[None]]):
        self.model, self.plan, self.global_plan, self.mesh = model, plan, global_plan, mesh
        self.states, self.units, self.offload_mapped = states, units, offload_mapped
        # ZeRO-3: placeholders in the modules, and hooks that swap the real parameters in for a forward
        # called outside ``step`` and refuse ``state_dict``/``load_state_dict`` at rest
        self.mode = "compute"          # what the modules hold: compute | resting | gathered
        self._direct_forward = False
        self._resting: dict[str, torch.Tensor] | None = None
        if plan.states.params is None:
            return                              # the modules' parameters are always full
        self._resting = {s.name: ShardedParameter(s.param, self._owner_names(s), plan.data_axis) for s in states}
        self._handles = [
            model.register_forward_pre_hook(self._direct_pre, prepend=True),
            model.register_forward_hook(self._direct_post),
            model.register_state_dict_pre_hook(self._state_dict_pre),
            model.register_load_state_dict_pre_hook(self._load_state_dict_pre),
        ]
        self._expose("resting")

    def _owner_names(self, s) -> str:
        names = {id(mod): name for name, mod in self.model.named_modules(remove_duplicate=False)}
        quals = [f"{names[id(mod)]}.{attr}" if names[id(mod)] else attr for mod, attr in s.owners]
        return quals[0] + (f" (also {', '.join(quals[1:])})" if len(quals) > 1 else "")

    def _install(self, values: dict[str, torch.Tensor]) -> None:
        for s in self.states:
            for mod, attr in s.owners:
                mod._parameters[attr] = values[s.name]

    def _expose(self, mode: str) -> None:
        """Make the modules hold the compute parameters or the resting placeholders (ZeRO-3)."""
        if self._resting is None or mode == self.mode:
            self.mode = mode if self._resting is not None else "compute"
            return
        self._install({s.name: s.param for s in self.states} if mode == "compute" else self._resting)
        self.mode = mode

    @contextmanager
    def stepping(self) -> Iterator[None]:
        if self.mode == "gathered":
            raise ShardingError("step: called inside `with engine.gathered():` — expected the step outside it. "
                                "Leave the block first (writable=True writes edits back on exit).")
        self._expose("compute")
        try:
            yield
        finally:
            self._expose("resting")

    def _direct_pre(self, module, args) -> None:
        if self.mode == "resting":          # model(x) called outside step (evaluation)
            self._direct_forward = True
            self._expose("compute")

    def _direct_post(self, module, args, output) -> None:
        if not self._direct_forward:
            return
        self._direct_forward = False
        if not torch.is_grad_enabled():             # nothing saved for a backward: free what it gathered
            for u in self.units.all:
                if u.status == "gathering":
                    self.units.wait(u)
                self.units.free(u)
        self._expose("resting")

    def _state_dict_pre(self, module, prefix, keep_vars) -> None:
        if self.mode == "resting":
            raise ShardingError(
                f"model.state_dict(): under ZeRO-3 the parameters are sharded over {self.plan.data_axis!r} between "
                "steps — got a call outside a step, where this rank holds only its part of each parameter (a "
                "saved file would not load); expected full values. Use engine.full_state_dict() (every parameter "
                "and buffer, full, the same on every rank), or call model.state_dict() inside "
                "`with engine.gathered():`.")

    def _load_state_dict_pre(self, module, state_dict, prefix, *args) -> None:
        if self.mode == "resting":
            raise ShardingError(
                f"model.load_state_dict(): under ZeRO-3 the parameters are sharded over {self.plan.data_axis!r} "
                "between steps — got a call outside a step, where the modules hold no full parameters to load "
                "into; expected full parameters. Load inside `with engine.gathered(writable=True): "
                "model.load_state_dict(sd)` on every rank (the values are written to the shards on exit).")

    # ---- full values ---------------------------------------------------------------------------
    def replicated(self, s) -> torch.Tensor | None:
        """The full value this rank already holds exactly, or None where it holds only its part.
        Decided by the plan alone, so every rank takes the same branch (and collectives match)."""
        states = self.plan.states
        if s.trainable and states.optim is None:
            return s.master                          # full fp32 master (the parameter itself in fp32)
        if states.params is None and (not self.plan.mixed or not s.trainable):
            return s.param                           # the full copy is exact (fp32), or the only one
        return None

    @torch.no_grad()
    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 value as new tensors, the same on every rank (collective).

        Where each rank holds a part (``ParamState.local_piece``: elements ``[lo, hi)`` of the flattened
        parameter, from its flat slot), every rank lays its parts end to end and one all-gather over the
        data axis brings everyone's (an all-gather's bytes: each element crosses the ring once); each
        rank's parts are placed at their ranges, which the plan gives for every rank alike."""
        out, parts = {}, []
        for s in self.states:
            if s.plan.quant is not None:
                out[s.name] = self._dequantized(s)
                continue
            full = self.replicated(s)
            if full is not None:
                out[s.name] = full.detach().to(torch.float32, copy=True).view(s.plan.shape)
            else:
                parts.append(s)
        if not parts:
            return out
        # each kind of part over its own axes (data; with an expert axis data x expert: Plan.shard_axes)
        by_axes: dict[tuple[str, ...], list] = {}
        for s in parts:
            by_axes.setdefault(self.mesh.canonical_axes(self.plan.shard_axes(s.name)), []).append(s)
        for axes, group in by_axes.items():
            self._gather_parts(axes, group, out)
        return out

    def _gather_parts(self, axes: tuple[str, ...], parts: list, out: dict[str, torch.Tensor]) -> None:
        """Every rank's pieces of ``parts`` laid end to end, one all-gather over ``axes``, each placed at its
        range of its parameter (the plan gives every rank's ranges alike)."""
        members = self.mesh.group_ranks(self.mesh.rank, axes)
        flat = self.plan.flat
        ranges = [[flat.piece(s.name, r) for s in parts] for r in members]
        width = max(sum(hi - lo for lo, hi in rs) for rs in ranges)
        mine = torch.zeros(width, dtype=torch.float32, device=self.mesh.device)
        offset = 0
        for s in parts:
            piece = s.master if s.master is not None else s.shard
            mine[offset:offset + piece.numel()].copy_(piece.reshape(-1))
            offset += piece.numel()
        everyone = comm.all_gather(mine, self.mesh, axes).view(len(members), width)
        for s in parts:
            out[s.name] = torch.empty(s.plan.shape, dtype=torch.float32, device=self.mesh.device)
        for j, rs in enumerate(ranges):
            offset = 0
            for s, (lo, hi) in zip(parts, rs):
                out[s.name].view(-1)[lo:hi].copy_(everyone[j, offset:offset + hi - lo])
                offset += hi - lo

    def _dequantized(self, s) -> torch.Tensor:
        """A quantized weight's tensor shard in fp32: under ZeRO-3 its packed bytes are summed over
        ``data`` into zeros as integers (each byte held by one rank: exact), then dequantized."""
        return formats.dequantize(quant_shard(self.mesh, self.plan, s)[0]).to(torch.float32)

    @torch.no_grad()
    def write_back(self, values: dict[str, torch.Tensor]) -> None:
        """Store full fp32 ``values`` in every tensor that holds each parameter, in its dtype (a
        quantized frozen weight is never rewritten: its codes are what it is)."""
        states = self.plan.states
        for s in self.states:
            if s.plan.quant is not None:
                continue
            f = values[s.name]
            if states.params is None or s.param.untyped_storage().nbytes() > 0:
                s.param.data.copy_(f)                # full compute copy (or a ZeRO-3 unit left gathered)
            if s.master is not None:
                s.master.data.copy_(f if states.optim is None else s.local_piece(f))
            if s.shard is not None:
                s.shard.copy_(s.local_piece(f))

    @contextmanager
    def gathered(self, writable: bool = False) -> Iterator[nn.Module]:
        """Inside, the model holds every parameter as a full fp32 tensor (new tensors, the same on
        every rank). ``writable=False``: edits are discarded on exit. ``writable=True``: on exit the
        values the model holds are written to the fp32 masters and the compute-dtype copies (each
        rank its part where sharded); edits must be the same on every rank. A collective: every
        rank enters. Yields the model."""
        if problem := flag(writable, "gathered: writable"):
            raise ShardingError(f"{problem}.")
        if self.mode == "gathered":
            raise ShardingError("gathered: already inside `with engine.gathered():` — expected one at a time. "
                                "Use the outer block.")
        previous = self.mode
        with self.offload_mapped():
            values = self.full_params()
        params = {s.name: nn.Parameter(values[s.name], requires_grad=s.param.requires_grad) for s in self.states}
        self._install(params)
        self.mode = "gathered"
        try:
            yield self.model
            if writable:
                held = {}
                for s in self.states:
                    mod, attr = s.owners[0]
                    t = mod._parameters[attr]
                    if t is None or tuple(t.shape) != s.plan.shape:
                        raise ShardingError(
                            f"gathered: {self._owner_names(s)} was replaced inside the block by "
                            f"{None if t is None else tuple(t.shape)} — expected a tensor of its shape "
                            f"{s.plan.shape}. Edit values in place (p.copy_(...)) or keep the shape.")
                    held[s.name] = t.detach().float().contiguous()
                with self.offload_mapped():
                    self.write_back(held)
        finally:
            self._install({s.name: s.param for s in self.states})
            self.mode = "compute"
            self._expose(previous)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` of the unsharded model: every parameter as a full fp32 tensor (the
        masters' values), every buffer (rank 0's, broadcast: the same on every rank), keyed as the
        model's own ``state_dict`` (tied parameters under each name). Loads with ``strict=True`` into
        a fresh single-process model. A collective: every rank calls it."""
        with self.gathered():
            installed = {id(mod._parameters[attr]) for s in self.states for mod, attr in s.owners}
            raw = self.model.state_dict(keep_vars=True)
        out, buffers = {}, []
        whole = self._untensor(raw)        # split over tensor: every rank gathers the full parameter
        for k, v in raw.items():
            if isinstance(v, torch.Tensor) and id(v) in installed:
                out[k] = whole.get(id(v), v).detach()
            elif isinstance(v, torch.Tensor) and v.is_meta:
                out[k] = None              # another pipeline stage's parameter: filled below
            elif isinstance(v, torch.Tensor):
                out[k] = v.detach().clone()
                buffers.append(out[k])
            else:
                out[k] = v
        broadcast_coalesced(buffers, self.mesh, self.plan.dp_axes)
        if self.global_plan.pipe_size > 1:
            self._gather_stages(out, [k for k, v in raw.items() if isinstance(v, torch.Tensor) and id(v) not in installed
                                      and not v.is_meta])
        return out

    def _gather_stages(self, out: dict, buffers: list[str]) -> None:
        """Fill in the other pipeline stages' parameters and the buffers of their blocks (a router's balancing
        bias: each stage updates its own): each pipe coordinate broadcasts its stages' full fp32 parameters and
        its blocks' buffers, laid end to end, over the pipe axis."""
        gplan = self.global_plan
        pp = gplan.pipeline
        me = self.mesh.coord(self.mesh.rank, pp.axis)
        first = {id(p): k for k, p in self.model.named_parameters()}
        aliases: dict[str, list[str]] = {}
        for k, p in self.model.named_parameters(remove_duplicate=False):
            aliases.setdefault(first[id(p)], []).append(k)
        stacked = [k for k in buffers if k.startswith(pp.stack + ".")]
        for c in range(pp.size):
            mine = {s.index for s in pp.stages_of(c)}
            items = [(p.name, p.shape, p.numel) for p in gplan.params if pp.stage_of(p.name) in mine]
            items += [(k, tuple(out[k].shape), out[k].numel()) for k in stacked if pp.stage_of(k) in mine]
            total = sum(n for _, _, n in items)
            if c == me:
                buf = torch.cat([out[k].reshape(-1).float() for k, _, _ in items]) if items else torch.zeros(0)
            else:
                buf = torch.empty(total, dtype=torch.float32, device=self.mesh.device)
            buf = comm.broadcast(buf, self.mesh, (pp.axis,), src=c)
            if c == me:
                continue
            off = 0
            for name, shape, numel in items:
                value = buf[off:off + numel].view(shape).clone()
                off += numel
                if name in out and name in stacked:
                    out[name] = value.to(out[name].dtype)
                    continue
                for k in aliases.get(name, [name]):
                    out[k] = value

    def _untensor(self, raw: dict) -> dict[int, torch.Tensor]:
        """``id(local value) -> full value`` of every parameter split over tensor, gathered from
        the tensor shards (uneven and fused ones too) by the redistribution planner, in plan order
        on every rank (the collectives match)."""
        if self.plan.tensor_size == 1 and self.plan.expert_size == 1:
            return {}
        done: dict[int, torch.Tensor] = {}
        for s in self.states:
            pp = s.plan
            if pp.full_shape is None or pp.full_shape == pp.shape:
                continue
            v = raw[s.name]
            if id(v) in done:
                continue
            # a fused dim gathers in its blocked view (``Layout.unfused``), where the shard is one box
            shape, lay = Layout(self.mesh, pp.spec).unfused(pp.full_shape)
            local = v.detach().contiguous().view(lay.local_shape(shape, self.mesh.rank))
            done[id(v)] = redistribute(local, lay, Layout(self.mesh, PartitionSpec()), shape).view(pp.full_shape)
        return done
