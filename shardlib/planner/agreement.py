"""What every rank's plan must agree on, field by field, for the engine's set-up check.

Each rank builds its own plan (``sl.plan`` on its process); a rank-dependent config — another schedule or
micro-batch count on one pipe rank, another ZeRO stage, a rule missing on one host — gives ranks plans whose
collectives and messages do not pair, and they fail later, far from the cause (a pipe rank waiting on a message
of another size, a gather of another shape). ``fields`` states the plan's rank-independent facts as text, one
per field; the engine compares their CRCs across the mesh once, before its first set-up collective
(``runtime/parted.check_agreement``), so a mismatch names the field and the ranks on each side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan

FIELDS = ("mesh", "parameters", "training", "units", "pipeline", "tensor", "memory", "experts")


def fields(plan: Plan) -> list[tuple[str, str]]:
    """``(field, its text)`` for each of ``FIELDS``, from the whole plan (not a stage's or coordinate's view)."""
    mesh = plan.mesh
    pp, tp = plan.pipeline, plan.tensor
    st = plan.states
    out = {
        "mesh": ", ".join(f"{a}={mesh.axis_sizes[a]}" for a in mesh.axis_names),
        "parameters": "; ".join(f"{p.name} {tuple(p.shape)} {p.spec} {'trained' if p.trainable else 'frozen'}"
                                f"{' ' + repr(p.quant) if p.quant is not None else ''}" for p in plan.params),
        "training": (f"precision {plan.precision}, reduce {str(plan.reduce_dtype).replace('torch.', '')}, "
                     f"micro-batches {plan.grad_accum}, clip {plan.clip_grad_norm}, ZeRO params {st.params} "
                     f"grads {st.grads} optimizer {st.optim}, buckets {plan.bucket_bytes}"),
        "units": "; ".join(f"{u.name or '<root>'}{' recomputed' if u.recompute else ''}"
                           f"{' selective' if u.selective else ''}" for u in plan.units),
        "pipeline": ("none" if pp is None else
                     f"{pp.schedule}, {pp.microbatches} micro-batches, {pp.size} x {pp.virtual} stages: "
                     + " | ".join(",".join(s.blocks) for s in pp.stages) + f", gather {pp.gather}"),
        "tensor": ("none" if tp is None else
                   f"{tp.size} ranks, sequence parallel {tp.sequence_parallel}: "
                   + ", ".join(f"{s.module} {s.kind}" for s in tp.sites)),
        "memory": f"offload {dict(plan.offload)}, delayed {plan.delayed}",
        "experts": ", ".join(f"{x.name} {x.experts}" for x in plan.expert_layers) or "none",
    }
    return [(k, out[k]) for k in FIELDS]
