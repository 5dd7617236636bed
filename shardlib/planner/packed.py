"""Packed projections: the layouts whose forward fixes which output features are which, so that a tensor
split must respect them — and the per-head modules a split attention cannot localize.

A column's output is consumed by model code that slices it. A packed ``q|k|v`` split *plainly* gives rank 0
only queries (GPT-2's ``c_attn``), and one split as ``Fused(3)`` when its heads are interleaved gives each
rank a wrong mixture (BLOOM's ``query_key_value``). Nothing in a weight's shape tells the two apart: the
forward does. ``PACKED`` names the known layouts by module class and attribute (what transformers' own
``packed_colwise`` says of its fused weights); a split of one of them with another block count is refused
at plan time, naming the layout and the spec it needs. A packed projection of a class not listed here is
taken as the table writes it.

``per_head_problems``: an attention whose heads are split but which holds one module per head (StableLM's
``qk_layernorm``: a ``ModuleList`` the forward zips with the heads) or a weight with a row per head (Cohere's
``use_qk_norm``: ``(heads, head_dim)``) would apply the first heads' parameters to this rank's heads: refused,
naming the module (keep the attention replicated).
"""

from __future__ import annotations

from torch import nn

# (module class, projection attribute) -> (equal blocks a split must keep, what the forward reads)
PACKED: dict[tuple[str, str], tuple[int, str]] = {
    ("GPT2Attention", "c_attn"): (3, "q | k | v end to end (split by split_size)"),
    ("MptAttention", "Wqkv"): (3, "q | k | v end to end (chunk(3))"),
    ("Phi3Attention", "qkv_proj"): (3, "q | k | v end to end (sliced by the query and KV widths)"),
    ("CodeGenAttention", "qkv_proj"): (12, "4 chunks (its forward's fixed mp_num = 4), each q | v | k of a "
                                           "quarter of the heads"),
    ("CodeGenAttention", "out_proj"): (4, "the 4 chunks' heads in turn (in features, a row)"),
    ("BloomAttention", "query_key_value"): (1, "q k v of head 0, then of head 1, ... (interleaved per head)"),
    ("GPTNeoXAttention", "query_key_value"): (1, "q k v of head 0, then of head 1, ... (interleaved per head)"),
    ("FalconAttention", "query_key_value"): (1, "the queries, k and v of each KV group in turn (interleaved)"),
    ("Phi3MLP", "gate_up_proj"): (2, "gate | up end to end (chunk(2))"),
    ("GlmMLP", "gate_up_proj"): (2, "gate | up end to end (chunk(2))"),
}
# how many chunks of the heads the blocks hold (CodeGen's 4): each chunk's heads must split whole
HEAD_BLOCKS = {("CodeGenAttention", "qkv_proj"): 4}
ROWS = {("CodeGenAttention", "out_proj")}        # packed in-features: a row's


def packed_problem(holder: nn.Module, holder_name: str, attr: str, weight: str, spec: str, parts: int,
                   heads: int | None, kv: int | None, size: int, axis: str, conv: bool = False,
                   row: bool = False) -> str:
    """Why the split ``spec`` (``parts`` equal blocks; 1: plain) of projection ``attr`` of ``holder`` (a
    ``Conv1D`` with ``conv``) does not match the layout its forward reads ("" when it does, or when the
    layout is not known). ``heads``/``kv``: the holder's query and KV head counts; ``row``: split as a row
    (in-features)."""
    key = (type(holder).__name__, attr)
    if key not in PACKED:
        return ""
    want, layout = PACKED[key]
    where = f"{key[0]} {holder_name or '<root>'!r}"
    entry = f"Fused({want}, {axis!r})" if want > 1 else repr(axis)
    need = f"P(None, {entry})" if conv != (key in ROWS) else f"P({entry}, None)"
    if row != (key in ROWS):
        return (f"plan: {weight} is {spec}: a {'row' if row else 'column'} split, but the forward of {where} reads "
                f"{attr}'s {'output' if key not in ROWS else 'input'} as {layout} — expected {need}. Use it, or "
                f"keep {attr} replicated (P()).")
    if want == 3 and parts != 3 and heads is not None and kv is not None and heads != kv:   # (3: tensor.py's)
        return (f"plan: {weight} is {spec}, but the forward of {where} reads {attr}'s output as {layout}, with "
                f"{heads} query and {kv} KV heads: its blocks differ in width, so no split of the rows gives a "
                f"rank whole heads of each — expected {attr} replicated. Keep it and the row after it replicated "
                "(P()), or split q, k and v as separate projections.")
    if parts != want:
        return (f"plan: {weight} is {spec}, but the forward of {where} reads {attr}'s output as {layout}, so "
                f"each rank needs {'its chunk of each of ' + str(want) + ' equal blocks' if want > 1 else 'whole heads, contiguous'}"
                f" — expected {need} (sl.hf_dims(model) gives it). Use it, or keep {attr} and the row after it "
                "replicated (P()).")
    blocks = HEAD_BLOCKS.get(key, 1)
    if heads is not None and blocks > 1 and heads % (blocks * size):
        return (f"plan: {weight} is {spec}: {where} has {heads} heads in {blocks} blocks ({layout}), "
                f"{heads // blocks if heads % blocks == 0 else heads / blocks} per block, which {axis}={size} "
                f"ranks cannot split whole — expected heads divisible by {blocks * size}. Use a {axis} degree "
                f"dividing {heads // blocks if heads % blocks == 0 else 1}, or keep {attr} and the row after it "
                "replicated (P()).")
    return ""


def per_head_problems(name: str, mod: nn.Module, counts: set[int], projections: set[str], axis: str) -> list[str]:
    """The children of attention ``mod`` (heads split over ``axis``) holding a parameter per head — a
    ``ModuleList`` as long as a head count in ``counts``, or a weight of 2+ dims with a row per head — other
    than its split ``projections`` (their module names)."""
    out = []
    counts = {c for c in counts if c > 1}
    for cname, child in mod.named_children():
        full = f"{name}.{cname}" if name else cname
        if (full in projections or isinstance(child, nn.Linear) or type(child).__name__ == "Conv1D"
                or hasattr(child, "base_layer")):         # a projection, split or not (PEFT's wrapper too)
            continue
        lists = [m for m in child.modules() if isinstance(m, nn.ModuleList) and len(m) in counts]
        rows = [(n, tuple(p.shape)) for n, p in child.named_parameters() if p.dim() >= 2 and p.shape[0] in counts]
        if isinstance(child, nn.ModuleList) and len(child) in counts:
            lists = [child]
        if not (lists or rows):
            continue
        what = (f"holds {len(lists[0])} modules, one per head" if lists
                else f"holds {rows[0][0]} {rows[0][1]}, a row per head")
        out.append(f"plan: {type(child).__name__} {full!r} {what}, inside {type(mod).__name__} {name!r} whose heads "
                   f"are split over {axis!r}: each rank would apply the first heads' parameters to its own heads — "
                   f"expected no per-head parameters in a split attention. Keep the projections of {name!r} "
                   "replicated (P()) and split its MLP only (sl.hf_dims does so for this configuration).")
    return out
