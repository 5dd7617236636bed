"""Experts kept one module each (``planner/stacked.py``): the reference GPT's ``ExpertList`` (an
``nn.ModuleList`` of SwiGLU modules) and transformers' Switch Transformers (an ``nn.ModuleDict`` of
``expert_{i}`` modules, routed by a one-hot mask) are stacked where the mesh has an expert axis, each rank
holding whole experts, and train as one process trains them — every loss and every parameter, compared
through the experts' own names (``state_dict`` keeps them)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import shardlib as sl
from shardlib.models.gpt import GPT, GPTConfig, token_batch
from shardlib.planner.stacked import StackedExperts, stack_experts

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2, n_experts=4, top_k=2,
                expert_width=24, shared_experts=1, aux_loss=0.05, expert_modules=True)
STEPS, BATCH = 3, 8
# T5's unnormalized attention leaves near-zero gradients that AdamW turns into ~lr steps whose sign the batch
# split's sum order sets: at lr 1e-2 the losses were 3.4e-5 apart at step 3 on the 2026-12-08 machine (1e-7 on
# November's); at 1e-3 those steps are ten times smaller, and every expert is still chosen at every step
SWITCH_LR = 1e-3
TENSOR = {"heads": "tensor", "mlp": "tensor", "vocab": "tensor", "expert_mlp": "tensor"}


def _opt(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-6)


def _switch_opt(params):
    """Switch's optimizer: see ``SWITCH_LR``."""
    return torch.optim.AdamW(params, lr=SWITCH_LR, weight_decay=0.01, eps=1e-6)


def _one_process(model, batches, loss, unrouted: list | None = None, opt=_opt):
    """``model`` trained in one process; ``unrouted`` gets, per step, the parameters without a gradient (a
    container that runs only the experts some row chose leaves the others' None, and AdamW skips them: stacked,
    they get a zero gradient, as transformers 5's fused experts do — so the comparison needs every expert chosen)."""
    opt = opt([p for p in model.parameters() if p.requires_grad])
    losses = []
    for b in batches:
        out = loss(model, b)
        out.backward()
        if unrouted is not None:
            unrouted.append([n for n, p in model.named_parameters() if p.requires_grad and p.grad is None])
        opt.step()
        opt.zero_grad()
        losses.append(float(out.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _per_expert(make, full: dict) -> dict:
    """The engine's full state (stacked names) by the experts' own names: a stacked copy of the model loads it
    and gives its ``state_dict``."""
    model = make()
    stack_experts(model)
    model.load_state_dict(full)
    return model.state_dict()


def _train_gpt(shape: dict, cfg: GPTConfig, zero: int, meta: bool = False):
    mesh = sl.Mesh(shape)
    batches = [token_batch(cfg, BATCH, step) for step in range(STEPS)]
    want_losses, want = _one_process(GPT(cfg, seed=0), batches, lambda m, b: m(*b))
    with torch.device("meta" if meta else "cpu"):      # on meta: each rank builds its experts' values alone
        model = GPT(cfg, seed=0)
    rules = {"experts": "expert", **(TENSOR if "tensor" in shape else {})}
    plan = sl.plan(model, mesh, rules=rules, zero=zero, batch=batches[0])
    engine = sl.parallelize(model, plan, optimizer=_opt)
    held = {n: tuple(p.shape) for n, p in model.named_parameters() if ".experts." in n}
    losses = [engine.step(b) for b in batches]
    got = _per_expert(lambda: GPT(cfg, seed=0), engine.full_state_dict())
    return {"losses": losses, "want_losses": want_losses, "held": held, "counts": engine.tokens_per_expert,
            "stacked": [n for n, m in model.named_modules() if isinstance(m, StackedExperts)],
            "planned": plan.memory_per_rank(mesh.rank)["params"], "params": {k: (got[k], want[k]) for k in want}}


def _like_one_process(r: dict, atol: float = 1e-5) -> None:
    assert r["losses"] == pytest.approx(r["want_losses"], rel=1e-5), (r["losses"], r["want_losses"])
    for k, (got, want) in r["params"].items():
        torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=k)


@pytest.mark.parametrize("shape, zero, meta", [({"expert": 2}, 0, False), ({"data": 2, "expert": 2}, 3, True),
                                               ({"expert": 4}, 1, False), ({"expert": 2, "tensor": 2}, 2, True)],
                         ids=["expert2", "data2_expert2_zero3_meta", "expert4_zero1", "expert2_tensor2_zero2_meta"])
def test_a_module_list_of_experts_is_stacked_split_and_trains_like_one_process(world, shape, zero, meta):
    """Built on the meta device, the stacked experts get the values the list's build gives (each expert's
    modules initialized in turn: ``StackedExperts.replay``)."""
    for r in world(math.prod(shape.values()), _train_gpt, shape, CFG, zero, meta):
        _like_one_process(r)
        assert r["stacked"] == ["blocks.0.mlp.experts", "blocks.1.mlp.experts"]
        per, t = CFG.n_experts // shape["expert"], shape.get("tensor", 1)
        assert r["held"] == {f"blocks.{i}.mlp.experts.{n}": s for i in range(2) for n, s in
                             [("gate_up_weight", (per, 2 * CFG.expert_width // t, CFG.d_model)),
                              ("down_weight", (per, CFG.d_model, CFG.expert_width // t))]}, r["held"]
        assert all(sum(c) == BATCH * CFG.seq_len * CFG.top_k for c in r["counts"].values()), r["counts"]


def test_stacking_keeps_the_models_function_and_its_names():
    """One process: a stacked model computes what the list computes (loss and every gradient), its
    ``state_dict`` has the list's names and values, and it loads a list's ``state_dict``."""
    a, b = GPT(CFG, seed=0), GPT(CFG, seed=0)
    assert stack_experts(b) == ["blocks.0.mlp.experts", "blocks.1.mlp.experts"] and stack_experts(b) == []
    idx, targets = token_batch(CFG, 4, 0)
    la, lb = a(idx, targets), b(idx, targets)
    assert float(la) == float(lb)
    la.backward()
    lb.backward()
    for i in range(CFG.n_experts):
        torch.testing.assert_close(b.blocks[1].mlp.experts.down_weight.grad[i],
                                   a.blocks[1].mlp.experts[i].down.weight.grad, rtol=0, atol=0)
    assert {k: v.shape for k, v in b.state_dict().items()} == {k: v.shape for k, v in a.state_dict().items()}
    c = GPT(CFG, seed=1)
    stack_experts(c)
    c.load_state_dict(a.state_dict())
    assert torch.equal(c.blocks[0].mlp.experts.gate_up_weight[3], a.blocks[0].mlp.experts[3].gate_up.weight)
    assert len(b.blocks[0].mlp.experts) == CFG.n_experts and "4 experts stacked" in repr(b.blocks[0].mlp.experts)


def test_a_list_its_block_loops_over_is_refused_naming_the_forward_to_give_it():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(8, 4, bias=False)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            w, idx = torch.softmax(self.gate(x), -1).topk(1, dim=-1)
            return sum(torch.where(idx == e, w, 0.0) * expert(x) for e, expert in enumerate(self.experts))

    with pytest.raises(sl.ShardingError) as e:
        sl.plan(torch.nn.Sequential(Block(), Block()), sl.AbstractMesh({"data": 2, "expert": 2}),
                rules={"experts": "expert"})
    said = str(e.value)
    assert "one module each: '0.experts' (4 modules), '1.experts' (4 modules)" in said, said
    assert "Give the container a forward taking (hidden_states [T, H], top_k_index [T, k], top_k_weights" in said


# --- transformers: Switch Transformers' experts are an nn.ModuleDict routed by a one-hot mask -----------------

def _switch():
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration
    cfg = SwitchTransformersConfig(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, num_experts=4, expert_capacity=64, num_sparse_encoder_layers=1,
                                   num_sparse_decoder_layers=1, router_jitter_noise=0.0, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return SwitchTransformersForConditionalGeneration(cfg)


def _switch_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(2, 64, (BATCH, 10), generator=g),
            "labels": torch.randint(2, 64, (BATCH, 16), generator=g)}


def _train_switch(shape: dict, capacity: int):
    def make():
        m = _switch()
        for mod in m.modules():
            if hasattr(mod, "expert_capacity"):
                mod.expert_capacity = capacity
        return m
    mesh = sl.Mesh(shape)
    batches = [_switch_batch(step) for step in range(STEPS)]
    ref, unrouted, dropped = make(), [], []
    for m in ref.modules():            # the rows Switch's router drops past a capacity: a one-hot row of zeros
        if type(m).__name__ == "SwitchTransformersTop1Router":
            m.register_forward_hook(lambda _m, _i, out: dropped.append(int((out[0].sum(-1) == 0).sum())))
    want_losses, want = _one_process(ref, batches, lambda m, b: m(**b).loss, unrouted, _switch_opt)
    model = make()
    engine = sl.parallelize(model, sl.plan(model, mesh, rules={"experts": "expert"}), optimizer=_switch_opt)
    losses = [engine.step(b) for b in batches]
    got = _per_expert(make, engine.full_state_dict())
    held = {n: tuple(p.shape) for n, p in model.named_parameters() if ".experts." in n}
    return {"losses": losses, "want_losses": want_losses, "held": held, "params": {k: (got[k], want[k]) for k in want},
            "unrouted": unrouted, "dropped": sum(dropped)}


@pytest.mark.parametrize("shape, capacity", [({"expert": 2}, 64), ({"data": 2, "expert": 2}, 6)],
                         ids=["expert2", "data2_expert2_capacity6"])
def test_switch_transformers_experts_split_over_the_expert_axis_train_like_one_process(world, shape, capacity):
    """Switch's router keeps each expert's first ``expert_capacity`` tokens of every sequence (a row past it gets
    an all-zero mask): the batch splits by whole sequences, so the same rows are dropped on every layout."""
    for r in world(math.prod(shape.values()), _train_switch, shape, capacity):
        assert r["unrouted"] == [[]] * STEPS, r["unrouted"]        # every expert chosen at every step
        assert (r["dropped"] > 0) == (capacity < 64), r["dropped"]
        # T5's unnormalized attention: AdamW's step on near-zero gradients magnifies the batch split's sum order
        # (data 4 alone, no expert axis: 8e-6; here up to 3e-5, the losses equal to 1e-7)
        _like_one_process(r, atol=1e-4)
        per = 4 // shape["expert"]
        assert r["held"] and all(s[0] == per for s in r["held"].values()), r["held"]


def test_a_stacked_model_plans_on_the_meta_device_with_its_experts_split():
    with torch.device("meta"):
        model = GPT(replace(CFG, n_layers=1), seed=0)
    plan = sl.plan(model, sl.AbstractMesh({"data": 2, "expert": 2}), rules={"experts": "expert"}, zero=3)
    assert isinstance(model.blocks[0].mlp.experts, StackedExperts)
    spec = plan.param("blocks.0.mlp.experts.gate_up_weight").spec
    assert spec.dim_axes(0) == ("expert",), spec
    assert "2 of 4 experts per rank" in plan.explain(max_params=0)


def _switch_folders(shape: dict, folder: str):
    """A Switch folder written by transformers (each expert's own tensors) read into stacked experts split over
    ``shape`` on a meta model (``init=False``), then written back by the engine."""
    from safetensors import safe_open
    from transformers import SwitchTransformersForConditionalGeneration
    mesh = sl.Mesh(shape)
    src, out = f"{folder}/hf", f"{folder}/engine"
    if mesh.rank == 0:
        _switch().save_pretrained(src)
    torch.distributed.barrier()
    want = _switch().state_dict()
    with torch.device("meta"):
        model = _switch()
    engine = sl.parallelize(model, sl.plan(model, mesh, rules={"experts": "expert"}), optimizer=_opt, init=False)
    engine.load_pretrained(src)
    got = _per_expert(_switch, engine.full_state_dict())
    engine.save_pretrained(out)
    res = {"loaded": {k: (got[k], want[k]) for k in want}}
    if mesh.rank == 0:
        with safe_open(f"{out}/model.safetensors", "pt") as a, safe_open(f"{src}/model.safetensors", "pt") as b:
            res["keys"] = (sorted(a.keys()), sorted(b.keys()))
        back = SwitchTransformersForConditionalGeneration.from_pretrained(out).state_dict()
        res["written"] = {k: (back[k], want[k]) for k in want}
    return res


def test_a_switch_folder_reads_into_split_experts_and_is_written_back_as_transformers_writes_it(world, tmp_path):
    for r in world(4, _switch_folders, {"data": 2, "expert": 2}, str(tmp_path)):
        for k, (got, want) in r["loaded"].items():
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=k)
        if "keys" in r:
            assert r["keys"][0] == r["keys"][1] and any(".experts.expert_3.wi.weight" in k for k in r["keys"][0])
            for k, (got, want) in r["written"].items():
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=k)


def test_nllb_moe_experts_stack_keeping_the_models_loss_and_names():
    """NLLB-MoE's experts (an ``nn.ModuleDict`` beside its token dropout, routed by index): stacked in one
    process, the loss and the ``state_dict`` are the list's."""
    from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration
    cfg = NllbMoeConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=48,
                        decoder_ffn_dim=48, encoder_attention_heads=4, decoder_attention_heads=4, num_experts=4,
                        expert_capacity=64, encoder_sparse_step=1, decoder_sparse_step=1, dropout=0.0,
                        max_position_embeddings=64)
    torch.manual_seed(0)
    a = NllbMoeForConditionalGeneration(cfg).eval()
    torch.manual_seed(0)
    b = NllbMoeForConditionalGeneration(cfg).eval()
    assert len(stack_experts(b)) == 4
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(3, 64, (2, 10), generator=g), "labels": torch.randint(3, 64, (2, 8), generator=g)}
    assert float(a(**batch).loss) == float(b(**batch).loss)
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_quantized_experts_one_module_each_are_refused_naming_how_to_stack_then_quantize():
    model = GPT(CFG, seed=0)
    for p in model.parameters():
        p.requires_grad_(False)
    sl.quantize(model, "int8", modules="*.experts.*")
    with pytest.raises(sl.ShardingError) as e:
        sl.plan(model, sl.AbstractMesh({"expert": 2}), rules={"experts": "expert"})
    said = str(e.value)
    assert "'blocks.0.mlp.experts' are one module each with quantized weights (blocks.0.mlp.experts.0.gate_up.weight" \
        in said and "stack_experts(model)" in said and "parameters=['*.experts.*']" in said, said
    for fmt in ("int4", "nf4"):             # what the message says: stack first, then quantize the 3-D weights
        stacked = GPT(CFG, seed=0)
        stack_experts(stacked)
        for p in stacked.parameters():
            p.requires_grad_(False)
        sl.quantize(stacked, fmt, parameters=["*.experts.*"], group_size=8, block_size=8, scaler_block_size=32)
        names = [n for n, p in stacked.named_parameters() if p.dim() == 3]
        assert names and all(type(stacked.get_parameter(n)).__name__ == {"int4": "Int4Tensor", "nf4": "NF4Stack"}[fmt]
                             for n in names), names
        plan = sl.plan(stacked, sl.AbstractMesh({"expert": 2}), rules={"experts": "expert"})
        assert plan.param(names[0]).spec.dim_axes(0) == ("expert",) and plan.param(names[0]).quant is not None


def test_lora_inside_experts_one_module_each_is_refused_naming_stack_then_adapt():
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(GPT(CFG, seed=0), LoraConfig(r=2, target_modules=["gate_up", "down"]))
    with pytest.raises(sl.ShardingError) as e:
        sl.plan(model, sl.AbstractMesh({"expert": 2}), rules={"experts": "expert"})
    assert "one module each with PEFT adapters inside" in str(e.value) and "target_parameters" in str(e.value)
