"""Checks of a pipeline plan that span its stages: weights tied across stages, and the combinations of a
schedule with ZeRO-3's gather policy and recompute (``planner/pipeline.py``'s ``derive`` runs them)."""

from __future__ import annotations

from collections.abc import Sequence


def tied_across_stages(ranges: list[range], block_params: list[list[tuple[str, object]]],
                       pre_params: list[tuple[str, object]], post_params: list[tuple[str, object]],
                       canonical: dict[int, str], *, zero3: bool) -> tuple[list[str], list[str]]:
    """``(the weights tied across the first and the last stage, problems)``: a tensor held by two stages is
    allowed only on the first and the last (Megatron's embedding group), and not under ZeRO-3."""
    n_stages = len(ranges)
    owner: dict[int, tuple[int, str]] = {}
    tied: list[str] = []
    problems: list[str] = []
    for s, r in enumerate(ranges):
        held = [*(pre_params if s == 0 else ()), *(ps for i in r for ps in block_params[i]),
                *(post_params if s == n_stages - 1 else ())]
        for pname, t in held:
            prev = owner.setdefault(id(t), (s, pname))
            if prev[0] == s:
                continue
            if (prev[0], s) == (0, n_stages - 1) and zero3:
                problems.append(f"plan: parameter {pname!r} is the same tensor as {prev[1]!r} (tied), on the first "
                                "and last stages, under ZeRO-3 — the two stages would shard it at rest inside "
                                "different units, so their pieces of it differ and cannot be summed. Use zero=2 (or "
                                "less) with the pipe axis, untie them (tie_word_embeddings=False), or plan without "
                                "the pipe axis.")
            elif (prev[0], s) == (0, n_stages - 1):
                # Megatron's embedding group: one tensor held by the first and the last stage, its two
                # gradients summed once a step (runtime/pipeline.py), the same update on both
                tied.append(canonical[id(t)])
            else:
                problems.append(f"plan: parameter {pname!r} is the same tensor as {prev[1]!r} (tied), on stages "
                                f"{prev[0]} and {s} — expected a weight shared only by the first and the last stage "
                                "(tied embeddings); another pair of stages cannot hold one tensor. Untie them, or cut "
                                "the stack so both uses fall on one stage (stages=...), or plan without the pipe axis.")
    return list(dict.fromkeys(tied)), problems


def combination_problems(schedule: str, *, zero3: bool, gather: str, reshard: bool, recompute: Sequence[str],
                         stage_modules: set[str]) -> list[str]:
    """A schedule against ZeRO-3's gather policy, ``reshard_after_forward`` and the recomputed units
    (``stage_modules``: the blocks and the modules before and after the stack)."""
    problems: list[str] = []
    if zero3 and gather == "microbatch":
        if schedule == "zb_h1":
            problems.append("plan: pipe_gather='microbatch' reduce-scatters a unit's gradients when its backward "
                            "reaches the unit's inputs, but schedule 'zb_h1' computes weight gradients later (W) — "
                            "expected pipe_gather='step' with zb_h1 (its gradients are reduced once per step), "
                            "or another schedule.")
        if not reshard:
            problems.append("plan: pipe_gather='microbatch' frees each unit after its forward, but "
                            "reshard_after_forward=False keeps units gathered until their backward — expected "
                            "reshard_after_forward=True, or pipe_gather='step' to keep a stage gathered "
                            "through the step.")
    if schedule == "zb_h1":
        rec = [u for u in recompute if u in stage_modules]
        if rec:
            problems.append(f"plan: schedule 'zb_h1' splits each backward into an input-gradient part (I) and a "
                            f"weight-gradient part (W), but units {rec[:4]} recompute their forward inside backward, "
                            "whose weight gradients cannot be split from it — expected no recompute with zb_h1. "
                            "Drop recompute, or use schedule='1f1b'.")
    return problems
