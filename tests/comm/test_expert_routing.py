"""Token routing over an ``expert`` axis as a redistribution (``comm/experts.py``): the reference GPT's MoE
layer with its experts split over ``expert`` (and the batch over data × expert) equals the whole layer on the
whole batch in one process — outputs, the global load-balancing loss, and the gradients of the input, the
router and every expert's weights — on real gloo worlds, with uneven routing (some experts get no row).

The reference is the same layer on one process, computed on every rank from the same seed; each rank's
loss term is ``Σ out·G`` over its rows plus its share of the aux loss, so the terms add up to the
single-process loss."""

from __future__ import annotations

import pytest
import torch

import shardlib as sl
from shardlib.comm.experts import batch_sum, combine, dispatch
from shardlib.models.gpt import GPTConfig
from shardlib.models.moe import MoE

CASES = {          # mesh, top_k, shared experts, renormalized top-k
    "expert2": ({"expert": 2}, 2, 0, True),
    "expert4_top1": ({"expert": 4}, 1, 1, False),
    "data2_expert2": ({"data": 2, "expert": 2}, 2, 1, True),
}


def _layer(top_k: int, shared: int, norm: bool) -> tuple[MoE, GPTConfig]:
    cfg = GPTConfig(d_model=16, n_experts=8, top_k=top_k, expert_width=24, shared_experts=shared, norm_topk=norm)
    torch.manual_seed(0)
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer, cfg


def _routed_layer(shape: dict, top_k: int, shared: int, norm: bool):
    """On every rank: the reference's loss, gradients and aux; this rank's own from the split layer."""
    mesh = sl.Mesh(shape)
    ref, cfg = _layer(top_k, shared, norm)
    g = torch.Generator().manual_seed(1)
    batch_axes = tuple(a for a in shape)                     # the batch over data x expert
    nb = mesh.size
    x = torch.randn(nb * 6, 16, generator=g)
    x[:, 0] += torch.arange(nb * 6) % 3 * 4.0                # skewed routing: some experts chosen by no row
    cot = torch.randn(nb * 6, 16, generator=g)
    xr = x.clone().requires_grad_()
    out = ref(xr)
    (out * cot).sum().add(0.5 * ref.aux_loss).backward()
    want = {"out": out.detach(), "aux": ref.aux_loss.detach(), "x": xr.grad,
            **{n: p.grad for n, p in ref.named_parameters()}}

    layer, _ = _layer(top_k, shared, norm)
    coord = mesh.coord(mesh.rank, "expert")
    per = cfg.n_experts // shape["expert"]
    with torch.no_grad():                                    # this rank's experts: rows of dim 0
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(layer.experts, name)
            setattr(layer.experts, name, torch.nn.Parameter(full[coord * per:(coord + 1) * per].clone()))
    forward = layer.experts.forward

    sent = []

    def routed(hidden, index, weights):
        rows, local, w, r = dispatch(hidden, index, weights, cfg.n_experts, mesh, "expert")
        sent.append(r.in_splits)
        return combine(forward(rows, local[:, None], w[:, None]), r)

    layer.experts.forward = routed
    layer.reduce_stats = lambda t: batch_sum(t, mesh, batch_axes)
    i = mesh.group_index(mesh.rank, batch_axes)
    mine = slice(i * 6, (i + 1) * 6)
    xm = x[mine].clone().requires_grad_()
    got = layer(xm)
    (got * cot[mine]).sum().add(0.5 * layer.aux_loss / nb).backward()
    return {"want": want, "out": got.detach(), "aux": layer.aux_loss.detach(), "x": xm.grad, "coord": coord,
            "sent": sent[0], "per": per,
            "grads": {n: p.grad for n, p in layer.named_parameters()}}


@pytest.mark.parametrize("case", CASES)
def test_routed_moe_layer_equals_one_process(world, case):
    shape, top_k, shared, norm = CASES[case]
    n = 1
    for s in shape.values():
        n *= s
    res = world(n, _routed_layer, shape, top_k, shared, norm)
    want = res[0]["want"]
    out = torch.cat([r["out"] for r in res])
    torch.testing.assert_close(out, want["out"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([r["x"] for r in res]), want["x"], rtol=1e-5, atol=1e-6)
    for r in res:
        torch.testing.assert_close(r["aux"], want["aux"], rtol=1e-6, atol=0)
    # replicated parameters (router, shared experts): this rank's gradients summed over the batch's ranks
    for name in want:
        if name.startswith(("gate.", "shared.")):
            torch.testing.assert_close(sum(r["grads"][name] for r in res), want[name], rtol=1e-5, atol=1e-5)
    # each expert's weights: held by one coordinate of expert, their gradients summed over data
    for name in ("experts.gate_up_proj", "experts.down_proj"):
        per = res[0]["per"]
        for c in range(shape["expert"]):
            got = sum(r["grads"][name] for r in res if r["coord"] == c)
            torch.testing.assert_close(got, want[name][c * per:(c + 1) * per], rtol=1e-5, atol=1e-5)
    # routing moved rows between ranks, and the skew left some expert with no row at all (an empty expert
    # still runs: its weights' gradients are zeros, held by its rank, as in one process)
    assert all(sum(r["sent"]) == 6 * top_k for r in res)
    assert any(c != r["coord"] and k > 0 for r in res for c, k in enumerate(r["sent"]))
    idle = (want["experts.down_proj"] == 0).all(dim=(1, 2))
    assert idle.any() and not idle.all(), idle


def _no_rows_here() -> dict:
    """Every token chooses an expert of coordinate 0: coordinate 1's experts get no row, and an experts module
    that runs only the experts a row chose (transformers' loop over the experts hit) returns zeros with no path
    to what was dispatched to it. The backward still runs the dispatch's transposed all-to-alls on both ranks
    (combine attaches the rows and weights): it completes, with one process's input and weight gradients."""
    mesh = sl.Mesh({"expert": 2})
    torch.manual_seed(0)
    w = torch.randn(4, 8, 8)                               # 4 experts [out, in]; this rank holds 2
    x = torch.randn(6, 8)
    index = torch.tensor([[0], [1], [0], [1], [1], [0]])   # experts 0 and 1 only: coordinate 0's
    weights = torch.rand(6, 1)

    def loop(rows, chosen, wts, mine):                     # as transformers' experts: only the experts hit
        out = torch.zeros_like(rows)
        for e in chosen.unique().tolist():
            sel = (chosen[:, 0] == e).nonzero()[:, 0]
            out = out.index_add(0, sel, rows[sel] @ mine[e].t() * wts[sel])
        return out

    xr, wr, ww = x.clone().requires_grad_(), weights.clone().requires_grad_(), w.clone().requires_grad_()
    want = loop(xr, index, wr, ww)
    want.sum().backward()
    coord = mesh.coord(mesh.rank, "expert")
    mine = w[coord * 2:(coord + 1) * 2].clone().requires_grad_()
    xs, ws = x[coord * 3:(coord + 1) * 3].clone().requires_grad_(), weights[coord * 3:(coord + 1) * 3].clone().requires_grad_()
    rows, local, wd, routed = dispatch(xs, index[coord * 3:(coord + 1) * 3], ws, 4, mesh, "expert")
    got = combine(loop(rows, local[:, None], wd[:, None], mine), routed, rows, wd)
    got.sum().backward()
    return {"rows": rows.shape[0], "x": (xs.grad, xr.grad[coord * 3:(coord + 1) * 3]),
            "w": (torch.zeros_like(mine) if mine.grad is None else mine.grad, ww.grad[coord * 2:(coord + 1) * 2]), "weights": (ws.grad, wr.grad[coord * 3:(coord + 1) * 3])}


def test_a_rank_whose_experts_get_no_row_still_runs_the_backward_moves(world):
    res = world(2, _no_rows_here)
    assert [r["rows"] for r in res] == [6, 0]
    for r in res:
        for what in ("x", "w", "weights"):
            got, want = r[what]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=what)
