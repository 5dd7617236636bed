"""The tensor axis at plan time (no processes: ``sl.AbstractMesh``): bad input, layouts, shards,
memory and ``explain()``.

Every bad input is a ``ShardingError`` raised by ``sl.plan`` itself, before any collective: the
collectives of ``torch.distributed`` are replaced by ones that fail, and the collective counter
records nothing. Messages name the parameter (qualified name, shape, spec) or the module (head
counts) and the fix; several problems are listed in one error.

Expected numbers are worked out here by hand from the shapes (ceil chunks: a dim of ``n`` over
``t`` ranks gives ``ceil(n/t)`` to each rank but the last ones), never read back from the plan.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardlib as sl
from shardlib import P
from shardlib.models import GPT, GPTConfig

RULES = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
# vocabulary 67 and MLP width 90: neither 2 nor 4 divides them (uneven shards)
CFG = GPTConfig(vocab_size=67, seq_len=8, d_model=32, n_heads=4, n_layers=2, mlp_width=90)
MESH = sl.AbstractMesh({"data": 2, "tensor": 2})
D, V, H = 16, 67, 90                 # the toy model's width, vocabulary and MLP width


# ---- models ---------------------------------------------------------------------------------------

class GQA(nn.Module):
    """Grouped-query attention's parameters: 4 query heads, 2 KV heads of width 4."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, head_dim: int = 4):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(D, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(D, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(D, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, D, bias=False)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.attn = GQA()
        self.fc = nn.Linear(D, H)
        self.out = nn.Linear(H, D)


class ToyLM(nn.Module):
    """Undecorated (no class tables): every spec comes from the instance table a test gives."""

    def __init__(self, n_layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)


# Megatron TP of the toy model, written by hand
TOY_TP = {"wte.weight": P("tensor", None), "head.weight": P("tensor", None),
          "*.fc.weight": P("tensor", None), "*.fc.bias": P("tensor"), "*.out.weight": P(None, "tensor"),
          "*.q_proj.weight": P("tensor", None), "*.k_proj.weight": P("tensor", None),
          "*.v_proj.weight": P("tensor", None), "*.o_proj.weight": P(None, "tensor")}


def toy(table: dict, **kw) -> ToyLM:
    return sl.shard(table, **kw)(ToyLM())


def tensor_mesh(t: int, data: int = 2) -> sl.AbstractMesh:
    return sl.AbstractMesh({"data": data, "tensor": t})


# ---- no collective may run while planning ----------------------------------------------------------

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                "broadcast", "barrier", "all_to_all_single", "send", "recv", "isend", "irecv",
                "init_process_group", "new_group")


@pytest.fixture(autouse=True)
def no_collectives(monkeypatch):
    """Every collective of ``torch.distributed`` fails if planning calls it."""
    def fail(name):
        def call(*args, **kwargs):
            raise AssertionError(f"sl.plan called torch.distributed.{name} (no processes exist)")
        return call
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, fail(name))
    assert not dist.is_initialized()


def plan_error(*args, **kwargs) -> sl.ShardingError:
    """The ``ShardingError`` of ``sl.plan(*args, **kwargs)``, checked to come before any collective."""
    with sl.count_collectives() as counter, pytest.raises(sl.ShardingError) as info:
        sl.plan(*args, **kwargs)
    assert counter.records == [], counter.records
    assert not dist.is_initialized()
    return info.value


def the_problem(err: sl.ShardingError, *words: str) -> str:
    """The one problem of ``err`` that contains every one of ``words`` (all of them in one message)."""
    hits = [m for m in err.problems if all(w in m for w in words)]
    assert len(hits) == 1, f"{words} in {len(hits)} of the problems:\n{err}"
    return hits[0]


# ---- spec tables, through sl.plan ----------------------------------------------------------------

def test_spec_naming_an_axis_the_mesh_lacks_is_refused_with_the_fix():
    err = plan_error(toy({**TOY_TP, "blocks.0.fc.weight": P("model", None)}), MESH)
    assert len(err.problems) >= 1
    the_problem(err, "'blocks.0.fc.weight'", f"({H}, {D})", "P('model', None)", "unknown mesh axis 'model'",
                "('data', 'tensor')", "add the axis to the mesh")


def test_strict_table_refuses_a_parameter_no_pattern_matches():
    table = {"wte.weight": P("tensor", None), "blocks.*": P(), "ln_f.weight": P(), "head.weight": P("tensor", None)}
    err = plan_error(toy(table, strict=True), MESH)
    assert len(err.problems) == 1, err
    the_problem(err, "'ln_f.bias'", f"({D},)", "matches no pattern", "strict", "Add a pattern for it")


def test_two_patterns_giving_one_parameter_two_specs_are_refused():
    """The GPT's class table names ``ln_f.*`` ``("embed",)``; an instance table splitting it conflicts."""
    model = sl.shard({"ln_f.weight": P("tensor")})(GPT(CFG))
    err = plan_error(model, MESH, rules=RULES)
    assert len(err.problems) == 1, err
    the_problem(err, "'ln_f.weight'", f"({CFG.d_model},)", "different specs", "P(None)", "P('tensor')",
                "'ln_f.*'", "'ln_f.weight'", "Narrow the patterns")


def test_rules_mapping_two_dims_of_a_tensor_to_one_axis_are_refused():
    err = plan_error(GPT(CFG), MESH, rules={"heads": "tensor", "embed": "tensor"})
    # every attention projection is ("heads", "embed") or ("embed", "heads"); one problem each (listed
    # with what embed -> tensor does elsewhere: norms split on tensor, ...: every problem at once)
    two = [m for m in err.problems if "Map at most one of" in m]
    assert len(two) == 2 * CFG.n_layers, err
    assert any("LayerNorm" in m for m in err.problems), err
    d = CFG.d_model
    the_problem(err, "'blocks.0.attn.qkv.weight'", f"({3 * d}, {d})", "('heads', 'embed')",
                "'heads' -> 'tensor'", "'embed' -> 'tensor'", "Map at most one of 'heads' and 'embed' to 'tensor'")
    the_problem(err, "'blocks.1.attn.proj.weight'", f"({d}, {d})", "('embed', 'heads')")


# ---- heads --------------------------------------------------------------------------------------

def test_heads_the_tensor_degree_cannot_divide_are_refused_per_module():
    cfg = GPTConfig(vocab_size=67, seq_len=8, d_model=32, n_heads=4, n_layers=2, mlp_width=90)
    err = plan_error(GPT(cfg), tensor_mesh(3), rules=RULES)
    assert len(err.problems) == 2, err                   # one per attention module; uneven MLP/vocab are fine
    for i in range(2):
        the_problem(err, f"Attention 'blocks.{i}.attn'", "4 attention heads", "tensor=3",
                    f"blocks.{i}.attn.qkv.weight (96, 32) P('tensor', None)",
                    f"blocks.{i}.attn.proj.weight (32, 32) P(None, 'tensor')",
                    "one of [1, 2, 4]", "Use such a tensor degree", "replicated")
    # the same degree with 6 heads plans
    ok = GPT(GPTConfig(vocab_size=67, seq_len=8, d_model=48, n_heads=6, n_layers=2, mlp_width=90))
    assert len(sl.plan(ok, tensor_mesh(3), rules=RULES).tensor.sites) == 10


def test_kv_heads_the_tensor_degree_cannot_divide_are_refused():
    """4 query heads split over 4 ranks, 2 KV heads do not."""
    err = plan_error(toy(TOY_TP), tensor_mesh(4, data=1))
    assert len(err.problems) == 2, err
    for i in range(2):
        the_problem(err, f"GQA 'blocks.{i}.attn'", "2 KV heads", "heads=4, kv_heads=2", "tensor=4",
                    f"blocks.{i}.attn.k_proj.weight (8, {D}) P('tensor', None)", "one of [1, 2]",
                    "Use such a tensor degree")
    assert not any("attention heads" in m for m in err.problems)
    assert sl.plan(toy(TOY_TP), tensor_mesh(2)).tensor.site("blocks.1.attn.v_proj").kind == "column"


class ConfigAttention(nn.Module):
    """Heads only in a shared ``config`` (as ``transformers`` attention modules hold them)."""

    def __init__(self, config):
        super().__init__()
        self.config, self.head_dim = config, 4
        self.q_proj = nn.Linear(D, 16, bias=False)
        self.o_proj = nn.Linear(16, D, bias=False)


class ConfigMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.up_proj = nn.Linear(D, H, bias=False)
        self.down_proj = nn.Linear(H, D, bias=False)


class ConfigLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=4)
        self.attn = ConfigAttention(self.config)
        self.mlp = ConfigMLP(self.config)
        self.lm_head = nn.Linear(D, V, bias=False)


CONFIG_MLP_TP = {"mlp.up_proj.weight": P("tensor", None), "mlp.down_proj.weight": P(None, "tensor"),
                 "lm_head.weight": P("tensor", None)}


def test_heads_are_read_off_attention_modules_only():
    """A module holding the model's ``config`` but no heads of its own (an MLP, the whole model)
    splits over any degree; an attention module reads its heads from the config."""
    mesh = tensor_mesh(3, data=1)
    plan = sl.plan(sl.shard(CONFIG_MLP_TP)(ConfigLM()), mesh)
    assert {s.kind for s in plan.tensor.sites} == {"column", "row", "logits"}
    attn_tp = {"attn.q_proj.weight": P("tensor", None), "attn.o_proj.weight": P(None, "tensor")}
    err = plan_error(sl.shard({**CONFIG_MLP_TP, **attn_tp})(ConfigLM()), mesh)
    assert len(err.problems) == 2, err              # attention and KV heads of 'attn', nothing else
    the_problem(err, "ConfigAttention 'attn'", "4 attention heads", "attn.q_proj.weight (16, 16) P('tensor', None)")
    the_problem(err, "ConfigAttention 'attn'", "4 KV heads")


# ---- parameters a module cannot consume split -------------------------------------------------------

@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("name", ["ln_f.weight", "blocks.0.ln.weight"])
def test_layernorm_weight_split_on_tensor_is_refused(name, sp):
    err = plan_error(toy({**TOY_TP, name: P("tensor")}), MESH, sequence_parallel=sp)
    assert len(err.problems) == 1, err
    the_problem(err, f"{name} ({D},)", f"LayerNorm '{name.rpartition('.')[0]}'", "P('tensor')",
                "cannot consume a parameter split on 'tensor'", f"Keep {name} replicated (P())")


def test_column_linear_with_a_replicated_bias_is_refused():
    table = {k: v for k, v in TOY_TP.items() if k != "*.fc.bias"}
    err = plan_error(toy(table), MESH)
    assert len(err.problems) == 2, err
    the_problem(err, f"blocks.0.fc.bias ({H},)", "Linear 'blocks.0.fc'", "is P()",
                f"blocks.0.fc.weight ({H}, {D}) is column-split P('tensor', None)",
                "Add 'blocks.0.fc.bias': P('tensor')")


def test_row_linear_with_a_split_bias_is_refused():
    err = plan_error(toy({**TOY_TP, "*.out.bias": P("tensor")}), MESH)
    assert len(err.problems) == 2, err
    the_problem(err, f"blocks.1.out.bias ({D},)", "Linear 'blocks.1.out'", "is P('tensor')",
                f"blocks.1.out.weight ({D}, {H}) is row-split P(None, 'tensor')", "expected the bias replicated",
                "Drop it from the spec table")


def test_embedding_split_on_its_embedding_dim_is_refused():
    table = {k: v for k, v in TOY_TP.items() if k != "wte.weight"}
    err = plan_error(toy({**table, "wte.weight": P(None, "tensor")}), MESH)
    assert len(err.problems) == 1, err
    the_problem(err, f"wte.weight ({V}, {D})", "Embedding 'wte'", "P(None, 'tensor')",
                "expected the vocabulary split", "Use P('tensor', None)")


def test_sequence_parallel_refuses_a_length_the_degree_cannot_divide():
    ids = torch.randint(0, CFG.vocab_size, (4, 7))                  # 7 tokens over tensor=2
    err = plan_error(GPT(CFG), MESH, rules=RULES, sequence_parallel=True, batch=(ids, ids))
    assert len(err.problems) == 1, err
    the_problem(err, f"(2, 7, {CFG.d_model})", "sequence dim 1", "tensor=2", "divisible by 2",
                "sequence_parallel=False")
    sl.plan(GPT(CFG), MESH, rules=RULES, batch=(ids, ids))         # without SP 7 tokens are fine
    ids8 = torch.randint(0, CFG.vocab_size, (4, 8))
    sl.plan(GPT(CFG), MESH, rules=RULES, sequence_parallel=True, batch=(ids8, ids8))


def test_every_problem_in_one_error():
    table = {k: v for k, v in TOY_TP.items() if k not in ("wte.weight", "*.fc.bias")}
    table.update({"wte.weight": P(None, "tensor"), "ln_f.weight": P("tensor"), "*.fc.bias": P(),
                  "blocks.0.out.bias": P("tensor")})
    err = plan_error(toy(table), tensor_mesh(4, data=1))
    expected = [("wte.weight", "Embedding"), ("ln_f.weight", "LayerNorm"), ("blocks.0.fc.bias", "column-split"),
                ("blocks.1.fc.bias", "column-split"), ("blocks.0.out.bias", "row-split"),
                ("GQA 'blocks.0.attn'", "2 KV heads"), ("GQA 'blocks.1.attn'", "2 KV heads")]
    assert len(err.problems) == len(expected), err
    for words in expected:
        the_problem(err, *words)
    assert str(err).startswith(f"plan: {len(expected)} problems:")


def test_pipe_axis_without_the_layers_rule_is_refused():
    err = plan_error(GPT(CFG), sl.AbstractMesh({"data": 1, "tensor": 2, "pipe": 2}), rules=RULES)
    the_problem(err, "the layer stack 'blocks' is split over", "expected exactly ('pipe',)",
                "{'layers': 'pipe'}")
    sl.plan(GPT(CFG), sl.AbstractMesh({"data": 1, "tensor": 2, "pipe": 1}), rules=RULES)


# ---- layouts, shards, memory ------------------------------------------------------------------------

def test_state_layouts_compose_the_spec_with_zero():
    plan = sl.plan(GPT(CFG), MESH, zero=3, rules=RULES)
    col, row, ln = (plan.param(f"blocks.0.{n}") for n in ("mlp.fc.weight", "mlp.out.weight", "ln1.weight"))
    assert col.spec == P("tensor", None) and row.spec == P(None, "tensor") and ln.spec.axes == ()
    for p, at_rest in ((col, P(("tensor", "data"), None)), (row, P("data", "tensor")), (ln, P("data"))):
        assert p.rest.spec == p.grad.spec == p.optim.spec == at_rest, p
    for p in plan.params:
        assert p.compute.spec == p.spec, p
    plain = sl.plan(GPT(CFG), MESH, zero=0, rules=RULES)
    for p in plain.params:
        assert p.rest.spec == p.compute.spec == p.grad.spec == p.spec, p


def test_local_shards_are_ceil_chunks():
    """MLP width 90 over 4 ranks: 23, 23, 23, 21; vocabulary 67: 17, 17, 17, 16."""
    mlp, vocab = (23, 23, 23, 21), (17, 17, 17, 16)
    plan = sl.plan(GPT(CFG), tensor_mesh(4, data=1), rules=RULES)
    d = CFG.d_model
    for r in range(4):
        loc = plan.local(r)
        shapes = {p.name: p.shape for p in loc.params}
        assert shapes["blocks.0.mlp.fc.weight"] == (mlp[r], d) and shapes["blocks.1.mlp.fc.bias"] == (mlp[r],)
        assert shapes["blocks.0.mlp.out.weight"] == (d, mlp[r]) and shapes["blocks.0.mlp.out.bias"] == (d,)
        assert shapes["wte.weight"] == (vocab[r], d) and shapes["head.weight"] == (vocab[r], d)
        assert shapes["blocks.0.attn.qkv.weight"] == (3 * d // 4, d) and shapes["ln_f.weight"] == (d,)
        assert loc.param("wte.weight").full_shape == (67, d)
    assert sum(mlp) == 90 and sum(vocab) == 67


def _local_shape(shape: tuple[int, ...], spec: P, t: int, coord: int) -> tuple[int, ...]:
    """Ceil chunks of the dims ``spec`` puts on ``tensor``, by hand."""
    out = list(shape)
    for d, e in enumerate(tuple(spec)):
        if e == "tensor":
            c = -(-shape[d] // t)
            out[d] = min(c, max(0, shape[d] - coord * c))
    return tuple(out)


def test_memory_per_rank_is_zero3_of_the_tensor_local_parameters():
    """ZeRO-3, fp32 AdamW: 4 + 4 + 8 bytes per parameter of the rank's tensor shard, sharded over
    data as each unit's flat segment in ceil chunks (so within one element per unit of Ψ_local/N)."""
    model = GPT(CFG)
    plan = sl.plan(model, MESH, zero=3, rules=RULES)
    specs = {p.name: p.spec for p in plan.params}
    units = ["", *(f"blocks.{i}" for i in range(CFG.n_layers))]
    seen = set()
    for rank in range(MESH.size):
        t, d = MESH.coord(rank, "tensor"), MESH.coord(rank, "data")
        per_unit = dict.fromkeys(units, 0)
        for name, p in model.named_parameters():
            unit = next((u for u in units[1:] if name.startswith(u + ".")), "")
            per_unit[unit] += math.prod(_local_shape(tuple(p.shape), specs[name], 2, t))
        held = 0
        for n in per_unit.values():
            c = -(-n // 2)
            held += min(c, max(0, n - d * c))
        psi_local = sum(per_unit.values())
        mem = plan.memory_per_rank(rank)
        assert mem["params"] == 4 * held and mem["grads"] == 4 * held and mem["optimizer"] == 8 * held, (rank, mem)
        assert mem["total"] == 16 * held
        assert abs(held - psi_local / 2) <= len(units)
        assert plan.zero_formula(rank)["total"] == pytest.approx(16 * psi_local / 2)
        seen.add(psi_local)
    assert len(seen) == 2            # vocabulary 67: the two tensor coordinates hold different counts


# ---- explain --------------------------------------------------------------------------------------

def _table(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("parameter "))
    end = lines.index("", start)
    return lines[start:end]


def test_explain_shows_split_modules_stream_and_collectives_per_unit():
    ids = torch.randint(0, CFG.vocab_size, (4, 8))
    text = sl.plan(GPT(CFG), MESH, zero=3, rules=RULES, batch=(ids, ids)).explain()
    for words in ("tensor: 'tensor' (t=2), sequence_parallel=False", "vocab wte (1)",
                  "column blocks.0..1.attn.qkv, blocks.0..1.mlp.fc (4)",
                  "row blocks.0..1.attn.proj, blocks.0..1.mlp.out (4)", "logits head",
                  "residual stream at every unit boundary: P('data', None, None): replicated over 'tensor'"):
        assert words in text, words
    # a micro-batch of 2 x 8 tokens of width 32 in fp32 is 2 KiB; a ring all-reduce over 2 ranks
    # sends 2(t-1)/t of it per rank: 2 KiB; the loss: 16 and 32 floats, 64 B and 128 B
    blocks = next(line for line in text.splitlines() if line.strip().startswith("blocks.0..1:"))
    assert blocks.count("for all_reduce 2 KiB") == 2 and blocks.count("bac all_reduce 2 KiB") == 2, blocks
    root = next(line for line in text.splitlines() if line.strip().startswith("<root>:"))
    assert "for all_reduce(loss) 64 B" in root and "for all_reduce(loss) 128 B" in root, root
    # each parameter's layouts, in aligned columns
    table = _table(text)
    fc = next(line for line in table if line.strip().startswith("blocks.*.mlp.fc.weight"))
    assert fc.split()[4:8] == ["tensor·data,-", "tensor,-", "tensor·data,-", "tensor·data,-"], fc
    assert len({len(line) for line in table}) == 1, "\n".join(table)

    sp = sl.plan(GPT(CFG), MESH, rules=RULES, sequence_parallel=True, batch=(ids, ids)).explain()
    assert "residual stream at every unit boundary: P('data', 'tensor', None)" in sp
    blocks = next(line for line in sp.splitlines() if line.strip().startswith("blocks.0..1:"))
    # half the sequence is gathered: (t-1)/t of 2 KiB = 1 KiB each way
    assert blocks.count("for all_gather 1 KiB") == 2 and blocks.count("for reduce_scatter 1 KiB") == 2, blocks


def test_explain_without_batch_says_how_to_get_collectives():
    text = sl.plan(GPT(CFG), MESH, rules=RULES).explain()
    assert "activation collectives: pass batch= to sl.plan to trace them" in text
    assert "activation collectives per micro-step" not in text


def test_no_rules_on_a_tensor_axis_is_an_error():
    """The GPT names its dims but, with no rules, every name is replicated: a tensor axis of size 2 would
    split nothing, its ranks computing the same thing (issue 38: an axis that splits nothing is a bug, not
    a fallback). Refused at plan time, naming the axis and the rules that would split it."""
    ids = torch.randint(0, CFG.vocab_size, (4, 8))
    model = GPT(CFG)
    with pytest.raises(sl.ShardingError, match="'tensor' has size 2 but the plan splits nothing") as e:
        sl.plan(model, MESH, rules=None, batch=(ids, ids))
    assert "'heads': 'tensor'" in str(e.value) or "'mlp': 'tensor'" in str(e.value)
    plan = sl.plan(model, sl.AbstractMesh({"data": 2, "tensor": 1}), rules=None, batch=(ids, ids))
    assert all(p.spec.axes == () for p in plan.params) and plan.tensor is None


# ---- Conv1D and Fused columns (transformers models) ------------------------------------------------

def _hf(family: str, **kw):
    import hf_models

    return hf_models.build(family, layers=2, **kw)


def test_gpt2_plans_conv1d_sites_fused_c_attn_and_local_attributes():
    from shardlib.planner.hf_tp import tp_table

    model = _hf("gpt2")
    plan = sl.plan(sl.shard(tp_table(model))(model), tensor_mesh(2))
    site = plan.tensor.site("transformer.h.0.attn.c_attn")
    assert (site.kind, site.fused, site.conv1d, site.width) == ("column", 3, True, 96)
    assert plan.tensor.site("transformer.h.1.mlp.c_proj").kind == "row"
    attrs = {(a.module, a.attr): a.full for a in plan.tensor.local_attrs}
    assert attrs[("transformer.h.0.attn", "split_size")] == 32
    assert attrs[("transformer.h.0.attn", "config.num_attention_heads")] == 4
    local = {p.name: p.shape for p in plan.local(1).params}
    # q|k|v blocks of 32, each split 2 ways: this rank's 16 of each
    assert local["transformer.h.0.attn.c_attn.weight"] == (32, 48)
    assert local["transformer.h.0.attn.c_attn.bias"] == (48,)
    assert local["transformer.h.0.attn.c_proj.weight"] == (16, 32)


def test_fused_parts_that_do_not_divide_the_width_are_refused():
    model = _hf("gpt2")
    table = {"*.mlp.c_fc.weight": P(None, sl.Fused(3, "tensor")), "*.mlp.c_fc.bias": P(sl.Fused(3, "tensor")),
             "*.mlp.c_proj.weight": P("tensor", None)}
    err = plan_error(sl.shard(table)(model), tensor_mesh(2))
    the_problem(err, "transformer.h.0.mlp.c_fc.weight (32, 128)", "P(None, Fused(3, 'tensor'))",
                "dim 1 (128 features) is not 3 equal blocks", "split it plainly (P(None, 'tensor'))")


def test_fused_qkv_of_grouped_query_attention_is_refused():
    """Phi-3 with 8 query and 2 KV heads of 4: q|k|v are 32|8|8 wide — 48 rows, divisible by 3,
    but not 3 equal blocks."""
    import hf_models
    from transformers import AutoModelForCausalLM

    from shardlib.planner.hf_tp import tp_table

    cfg = hf_models.config("phi3", layers=2)
    cfg.num_attention_heads, cfg.num_key_value_heads = 8, 2
    model = AutoModelForCausalLM.from_config(cfg)
    assert "*.qkv_proj.weight" not in tp_table(model)          # the table keeps it replicated
    table = {"*.qkv_proj.weight": P(sl.Fused(3, "tensor"), None), "*.o_proj.weight": P(None, "tensor")}
    err = plan_error(sl.shard(table)(model), tensor_mesh(2, data=1))
    the_problem(err, "model.layers.0.self_attn.qkv_proj.weight", "P(Fused(3, 'tensor'), None)",
                "8 query and 2 KV heads", "expected equal blocks", "Keep this projection")


def test_fused_qkv_whose_heads_the_degree_cannot_split_is_refused():
    from shardlib.planner.hf_tp import tp_table

    model = _hf("gpt2")
    err = plan_error(sl.shard(tp_table(model))(model), tensor_mesh(3, data=1))
    the_problem(err, "GPT2Attention 'transformer.h.0.attn'", "4 attention heads", "tensor=3",
                "transformer.h.0.attn.c_attn.weight (32, 96) P(None, Fused(3, 'tensor'))", "one of [1, 2, 4]")


def test_fused_column_bias_must_follow_its_weight():
    model = _hf("gpt2")
    table = {"*.attn.c_attn.weight": P(None, sl.Fused(3, "tensor")), "*.attn.c_attn.bias": P("tensor"),
             "*.attn.c_proj.weight": P("tensor", None)}
    err = plan_error(sl.shard(table)(model), tensor_mesh(2))
    the_problem(err, "transformer.h.1.attn.c_attn.bias (96,)", "is P('tensor')",
                "expected the bias P(Fused(3, 'tensor'))")


def test_fused_row_and_wrong_dim_of_a_conv1d_are_refused():
    model = _hf("gpt2")
    table = {"*.attn.c_attn.weight": P(sl.Fused(3, "tensor"), None), "*.attn.c_proj.weight": P(None, "tensor")}
    err = plan_error(sl.shard(table)(model), tensor_mesh(2))
    # as a row, its 32 in-features are not 3 blocks
    the_problem(err, "transformer.h.0.attn.c_attn.weight (32, 96)", "Conv1D", "is not 3 equal blocks")
    # a row of blocks that divide: refused against the layout GPT-2's forward reads (its output: a column)
    err = plan_error(sl.shard({"*.attn.c_attn.weight": P(sl.Fused(2, "tensor"), None),
                               "*.attn.c_proj.weight": P(None, "tensor"), "*.attn.c_proj.bias": P("tensor")})(
        _hf("gpt2")), tensor_mesh(2))
    the_problem(err, "transformer.h.0.attn.c_attn.weight", "a row split", "GPT2Attention",
                "expected P(None, Fused(3, 'tensor'))")


def test_tp_table_of_an_unknown_family_is_refused():
    from shardlib.planner.hf_tp import tp_table

    with pytest.raises(sl.ShardingError, match="tp_table: ToyLM is of family None"):
        tp_table(ToyLM())


def test_a_meta_built_transformers_model_plans_its_activations_as_a_built_one():
    """A meta build (init=False's case) has meta rotary tables; the activation trace reads them as zeros
    and prices the same collectives as the model built with values."""
    import hf_models
    from llama import LLAMA_TP

    batch = hf_models.batch("llama", 4, 0)
    comm = []
    for meta in (True, False):
        model = hf_models.build("llama", meta=meta)
        sl.shard(LLAMA_TP)(model)
        comm.append(sl.plan(model, sl.AbstractMesh({"data": 2, "tensor": 2}), zero=3, batch=batch).comm_per_step())
    assert any(e.what == "activations" for e in comm[0]) and comm[0] == comm[1]
