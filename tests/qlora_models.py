"""QLoRA from a folder (issue 42): a tiny transformers Llama saved as an fp32 folder; the one-process
reference loads it whole (``from_pretrained``), quantizes it with ``sl.quantize`` and wraps it with
``peft.get_peft_model`` after ``torch.manual_seed(ADAPTER_SEED)``; the engine builds the same model on the
meta device, marks it with ``sl.quantize``, wraps it the same way (PEFT draws the adapters on the CPU: a
marked weight says it lives there) and loads the folder with ``engine.load_pretrained``, each rank
quantizing its own slices.

The Llama: hidden 128 (so a tensor split of 2 keeps NF4's blocks of 64 whole in every in-feature slice),
heads 4 / key-value heads 2, MLP 256, 2 layers; NF4 with scaler blocks of 64 (every projection holds
whole scaler blocks; torchao's default 256 needs 16384-element weights), int4 groups of 16.
"""

from __future__ import annotations

import logging

import torch

import shardlib as sl

ADAPTER_SEED, STEPS, ROWS, SEQ, LR = 1, 3, 4, 12, 1e-2
OPTIONS = {"nf4": {"scaler_block_size": 64}, "int4": {"group_size": 16}, "int8": {}}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
logging.getLogger("torchao").setLevel(logging.ERROR)


def config(**over):
    from transformers import LlamaConfig
    kw = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
              attn_implementation="sdpa")
    return LlamaConfig(**{**kw, **over})


def write_folder(path: str) -> str:
    """A random fp32 Llama (seed 0) saved with ``save_pretrained``."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    for p in model.parameters():            # norms away from 1: a wrong load shows
        if p.dim() == 1:
            torch.nn.init.uniform_(p, 0.5, 1.5)
    model.save_pretrained(path)
    return path


def wrap(model, fmt: str, r: int = 4):
    """``model`` quantized (or marked) with ``fmt`` (None: float), then LoRA on every projection."""
    from peft import LoraConfig, get_peft_model
    if fmt is not None:
        sl.quantize(model, fmt, **OPTIONS[fmt])
    torch.manual_seed(ADAPTER_SEED)
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, lora_dropout=0.0,
                                            init_lora_weights=False))


def batches() -> list[dict]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 96, (ROWS, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def train_one_process(model) -> list[float]:
    """``model`` trained on ``batches()`` by AdamW on what requires grad, in one process: the losses."""
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    losses = []
    for b in batches():
        opt.zero_grad(set_to_none=True)
        loss = model(**b).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def reference(path: str, fmt: str | None) -> dict:
    """One process: the folder loaded whole, quantized, wrapped, trained."""
    from transformers import LlamaForCausalLM
    model = wrap(LlamaForCausalLM.from_pretrained(path, dtype=torch.float32), fmt)
    first = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    losses = train_one_process(model)
    state = model.state_dict()
    return {"losses": losses, "first": first, "adapters": {k: v.detach().clone() for k, v in state.items()
                                                           if "lora_" in k},
            "base": {k: _float(v) for k, v in state.items() if "lora_" not in k}}


def engine(path: str, fmt: str | None, shape: dict, zero: int = 0):
    """The engine of the meta-built, marked, wrapped model on a ``shape`` mesh, loaded from ``path``."""
    from transformers import LlamaForCausalLM

    from shardlib.planner.hf_tp import tp_table
    from shardlib.testing import get_mesh

    mesh = get_mesh(shape)
    with torch.device("meta"):
        base = LlamaForCausalLM(config())
    model = wrap(base, fmt)
    if shape.get("tensor", 1) > 1:
        sl.shard(tp_table(model))(model)
    kw = {"rules": {"layers": "pipe"}, "microbatches": 2} if shape.get("pipe", 1) > 1 else {}
    plan = sl.plan(model, mesh, zero=zero, batch=batches()[0], **kw)
    eng = sl.parallelize(model, plan, optimizer=adamw, init=False)
    eng.load_pretrained(path)
    return eng, plan


def run(path: str, fmt: str | None, shape: dict, zero: int = 0) -> dict:
    """On every rank: the adapters as loaded, losses, the final adapters and base (full, dequantized),
    memory planned and held."""
    eng, plan = engine(path, fmt, shape, zero)
    first = {k: v for k, v in eng.full_state_dict().items() if "lora_" in k}
    losses = [float(eng.step(b)) for b in batches()]
    state = eng.full_state_dict()
    return {"losses": losses, "first": first, "adapters": {k: v for k, v in state.items() if "lora_" in k},
            "base": {k: _float(v) for k, v in state.items() if "lora_" not in k},
            "memory": plan.memory_per_rank(eng.mesh.rank), "held": eng.memory_held()}


def _float(t: torch.Tensor) -> torch.Tensor:
    from shardlib.quant import formats
    return formats.dequantize(t).float() if formats.is_quantized(t) else t.detach().float().clone()


def resume(path: str, fmt: str, first: tuple[dict, int], then: tuple[dict, int], ckpt: str, adapter_dir: str) -> dict:
    """Load and train one step on ``first`` (mesh shape, zero), save a checkpoint and the adapter folder; a
    fresh marked meta model on ``then`` loads the checkpoint (no folder): both states, and the next step's
    loss on each."""
    eng, _ = engine(path, fmt, *first)
    eng.step(batches()[0])
    eng.save(ckpt)
    eng.save_pretrained(adapter_dir)
    saved = {k: _float(v) for k, v in eng.full_state_dict().items()}
    loss_a = float(eng.step(batches()[1]))
    from transformers import LlamaForCausalLM

    from shardlib.planner.hf_tp import tp_table
    from shardlib.testing import get_mesh
    shape, zero = then
    with torch.device("meta"):
        model = wrap(LlamaForCausalLM(config()), fmt)
    if shape.get("tensor", 1) > 1:
        sl.shard(tp_table(model))(model)
    plan = sl.plan(model, get_mesh(shape), zero=zero, batch=batches()[0])
    other = sl.parallelize(model, plan, optimizer=adamw, init=False)
    other.load(ckpt)
    loaded = {k: _float(v) for k, v in other.full_state_dict().items()}
    return {"saved": saved, "loaded": loaded, "loss_a": loss_a, "loss_b": float(other.step(batches()[1]))}


def bnb_model(path: str):
    """The folder loaded as a user brings a QLoRA model: bitsandbytes 4-bit NF4, double-quantized
    (``BitsAndBytesConfig``, on the CPU), LoRA on every projection drawn from ``ADAPTER_SEED``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    base = AutoModelForCausalLM.from_pretrained(
        path, device_map="cpu", dtype=torch.float32,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32))
    torch.manual_seed(ADAPTER_SEED)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                                            init_lora_weights=False))
    # in train mode, as a trainer puts it: from_pretrained leaves it in eval, where bitsandbytes' Linear4bit
    # repacks a weight whose input needs no grad for its bf16 CPU inference kernel (another product)
    return model.train()


def _bnb_float(t: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes ``Params4bit`` as the float weight bitsandbytes multiplies by; anything else as ``_float``."""
    if type(t).__name__ == "Params4bit":
        import bitsandbytes.functional as bnbf
        return bnbf.dequantize_4bit(t.data, t.quant_state).float()
    return _float(t)


def bnb_reference(path: str) -> dict:
    """One process, bitsandbytes' own ``Linear4bit`` product: losses, adapters, base (dequantized)."""
    model = bnb_model(path)
    losses = train_one_process(model)
    params = dict(model.named_parameters())
    return {"losses": losses,
            "adapters": {k: v.detach().clone() for k, v in params.items() if "lora_" in k},
            "base": {k: _bnb_float(v) for k, v in params.items() if "lora_" not in k}}


def bnb_run(path: str, shape: dict, zero: int) -> dict:
    """On every rank: the bitsandbytes model planned and trained on a ``shape`` mesh (the base loaded whole on
    each rank, as from_pretrained leaves it); losses, final adapters and base (dequantized), memory."""
    from shardlib.planner.hf_tp import tp_table
    from shardlib.testing import get_mesh
    mesh = get_mesh(shape)
    model = bnb_model(path)
    if shape.get("tensor", 1) > 1:
        sl.shard(tp_table(model))(model)
    kw = {"rules": {"layers": "pipe"}, "microbatches": 2} if shape.get("pipe", 1) > 1 else {}
    plan = sl.plan(model, mesh, zero=zero, batch=batches()[0], **kw)
    eng = sl.parallelize(model, plan, optimizer=adamw)
    losses = [float(eng.step(b)) for b in batches()]
    state = eng.full_state_dict()
    return {"losses": losses, "adapters": {k: v for k, v in state.items() if "lora_" in k},
            "base": {k: _float(v) for k, v in state.items() if "lora_" not in k},
            "kinds": sorted({s.plan.quant.kind for s in eng.states if s.plan.quant is not None}),
            "params4bit": [k for k, v in model.named_parameters() if type(v).__name__ == "Params4bit"],
            "memory": plan.memory_per_rank(eng.mesh.rank), "held": eng.memory_held()}


def check_trains_like(res: dict, ref: dict, rank0: dict, where: str) -> None:
    """One rank's run against the one-process reference: the base bit for bit, losses within 1e-5 and the same
    as rank 0's, the trained adapters within round-off (Adam's normalized step turns the round-off of a
    near-zero gradient into ~lr), memory held = planned."""
    assert res["base"].keys() == ref["base"].keys(), (where, sorted(set(res["base"]) ^ set(ref["base"]))[:4])
    bad = [k for k, want in ref["base"].items() if not torch.equal(res["base"][k], want)]
    assert bad == [], f"{where}: base tensors differ from one process's (bit for bit): {bad[:4]}"
    rel = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref["losses"]))
    assert rel <= 1e-5, f"{where}: losses {res['losses']} vs one process's {ref['losses']}"
    assert res["losses"] == rank0["losses"], f"{where}: losses differ from rank 0's"
    assert res["adapters"].keys() == ref["adapters"].keys() and ref["adapters"], where
    for k, want in ref["adapters"].items():
        torch.testing.assert_close(res["adapters"][k], want, rtol=1e-3, atol=1e-2 * LR * STEPS,
                                   msg=lambda m, k=k: f"{where}, {k}: {m}")
    held, planned = res["held"], res["memory"]
    assert {k: held[k] for k in ("params", "grads", "optimizer")} == \
        {k: planned[k] for k in ("params", "grads", "optimizer")}, f"{where}: held {held}, planned {planned}"


def bnb_resume(path: str, ckpt: str) -> dict:
    """The bitsandbytes model stepped once at data 2 ZeRO-3 and saved (``engine.save``: its codes and scales as
    components); a fresh one at tensor 2 loads the checkpoint: which tensors differ, and the next loss on each."""
    from shardlib.planner.hf_tp import tp_table
    from shardlib.testing import get_mesh
    out: dict = {}
    for shape, zero in (({"data": 2}, 3), ({"data": 1, "tensor": 2}, 0)):
        model = bnb_model(path)
        if shape.get("tensor", 1) > 1:
            sl.shard(tp_table(model))(model)
        eng = sl.parallelize(model, sl.plan(model, get_mesh(shape), zero=zero, batch=batches()[0]), optimizer=adamw)
        if not out:
            eng.step(batches()[0])
            eng.save(ckpt)
            out["saved"] = {k: _float(v) for k, v in eng.full_state_dict().items()}
            out["loss_a"] = float(eng.step(batches()[1]))
        else:
            eng.load(ckpt)
            got = {k: _float(v) for k, v in eng.full_state_dict().items()}
            out["differ"] = [k for k, v in out.pop("saved").items() if not torch.equal(v, got[k])]
            out["loss_b"] = float(eng.step(batches()[1]))
    return out


def broken_folders(path: str, out: str) -> dict[str, str]:
    """Copies of the folder that a load must refuse: ``"int"`` (a projection stored as int32), ``"bnb"``
    (one stored as bitsandbytes stores a 4-bit weight: packed uint8 codes with ``absmax`` and ``quant_state``)."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file
    state = load_file(os.path.join(path, "model.safetensors"))
    name = f"{'model.layers.0.self_attn.q_proj'}.weight"
    made = {}
    for kind in ("int", "bnb"):
        folder = os.path.join(out, kind)
        os.makedirs(folder, exist_ok=True)
        shutil.copy(os.path.join(path, "config.json"), folder)
        s = dict(state)
        if kind == "int":
            s[name] = s[name].to(torch.int32)
        else:
            s[name] = torch.zeros(s[name].numel() // 2, 1, dtype=torch.uint8)
            s[name + ".absmax"] = torch.ones(s[name].numel() * 2 // 64)
            s[name + ".quant_state.bitsandbytes__nf4"] = torch.tensor(list(json.dumps({"quant_type": "nf4"}).encode()),
                                                                      dtype=torch.uint8)
        save_file(s, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        made[kind] = folder
    return made


def refusals(path: str, folders: dict[str, str]) -> dict[str, str]:
    """On every rank: what each bad load says, and whether the engine still refuses to step after it."""
    from transformers import LlamaForCausalLM

    from shardlib.quant.layout import pack
    from shardlib.testing import get_mesh
    out = {}

    def marked(fmt="nf4"):
        with torch.device("meta"):
            return wrap(LlamaForCausalLM(config()), fmt)

    mesh = get_mesh({"data": 2})
    model = marked()
    plan = sl.plan(model, mesh, zero=3, batch=batches()[0])
    try:
        sl.parallelize(model, plan, optimizer=adamw)
    except sl.ShardingError as e:
        out["init"] = str(e)
    for kind, fmt in (("int", "nf4"), ("bnb", None)):
        model = marked(fmt)
        eng = sl.parallelize(model, sl.plan(model, mesh, zero=3, batch=batches()[0]), optimizer=adamw, init=False)
        held = [pack(s.param).clone() if s.store is None else s.shard.clone() for s in eng.states if s.plan.quant]
        try:
            eng.load_pretrained(folders[kind])
        except sl.CheckpointError as e:
            out[kind] = str(e)
        after = [pack(s.param) if s.store is None else s.shard for s in eng.states if s.plan.quant]
        out[kind + "_untouched"] = all(torch.equal(a, b) for a, b in zip(held, after))
        try:
            eng.step(batches()[0])
        except sl.CheckpointError as e:
            out[kind + "_step"] = str(e)
    return out


def killed_mid_load(path: str, out: str) -> None:
    """Under ``sl.launch`` at data 2 ZeRO-3: rank 1 dies (``os._exit``, as a ``kill -9`` leaves it) while quantizing
    its second weight; rank 0 writes to ``out`` what its load raised, whether any of its quantized pieces changed,
    and what a step then says."""
    import json
    import os

    import shardlib.runtime.pretrained.core as core
    from shardlib.testing import get_mesh

    mesh = get_mesh({"data": 2})
    with torch.device("meta"):
        base = __import__("transformers").LlamaForCausalLM(config())
    model = wrap(base, "nf4")
    plan = sl.plan(model, mesh, zero=3, batch=batches()[0])
    eng = sl.parallelize(model, plan, optimizer=adamw, init=False)
    real, calls = core.quantized_shard, []

    def dying(*args, **kwargs):
        calls.append(1)
        if mesh.rank == 1 and len(calls) == 2:
            os._exit(1)
        return real(*args, **kwargs)

    core.quantized_shard = dying
    before = {s.name: s.shard.clone() for s in eng.states if s.plan.quant is not None}
    record = {"error": None, "step": None}
    try:
        eng.load_pretrained(path)
    except Exception as e:       # noqa: BLE001 — what the surviving rank is told
        record["error"] = f"{type(e).__name__}: {e}"
    record["quantized_filled"] = sum(not torch.equal(before[s.name], s.shard) for s in eng.states
                                     if s.plan.quant is not None)
    record["needs_load"] = bool(eng.needs_load)
    try:
        eng.step(batches()[0])
    except Exception as e:       # noqa: BLE001
        record["step"] = f"{type(e).__name__}: {e}"
    with open(out, "w") as f:
        json.dump(record, f)
