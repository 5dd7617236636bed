"""A model built on the meta device gets, unit by unit, the values a normal build gives it.

The reference is always the model built normally (on the CPU) from the same seed; values are
compared bitwise, and so is the global generator's state afterwards. Memory while materializing
is measured by the test's own allocator (live bytes of every tensor the replay creates).
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch import nn

import shardlib as sl
from shardlib.models import GPT, GPTConfig
from shardlib.comm.core import broadcast_bytes
from shardlib.planner.agreement import FIELDS
from shardlib.runtime.materialize import agreed_rng_state, allocator, materialize, materialize_, unit_groups
from shardlib.testing import get_mesh

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)


class Plain(nn.Module):
    """Torch layers only, each initialized by its own reset_parameters: embeddings, linears with
    and without bias, norms, BatchNorm's buffers, attention (whose reset also sets a child's bias),
    and a weight tied across two modules."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 24)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(24, 40), nn.LayerNorm(40), nn.Linear(40, 24, bias=False), nn.BatchNorm1d(24))
            for _ in range(3))
        self.attn = nn.MultiheadAttention(24, 4)
        self.head = nn.Linear(24, 50)
        self.head.weight = self.emb.weight


def build(kind: str, seed: int, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(CFG, seed=seed) if kind == "gpt" else Plain()


UNITS = {"gpt": [f"blocks.{i}" for i in range(CFG.n_layers)], "plain": ["layers.0", "layers.1", "layers.2", "attn"]}


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict(keep_vars=False).items()}


def unique(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer once, by its first name (a tied tensor is one tensor, as the
    materializer's groups name it; ``state_dict`` lists it under every name)."""
    return {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), f"{k} differs from the normal build"


@pytest.mark.parametrize("kind", ["gpt", "plain"])
def test_whole_model_in_place_equals_normal_build(kind):
    ref = build(kind, seed=7)
    ref_end = torch.get_rng_state()
    model = build(kind, seed=7, device="meta")
    assert all(p.is_meta for p in model.parameters())
    materialize_(model)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert_same(state(model), state(ref))
    assert torch.equal(torch.get_rng_state(), ref_end), "the generator is not where a normal build leaves it"
    if kind == "plain":
        assert model.head.weight is model.emb.weight
    # the model trains: forward and backward run on the materialized values
    if kind == "gpt":
        idx = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
        model(idx, idx).backward()


class Tracker:
    """An allocator for the replay that knows how many bytes of its tensors are alive."""

    def __init__(self):
        self.live = self.peak = 0

    def __call__(self, shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        n = t.untyped_storage().nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, n)
        return t

    def _free(self, n):
        self.live -= n


def nbytes(t: torch.Tensor) -> int:
    return math.prod(t.shape) * t.element_size()


@pytest.mark.parametrize("kind", ["gpt", "plain"])
def test_unit_at_a_time_equals_normal_build_and_holds_one_unit(kind):
    ref = unique(build(kind, seed=3))
    ref_end = torch.get_rng_state()
    model = build(kind, seed=3, device="meta")
    groups = unit_groups(model, UNITS[kind])
    assert sorted(n for names in groups.values() for n in names) == sorted(ref)
    tracker = Tracker()
    kept: dict[str, torch.Tensor] = {}
    sizes = []
    for g, values in materialize(model, list(groups.values()), alloc=tracker):
        assert sorted(values) == sorted(groups[list(groups)[g]])
        sizes.append(sum(nbytes(v) for v in values.values()))
        # keep a piece of each (as a rank keeps its shard), drop the full values
        for name, v in values.items():
            kept[name] = v.clone()
        del values
    assert_same(kept, ref)
    assert torch.equal(torch.get_rng_state(), ref_end)
    # memory: one group's values plus one call's scratch tensors (a module's own tensors; its whole
    # subtree where it holds tensors and has children, as attention does), never the whole model
    def call_bytes(m):
        own = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        every = own and list(m._modules) and list(m.parameters()) + list(m.buffers())
        return sum(nbytes(t) for t in (every or own))

    total = sum(nbytes(v) for v in ref.values())
    assert tracker.peak <= max(sizes) + max(call_bytes(m) for m in model.modules())
    assert tracker.peak < 0.6 * total


def test_keeping_every_unit_alive_is_seen_by_the_tracker():
    # the measurement above can fail: a consumer that keeps every group's full values holds the model
    model = build("gpt", seed=3, device="meta")
    groups = unit_groups(model, UNITS["gpt"])
    tracker = Tracker()
    kept = [values for _, values in materialize(model, list(groups.values()), alloc=tracker)]
    total = sum(nbytes(t) for t in model.parameters())
    assert tracker.peak >= total
    del kept


def test_groups_follow_the_planner_units():
    model = build("gpt", seed=0, device="meta")
    plan = sl.plan(model, sl.AbstractMesh({"data": 2}), zero=3)
    groups = unit_groups(model, [u.name for u in plan.units if u.name])
    assert {u: tuple(n) for u, n in groups.items()} == {u.name: u.params for u in plan.units}


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))


class LostBuffer(nn.Module):
    """Passes the up-front check (the model's init_weights covers every module), but the buffer is
    computed in the constructor and set by no replayed call: on meta it has no values."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("pos", torch.arange(4.0))   # computed in the constructor: lost on meta
        for m in self.modules():
            self.init_weights(m)

    def init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)


def test_a_model_that_cannot_be_replayed_is_refused_naming_the_modules():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), NoReset(), NoReset())
    with pytest.raises(sl.ShardingError) as err:
        materialize_(model)
    msg = str(err.value)
    assert "1 (NoReset: w)" in msg and "2 (NoReset: w)" in msg and "reset_parameters" in msg
    assert "init_weights" in msg


def test_a_tensor_no_call_sets_is_refused():
    with torch.device("meta"):
        model = LostBuffer()
    with pytest.raises(sl.ShardingError, match=r"'pos'.*without values|without values.*'pos'"):
        materialize_(model)


def test_init_weights_covers_modules_without_reset():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(5))
            self.lin = nn.Linear(5, 5)
            for m in self.modules():
                self.init_weights(m)

        def init_weights(self, module):
            if module is self:
                nn.init.normal_(self.scale)

    torch.manual_seed(11)
    ref = Scaled()
    torch.manual_seed(11)
    with torch.device("meta"):
        model = Scaled()
    materialize_(model)
    assert_same(state(model), state(ref))


def _rank_rng(seed_offset: int):
    mesh = get_mesh({"data": 2})
    torch.manual_seed(100 + seed_offset * mesh.rank)          # different seeds on each rank
    mine = torch.get_rng_state()
    agreed = agreed_rng_state(mesh, "data")
    torch.manual_seed(100)
    return torch.equal(agreed, torch.get_rng_state()), torch.equal(agreed, mine)


def test_ranks_agree_on_rank_zeros_generator_state(world):
    (r0_is_100, r0_mine), (r1_is_100, r1_mine) = world(2, _rank_rng, 1)
    assert r0_is_100 and r1_is_100 and r0_mine and not r1_mine


# ---------------------------------------------------------------------------------------------
# Through sl.parallelize: a meta-built model trains as the same model built normally
# ---------------------------------------------------------------------------------------------

ENGINE_CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=2)
SIZES = (7, 13, 11, 5)          # odd sizes: uneven pieces at data 2 and 3


class Regress(nn.Module):
    """Linear and LayerNorm layers only (torch's own reset_parameters), a mean-squared-error loss."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.LayerNorm(b))
                                    for a, b in zip(SIZES[:-2], SIZES[1:-1]))
        self.head = nn.Linear(SIZES[-2], SIZES[-1])

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(self.head(x), y)


def engine_model(kind: str, seed: int, meta: bool) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return GPT(ENGINE_CFG, seed=seed) if kind == "gpt" else Regress()


def engine_batches(kind: str, steps: int = 3, batch: int = 6):
    g = torch.Generator().manual_seed(1)
    if kind == "gpt":
        return [(torch.randint(0, ENGINE_CFG.vocab_size, (batch, ENGINE_CFG.seq_len), generator=g),) * 2
                for _ in range(steps)]
    return [(torch.randn(batch, SIZES[0], generator=g), torch.randn(batch, SIZES[-1], generator=g))
            for _ in range(steps)]


def _train(kind: str, zero: int, data: int, meta: bool) -> dict:
    """Build (on meta: each rank from another seed — rank 0's is 5), parallelize, train 3 steps."""
    mesh = get_mesh({"data": data})
    model = engine_model(kind, seed=5 + (mesh.rank if meta else 0), meta=meta)
    plan = sl.plan(model, mesh, zero=zero)
    engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    init = engine.full_state_dict()
    losses = [engine.step(b) for b in engine_batches(kind)]
    return {"init": init, "losses": losses, "final": engine.full_state_dict()}


def _meta_vs_normal(runs: list[tuple[str, int]], data: int) -> list[tuple[dict, dict]]:
    return [(_train(kind, zero, data, meta=False), _train(kind, zero, data, meta=True)) for kind, zero in runs]


@pytest.mark.parametrize("data,runs", [
    (2, [(k, z) for k in ("gpt", "plain") for z in range(4)]),
    (3, [("plain", 1), ("plain", 3), ("gpt", 3)]),
])
def test_meta_built_model_trains_as_the_normally_built_one(world, data, runs):
    for rank, per_run in enumerate(world(data, _meta_vs_normal, runs, data)):
        for (kind, zero), (normal, meta) in zip(runs, per_run):
            what = f"{kind}, zero={zero}, data={data}, rank {rank}"
            # initial values: exactly those of one process building the model normally from seed 5
            want = state(engine_model(kind, seed=5, meta=False))
            assert_same(meta["init"], want)
            assert_same(normal["init"], want)
            # training: the same losses and final state as the engine on the normally built model
            assert len(meta["losses"]) == 3
            for a, b in zip(meta["losses"], normal["losses"]):
                assert abs(a - b) <= 1e-6 * abs(b), f"{what}: loss {a} vs {b}"
            assert sorted(meta["final"]) == sorted(normal["final"])
            for k, v in normal["final"].items():
                torch.testing.assert_close(meta["final"][k], v, rtol=1e-5, atol=1e-7, msg=f"{what}: {k}")


def _train_pipe(shape: dict, zero: int, meta: bool) -> dict:
    """The GPT on a pipe axis (2 micro-batches): on meta each rank replays only its stage's values."""
    mesh = get_mesh(shape)
    model = engine_model("gpt", seed=5 + (mesh.rank if meta else 0), meta=meta)
    plan = sl.plan(model, mesh, zero=zero, rules={"layers": "pipe"}, microbatches=2)
    engine = sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    built = sum(s.plan.numel for s in engine.states)
    init = engine.full_state_dict()
    losses = [engine.step(b) for b in engine_batches("gpt", batch=8)]
    return {"init": init, "losses": losses, "final": engine.full_state_dict(), "built": built}


def _pipe_meta_vs_normal(shape: dict, zero: int) -> tuple[dict, dict]:
    return _train_pipe(shape, zero, meta=False), _train_pipe(shape, zero, meta=True)


@pytest.mark.parametrize("shape,zero", [({"data": 1, "pipe": 2}, 0), ({"data": 2, "pipe": 2}, 3)])
def test_meta_built_model_under_a_pipe_axis_replays_only_its_stages(world, shape, zero):
    """A meta GPT cut into pipeline stages: each rank materializes only its stage's parameters (the
    others stay on meta), with the values of a normal build from rank 0's seed; trains as built normally."""
    total = sum(p.numel() for p in engine_model("gpt", seed=5, meta=False).parameters())
    want = state(engine_model("gpt", seed=5, meta=False))
    for rank, (normal, meta) in enumerate(world(shape["data"] * 2, _pipe_meta_vs_normal, shape, zero)):
        assert meta["built"] < total, f"rank {rank}: built {meta['built']} of {total}"
        assert_same(meta["init"], want)
        for a, b in zip(meta["losses"], normal["losses"]):
            assert abs(a - b) <= 1e-6 * abs(b), f"{shape} rank {rank}: loss {a} vs {b}"
        for k, v in normal["final"].items():
            torch.testing.assert_close(meta["final"][k], v, rtol=1e-5, atol=1e-7, msg=f"{shape} rank {rank}: {k}")


BUILD_CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=6)


def _build_memory(zero: int) -> dict:
    """What the replay's tensors hold at most while sl.parallelize builds a meta GPT (this rank)."""
    mesh = get_mesh({"data": 2})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(BUILD_CFG, seed=0)
    plan = sl.plan(model, mesh, zero=zero)
    groups = unit_groups(model, [u.name for u in plan.units if u.name])
    named = unique(model)
    unit_max = max(sum(nbytes(named[n]) for n in names) for names in groups.values())
    calls = []
    for m in model.modules():          # one call's scratch: a module's own tensors (GPT's modules are leaves)
        own = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        calls.append(sum(nbytes(t) for t in own))
    tracker = Tracker()
    with allocator(tracker):
        sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    return {"peak": tracker.peak, "unit": unit_max, "call": max(calls),
            "total": sum(nbytes(t) for t in named.values()), "units": len(groups)}


def test_zero3_build_holds_one_unit_not_the_model(world):
    for zero3, zero2 in zip(world(2, _build_memory, 3), world(2, _build_memory, 2)):
        assert zero3["units"] >= 6
        assert zero3["peak"] <= zero3["unit"] + zero3["call"], zero3
        assert zero3["peak"] < 0.5 * zero3["total"], zero3
        # the tracker sees a whole-model build (ZeRO-2 keeps every parameter full anyway)
        assert zero2["peak"] >= zero2["total"], zero2


def _setup_counted(zero: int) -> dict:
    mesh = get_mesh({"data": 2})
    model = engine_model("gpt", seed=mesh.rank, meta=True)
    plan = sl.plan(model, mesh, zero=zero)
    with sl.count_collectives() as counter:
        sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    planned = [(e.op, e.axes, e.bytes, e.what) for e in plan.comm_setup()]
    return {"counted": counter.by_op(), "tags": {r.tag for r in counter.records}, "planned": planned,
            "records": [(r.op, r.axes, r.bytes) for r in counter.records]}


@pytest.mark.parametrize("zero", [1, 3])
def test_meta_setup_sends_the_generator_state_not_the_model(world, zero):
    """Every rank replays rank 0's stream: the set-up sends rank 0's generator state, not the model."""
    rng = torch.get_rng_state()
    for res in world(2, _setup_counted, zero):
        # (first the plans' agreement: one all-gather of a CRC per field, runtime/parted.check_agreement)
        assert res["counted"] == {"all_gather": (1, 8 * len(FIELDS)),
                                  "broadcast": (1, broadcast_bytes(rng.numel(), 2, rng.element_size()))}, res
        assert res["tags"] == {"setup"}, res
        assert res["planned"] == [(op, axes, b, what) for (op, axes, b), what in
                                  zip(res["records"], ("plan check", "rng state"))], res


def test_parallelize_refuses_a_meta_model_it_cannot_replay():
    mesh = get_mesh({"data": 1})
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), NoReset())
    plan = sl.plan(model, mesh, zero=3)
    with pytest.raises(sl.ShardingError, match=r"parallelize: .*meta device.*1 \(NoReset: w\)"):
        sl.parallelize(model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with torch.device("meta"):
        lost = LostBuffer()
    with pytest.raises(sl.ShardingError, match=r"parallelize: .*without values.*'pos'"):
        sl.parallelize(lost, sl.plan(lost, mesh), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_parallelize_refuses_a_partly_meta_model():
    mesh = get_mesh({"data": 1})
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1] = nn.Linear(3, 3)               # real values next to meta ones: the replay would overwrite them
    with pytest.raises(sl.ShardingError, match=r"partly on the meta device .*1\.weight"):
        sl.parallelize(model, sl.plan(model, mesh), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
