"""Vocab-parallel cross-entropy and the ShardedLogits mode, on gloo worlds of 2 and 3 ranks.

Every rank builds the same full logits from one seed and keeps its vocab slice, computed here
independently of the library: ceil chunking, rank ``i`` of ``k`` holds ids ``[i·c, min((i+1)·c, V))``
with ``c = ceil(V/k)``. The reference is ``F.cross_entropy`` (or the model-side function) on the
full logits in this (single) process; gradients of the full logits are the ranks' local gradients
concatenated in rank order. Shapes are uneven on purpose: V=131 over 2 (66 + 65), V=10 over 3
(4 + 4 + 2), V=4 over 3 (2 + 2 + 0: an empty trailing shard).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import shardlib as sl

CASES = [(2, 131), (3, 10), (3, 4)]          # (tensor degree k, vocab V)
N = 12                                       # rows of the loss tests
IGNORE = -100
# (reduction, label_smoothing, ignore_index): ignore_index=1 is a real vocab id (on rank 0)
CONFIGS = [(r, eps, ii) for r in ("mean", "sum", "none") for eps in (0.0, 0.1) for ii in (IGNORE, 1)]


def _bounds(V: int, k: int, i: int) -> tuple[int, int]:
    c = -(-V // k)
    return min(i * c, V), min((i + 1) * c, V)


def _data(V: int, n: int, dtype: torch.dtype, seed: int, ignore_index: int = IGNORE):
    """Full logits, targets with some rows ignored, and a cotangent exact in bf16."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, V, generator=g) * 3).to(dtype)
    target = torch.randint(0, V, (n,), generator=g)
    target[torch.rand(n, generator=g) < 0.25] = ignore_index
    target[:2] = ignore_index
    cot = torch.randint(-4, 5, (n,), generator=g).float() / 4
    return logits, target, cot


def _ops(counter) -> dict[str, int]:
    return {op: n for op, (n, _) in counter.by_op().items()}


# ---------------------------------------------------------------------------------------------
# Workers (module level: pickled by reference into the pool)
# ---------------------------------------------------------------------------------------------

def _loss_worker(k: int, V: int, dtype: torch.dtype) -> list:
    from shardlib.runtime.vocab import vocab_parallel_cross_entropy
    from shardlib.testing import get_mesh
    mesh = get_mesh({"tensor": k})
    lo, hi = _bounds(V, k, mesh.rank)
    out = []
    for t, (reduction, eps, ii) in enumerate(CONFIGS):
        logits, target, cot = _data(V, N, dtype, seed=t, ignore_index=ii)
        x = logits[:, lo:hi].clone().requires_grad_(True)
        with sl.count_collectives() as fwd:
            loss = vocab_parallel_cross_entropy(x, target, mesh=mesh, axis="tensor", vocab_size=V, ignore_index=ii,
                                                reduction=reduction, label_smoothing=eps)
        with sl.count_collectives() as bwd:
            (loss * (cot if reduction == "none" else cot[0]).to(dtype)).sum().backward()
        out.append((loss.detach(), x.grad, _ops(fwd), _ops(bwd), [r.numel for r in fwd.records]))
    return out


class _PeakNumel(TorchDispatchMode):
    """The largest numel of any tensor an op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.peak = max(self.peak, t.numel())
        return out


def _peak_worker(k: int, V: int) -> dict:
    from shardlib.runtime.vocab import ShardedLogits
    from shardlib.testing import get_mesh
    mesh = get_mesh({"tensor": k})
    lo, hi = _bounds(V, k, mesh.rank)
    logits, target, _ = _data(V, N, torch.float32, seed=7)
    res = {}
    for path, loss_fn in (("vocab", lambda x: F.cross_entropy(x, target)),
                          ("fallback", lambda x: F.nll_loss(torch.log_softmax(x, -1), target))):
        x = logits[:, lo:hi].clone().requires_grad_(True)
        mode = ShardedLogits()
        with _PeakNumel() as peak:
            with mode:
                loss = loss_fn(mode.mark(x, mesh=mesh, axis="tensor", vocab_size=V))
            loss.backward()
        mode.clear()
        res[path] = (peak.peak, loss.detach(), x.grad)
    return res


# Model-side loss functions, written for FULL logits (B, T, V) and run unchanged on marked shards.

def _f_view_local(lg, y):
    return F.cross_entropy(lg.float().view(-1, lg.size(-1)), y.view(-1))


def _f_hf_causal(lg, y, V):      # transformers' ForCausalLMLoss: view(-1, vocab_size) with the FULL vocab
    lg = lg.float()
    labels = F.pad(y, (0, 1), value=IGNORE)[..., 1:].contiguous()
    lg = lg.view(-1, V)
    return F.cross_entropy(lg, labels.view(-1), ignore_index=IGNORE, reduction="sum") / 7.0


def _f_shift(lg, y):
    shift = lg[..., :-1, :].contiguous()
    return F.cross_entropy(shift.view(-1, shift.size(-1)), y[..., 1:].reshape(-1), reduction="none").sum()


def _f_module(lg, y):
    return nn.CrossEntropyLoss(label_smoothing=0.1)(lg.reshape(-1, lg.shape[-1]), y.flatten())


def _f_softcap_inplace(lg, y):   # Gemma-style soft-capping, then in-place edits that leave the vocab dim alone
    x = torch.tanh(lg.float() / 3.0) * 3.0
    x[:, 0] = 0.0
    x.mul_(2.0)
    return F.cross_entropy(x.flatten(0, 1), y.flatten())


def _f_softmax(lg, y):           # needs the whole vocab: gathered (correct, not memory-saving)
    p = torch.softmax(lg.float(), -1)
    w = torch.arange(p.shape[-1], dtype=p.dtype).sin()
    return (p * w).sum()


def _f_gathers(lg, y):          # argmax and a slice of the vocab gather; the loss stays vocab-parallel
    acc = (lg.argmax(-1) == y).float().mean()
    head = lg[..., :3].float().pow(2).mean()
    return F.cross_entropy(lg.float().flatten(0, 1), y.flatten()) + acc + head


MODE_FNS = {"view_local": _f_view_local, "hf_causal": _f_hf_causal, "shift": _f_shift, "module": _f_module,
            "softcap_inplace": _f_softcap_inplace, "softmax": _f_softmax, "gathers": _f_gathers}
GATHERS = {"softmax": 1, "gathers": 2}    # all-gathers forward; every loss path: 2 all-reduces forward


def _call(name: str, lg, y, V: int):
    return MODE_FNS[name](lg, y, V) if name == "hf_causal" else MODE_FNS[name](lg, y)


def _model_data(V: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(V)
    lg = (torch.randn(2, 5, V, generator=g) * 2).to(dtype)
    y = torch.randint(0, V, (2, 5), generator=g)
    y[0, 1] = y[1, 3] = IGNORE
    return lg, y


def _mode_worker(k: int, V: int, dtype: torch.dtype) -> dict:
    from shardlib.runtime.vocab import ShardedLogits
    from shardlib.testing import get_mesh
    mesh = get_mesh({"tensor": k})
    lo, hi = _bounds(V, k, mesh.rank)
    full, y = _model_data(V, dtype)
    out = {}
    for name in MODE_FNS:
        x = full[..., lo:hi].clone().requires_grad_(True)
        mode = ShardedLogits()
        with sl.count_collectives() as fwd, mode:
            loss = _call(name, mode.mark(x * 1, mesh=mesh, axis="tensor", vocab_size=V), y, V)
        mode.clear()
        with sl.count_collectives() as bwd:
            loss.backward()
        out[name] = (loss.detach(), x.grad, _ops(fwd), _ops(bwd))
    return out


def _marks_worker(k: int, V: int) -> dict:
    from shardlib.runtime.vocab import ShardedLogits
    from shardlib.testing import get_mesh
    mesh = get_mesh({"tensor": k})
    lo, hi = _bounds(V, k, mesh.rank)
    full, y = _model_data(V, torch.float32)
    mode = ShardedLogits()
    res = {}
    # a marked tensor is not kept alive by its mark
    x = full[..., lo:hi].clone()
    ref = weakref.ref(x)
    mode.mark(x, mesh=mesh, vocab_size=V)
    res["marked"] = mode.shard_of(x) is not None
    del x
    gc.collect()
    res["alive_after_del"] = ref() is not None
    # clear() forgets marks: F.cross_entropy on the shard is then plain (local) torch
    x = full[..., lo:hi].clone()
    mode.mark(x, mesh=mesh, vocab_size=V)
    mode.clear()
    with sl.count_collectives() as c, mode:
        softmax = torch.softmax(x, -1)
    res["after_clear"] = (mode.shard_of(x), _ops(c), softmax.shape[-1])
    # unmarked tensors inside the mode: untouched
    with mode:
        res["plain"] = F.cross_entropy(full.view(-1, V), y.view(-1))
    # unshard: the full tensor back, for outputs that leave the engine
    mode.mark(x, mesh=mesh, vocab_size=V)
    res["unshard"] = mode.unshard({"logits": x, "other": y})
    return res


def _errors_worker(k: int, V: int) -> dict:
    from shardlib.runtime.vocab import ShardedLogits, vocab_parallel_cross_entropy
    from shardlib.testing import get_mesh
    mesh = get_mesh({"tensor": k})
    lo, hi = _bounds(V, k, mesh.rank)
    full, y = _model_data(V, torch.float32)
    x2, y1 = full.view(-1, V)[:, lo:hi], y.view(-1)
    cases = {
        "weight": lambda: vocab_parallel_cross_entropy(x2, y1, mesh=mesh, vocab_size=V, weight=torch.ones(V)),
        "three_dims": lambda: vocab_parallel_cross_entropy(full[..., lo:hi], y, mesh=mesh, vocab_size=V),
        "full_logits": lambda: vocab_parallel_cross_entropy(full.view(-1, V), y1, mesh=mesh, vocab_size=V),
        "several": lambda: vocab_parallel_cross_entropy(full.view(-1, V), y1.float(), mesh=mesh, vocab_size=V,
                                                        reduction="avg"),
        "target_range": lambda: vocab_parallel_cross_entropy(x2, torch.full_like(y1, V), mesh=mesh, vocab_size=V),
        "mark_shape": lambda: ShardedLogits().mark(full, mesh=mesh, vocab_size=V),
        "unknown_axis": lambda: vocab_parallel_cross_entropy(x2, y1, mesh=mesh, axis="model", vocab_size=V),
    }
    out = {}
    for name, fn in cases.items():
        with sl.count_collectives() as c:
            try:
                fn()
                out[name] = None
            except Exception as e:   # noqa: BLE001 — the test checks the type
                out[name] = (type(e), str(e), len(c.records))
    mode = ShardedLogits()
    x = full[..., lo:hi].clone()
    with mode:
        mode.mark(x, mesh=mesh, vocab_size=V)
        try:
            x[..., 0] = 0.0           # writes one vocab id: cannot run on the shard, cannot gather
            out["setitem_vocab"] = None
        except Exception as e:        # noqa: BLE001
            out["setitem_vocab"] = (type(e), str(e), 0)
    return out


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

def _reference(logits, target, cot, reduction, eps, ii):
    full = logits.float().requires_grad_(True)
    ref = F.cross_entropy(full, target, ignore_index=ii, reduction=reduction, label_smoothing=eps)
    (ref * (cot if reduction == "none" else cot[0])).sum().backward()
    return ref.detach(), full.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,V", CASES, ids=[f"k{k}-V{V}" for k, V in CASES])
def test_loss_and_grad_equal_one_process(world, k, V, dtype):
    results = world(k, _loss_worker, k, V, dtype)
    for t, (reduction, eps, ii) in enumerate(CONFIGS):
        logits, target, cot = _data(V, N, dtype, seed=t, ignore_index=ii)
        ref, ref_grad = _reference(logits, target, cot, reduction, eps, ii)
        grad = torch.cat([results[r][t][1] for r in range(k)], dim=-1)
        where = f"{reduction=} {eps=} ignore_index={ii}"
        for r in range(k):
            loss, _, fwd, bwd, numels = results[r][t]
            assert loss.dtype == dtype and loss.shape == ref.shape, where
            if dtype == torch.float32:
                torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6, msg=where)
            else:   # fp32 math on the bf16 values, rounded once: within one bf16 ulp of the fp32 reference
                torch.testing.assert_close(loss.float(), ref, rtol=2 ** -7, atol=1e-6, msg=where)
            # forward: max, then ONE all-reduce of sum-exp + target logit (+ Σ logits with smoothing)
            assert fwd == {"all_reduce": 2} and bwd == {}, (where, fwd, bwd)
            assert numels == [N, (3 if eps else 2) * N], (where, numels)
        assert grad.dtype == dtype and grad.shape == ref_grad.shape
        if dtype == torch.float32:
            torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6, msg=where)
        else:
            torch.testing.assert_close(grad.float(), ref_grad, rtol=2 ** -7, atol=1e-6, msg=where)
            # and torch's own bf16 F.cross_entropy agrees at bf16 precision
            native = F.cross_entropy(logits, target, ignore_index=ii, reduction=reduction, label_smoothing=eps)
            torch.testing.assert_close(results[0][t][0], native, rtol=2e-2, atol=1e-2, msg=where)


@pytest.mark.parametrize("k,V", CASES[:2], ids=[f"k{k}-V{V}" for k, V in CASES[:2]])
def test_peak_tensor_is_a_shard_not_the_full_logits(world, k, V):
    results = world(k, _peak_worker, k, V)
    c = -(-V // k)
    assert N * c + 3 * N < N * V          # the bound below tells the two paths apart
    logits, target, _ = _data(V, N, torch.float32, seed=7)
    ref, ref_grad = _reference(logits, target, torch.ones(N), "mean", 0.0, IGNORE)
    for path in ("vocab", "fallback"):
        for r in range(k):
            torch.testing.assert_close(results[r][path][1], ref, rtol=1e-6, atol=1e-6)
        grad = torch.cat([results[r][path][2] for r in range(k)], dim=-1)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)
    for r in range(k):
        # the vocab-parallel loss never builds more than this rank's shard (+ O(N) row statistics)...
        assert results[r]["vocab"][0] <= N * c + 3 * N, (r, results[r]["vocab"][0], N * c)
        # ...while log_softmax on marked logits gathers them whole
        assert results[r]["fallback"][0] >= N * V, (r, results[r]["fallback"][0], N * V)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,V", CASES, ids=[f"k{k}-V{V}" for k, V in CASES])
def test_mode_routes_model_code_unchanged(world, k, V, dtype):
    results = world(k, _mode_worker, k, V, dtype)
    full, y = _model_data(V, dtype)
    # fp32: within 1e-6. bf16: the reference is the same code in fp32 on the same bf16 values (what the
    # shards compute inside), and results — rounded to bf16 once — are within one bf16 ulp of it.
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-6}
    for name in MODE_FNS:
        x = full.float().clone().requires_grad_(True)
        ref = _call(name, x, y, V)
        ref.backward()
        grad = torch.cat([results[r][name][1] for r in range(k)], dim=-1)
        assert grad.dtype == dtype, name
        torch.testing.assert_close(grad.float(), x.grad, **tol, msg=name)
        for r in range(k):
            loss, _, fwd, bwd = results[r][name]
            torch.testing.assert_close(loss.float(), ref.detach(), **tol, msg=name)
            expect = {"all_gather": GATHERS[name]} if name in GATHERS else {}
            if name != "softmax":
                expect["all_reduce"] = 2
            assert fwd == expect and bwd == {}, (name, fwd, bwd)


def test_marks_are_weak_clearable_and_unshard_gives_the_full_logits(world):
    k, V = 3, 10
    results = world(k, _marks_worker, k, V)
    full, y = _model_data(V, torch.float32)
    for r, res in enumerate(results):
        lo, hi = _bounds(V, k, r)
        assert res["marked"] and not res["alive_after_del"]
        assert res["after_clear"] == (None, {}, hi - lo)   # no mark: local softmax, no collective
        torch.testing.assert_close(res["plain"], F.cross_entropy(full.view(-1, V), y.view(-1)), rtol=0, atol=0)
        torch.testing.assert_close(res["unshard"]["logits"], full, rtol=0, atol=0)
        assert torch.equal(res["unshard"]["other"], y)


def test_bad_input_is_named_before_any_collective(world):
    k, V = 2, 131
    results = world(k, _errors_worker, k, V)
    expect = {
        "weight": (sl.ShardingError, "weight= is not supported"),
        "three_dims": (sl.ShardingError, "Flatten first"),
        "target_range": (sl.ShardingError, "outside the vocab"),
        "mark_shape": (sl.ShardingError, "Mark the output"),
        "unknown_axis": (sl.SpecError, "model"),
        "setitem_vocab": (sl.ShardingError, "in-place __setitem__"),
    }
    for r, res in enumerate(results):
        lo, hi = _bounds(V, k, r)
        expect["full_logits"] = (sl.ShardingError, f"expected {hi - lo}, this rank's shard [{lo}, {hi})")
        for name, (etype, text) in expect.items():
            assert res[name] is not None, name
            assert issubclass(res[name][0], etype) and text in res[name][1], (name, res[name])
            assert res[name][2] == 0, name            # raised before any collective
        kind, msg, _ = res["several"]                 # every problem at once
        assert issubclass(kind, sl.ShardingError)
        assert all(s in msg for s in ("3 problems", f"expected {hi - lo},", "class indices", "reduction='avg'")), msg


def _shards(full: torch.Tensor, V: int, k: int) -> list[tuple[int, torch.Tensor]]:
    return [(hi - lo, full[..., lo:hi]) for lo, hi in (_bounds(V, k, i) for i in range(k))]


@pytest.mark.parametrize("k,V", CASES, ids=[f"k{k}-V{V}" for k, V in CASES])
def test_index_and_reshape_run_on_the_shard_only_where_exact(k, V):
    """Which indexing and reshapes run on the shard; every one that does gives, on each shard,
    that shard of the op on the full tensor (checked here on real tensors, one process)."""
    from shardlib.runtime.vocab import VocabShard, _index_keeps_last, _reshape_local
    full = torch.arange(2 * 3 * V).view(2, 3, V)
    mask = torch.tensor([[True, False, True], [False, True, True]])
    index_cases = [
        (1, True), ((slice(None), 0), True), ((Ellipsis, slice(None, -1), slice(None)), True), ((None, Ellipsis), True),
        ((slice(None), None), True), ((slice(None),) * 3, True), ((mask,), True), ((torch.tensor([1, 0]),), True),
        ((Ellipsis, 0), False), ((Ellipsis, slice(1, None)), False), ((Ellipsis, None), False),
        ((slice(None),) * 3 + (None,), False), ((torch.ones(2, 3, V, dtype=torch.bool),), False),
        ((Ellipsis, torch.tensor([0])), False), ((0, 0, slice(0, 1)), False),
    ]
    for idx, keeps in index_cases:
        assert _index_keeps_last(idx, 3) == keeps, idx
        if keeps:
            assert torch.equal(torch.cat([s[idx] for _, s in _shards(full, V, k)], -1), full[idx]), idx
    reshape_cases = [   # requested shape -> (local shape on a shard of width w) or None (gather)
        ((-1, "w"), lambda w: (6, w)), ((-1, V), lambda w: (6, w)), ((6, -1), lambda w: (6, w)),
        ((2, -1, V), lambda w: (2, 3, w)), ((3, 2, V), lambda w: (3, 2, w)), ((1, 6, "w"), lambda w: (1, 6, w)),
        ((-1,), None), ((-1, 2 * V), None), ((4, -1), None), ((-1, -1), None),
    ]
    for req, expect in reshape_cases:
        for w, shard in _shards(full, V, k):
            got = _reshape_local([w if s == "w" else s for s in req], (2, 3), VocabShard(None, "tensor", V, 0, w))
            assert got == (None if expect is None else expect(w)), (req, w, got)
        if expect is not None and "w" not in req:   # in FULL terms (V): the shards' views are the full view's shards
            want = full.reshape(req)
            assert torch.equal(torch.cat([s.reshape(expect(w)) for w, s in _shards(full, V, k)], -1), want), req
