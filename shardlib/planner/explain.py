"""Printing a ``Plan``: ``explain()``. Mixed into ``Plan``."""

from __future__ import annotations

from ..comm.core import format_bytes


class Explain:
    def explain(self, max_params: int = 40) -> str:
        n = self.data_size
        stage = f"ZeRO-{self.zero}" if self.zero else ("data parallel" if self.zero == 0 else "custom")
        lines = [f"Plan: {stage} over {self.data_axis!r} (N={n}) on mesh {self.mesh.axis_sizes}; "
                 f"{self.precision} compute, {str(self.reduce_dtype).replace('torch.', '')} reduction, "
                 f"grad_accum={self.grad_accum}, clip={self.clip_grad_norm}",
                 f"  states: params at rest {_spec(self.states.params)}, grads {_spec(self.states.grads)}, "
                 f"optimizer {_spec(self.states.optim)}, local grads "
                 f"{'kept' if self.states.keep_local_grads else 'freed after reduction'}",
                 f"  batch: {self.batch.spec} (dim 0 over {self.data_axis!r})",
                 "  units: " + ", ".join(f"{u.name or '<root>'}({len(u.params)})"
                                          + ("*" if u.recompute else "") for u in self.units)
                 + ("   (* = recomputed in backward)" if any(u.recompute for u in self.units) else ""),
                 "", f"  {'parameter':<32} {'shape':<14} {'unit':<10} {'rest':<6} {'compute':<8} "
                 f"{'grad':<6} {'optim':<6}"]
        for p in self.params[:max_params]:
            lines.append(f"  {p.name:<32} {str(list(p.shape)):<14} {p.unit or '<root>':<10} "
                         f"{p.rest.short():<6} {p.compute.short():<8} {p.grad.short():<6} {p.optim.short():<6}")
        if len(self.params) > max_params:
            lines.append(f"  ... and {len(self.params) - max_params} more")
        mem, formula = self.memory_per_rank(), self.zero_formula()
        lines += ["", f"  model states per rank (Ψ = {self.num_params:,} parameters):"]
        for k in ("params", "grads", "optimizer", "total"):
            lines.append(f"    {k:<10} {format_bytes(mem[k]):>10}   (ZeRO formula {format_bytes(formula[k])})")
        if self.states.params is not None:
            lines.append(f"    gathered   {format_bytes(self.transient_per_rank()['gathered']):>10}   "
                         "(transient peak of gathered units and gather buffers, in this order:)")
            lines.append("      " + " ".join(self.gather_schedule()))
        lines += ["", "  collectives per step (bytes sent per rank):"]
        lines += [f"    {e}" for e in self.comm_per_step()] or ["    none (one rank)"]
        lines.append(f"    total {format_bytes(self.comm_bytes_per_step())}; params+grads "
                     f"{format_bytes(self.comm_bytes_per_step('params') + self.comm_bytes_per_step('grads'))} "
                     f"vs ring minimum {format_bytes(self.ring_minimum())}")
        return "\n".join(lines)


def _spec(axis: str | None) -> str:
    return f"S({axis})" if axis else "R"
