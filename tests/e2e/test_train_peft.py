"""The main job fine-tuning a transformers folder with LoRA over a frozen int8 base
(``model=hf model.path=<folder> lora=r8 quant=int8``), end to end, and its configuration errors.

One run of ``examples/train_gpt.py`` on the tiny Llama folder of ``test_train_hf`` (data 2,
ZeRO-3, 3 steps): each rank loads the folder, quantizes its linear layers with torchao's
``Int8WeightOnlyConfig``, seeds and wraps it with ``peft.get_peft_model``; the losses are those of the
same PEFT model trained in one process on the same rows, and the adapter folder the job writes at
the end (``engine.save_pretrained``) loads with ``PeftModel.from_pretrained`` onto the base, holding
that process's trained adapters. The base folder is left as it was. The configuration errors — a
LoRA run without a transformers folder, a rank of 0, a target that matches nothing, an unknown
quantization, an int4 group size that splits a layer's in-features, int8 on a model of Conv1D
projections (GPT-2), a quantized base with nothing to train — are named by config key in this process,
before any rank starts.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from test_train_hf import COMMON, SEQ, _example, _run   # made: the session's folder fixture (conftest.py)

STEPS = 3


def _digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _peft_model(folder, quant: str = "int8"):
    """The job's model in one process: the folder, its linear layers (not the head) int8 (torchao's
    ``Int8WeightOnlyConfig``) or NF4 (torchao's ``to_nf4``, as torchtune quantizes), LoRA r=8 on every
    linear layer, seeded with train.seed=0."""
    from peft import LoraConfig, get_peft_model
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    linear = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    if quant == "int8":
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: any(m is x for x in linear))
    else:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
        for m in linear:
            m.weight = torch.nn.Parameter(to_nf4(m.weight.detach()), requires_grad=False)
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))


def _reference(made, quant: str = "int8", folder=None) -> tuple[list[float], torch.nn.Module]:
    """The losses and the trained model of one process: the two data ranks' rows of each step
    stacked, AdamW with train=quick's settings (lr 3e-3 constant, clipping at 1.0) on the adapters."""
    from transformers import AutoTokenizer

    from shardlib.frontend.config.run_config import DataConfig
    from shardlib.frontend.data.tokens import load_tokens, local_batch

    tokenizer = AutoTokenizer.from_pretrained(made["folder"])
    data = DataConfig(source="dataset", path=str(made["root"] / "docs.jsonl"), megabytes=16)
    shares = [load_tokens(data, tokenizer, SEQ, d, 2) for d in range(2)]
    model = _peft_model(folder or made["folder"], quant).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        rows = [local_batch(shares[d], step, 8, SEQ, 0, d) for d in range(2)]
        batch = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:TorchaoLoraLinear was instantiated", "ignore:`is_gradient_checkpointing`")
def test_main_job_trains_lora_over_an_int8_base_and_writes_the_adapter_folder(made):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = made["root"] / "lora-int8"
    before = _digests(made["folder"])
    proc = _run(made, out, "mesh=dp2", "parallel=zero3", "lora=r8", "quant=int8", f"train.steps={STEPS}",
                f"data.path={made['root'] / 'docs.jsonl'}", f"checkpoint.every={STEPS}",
                f"checkpoint.dir={out / 'ckpt'}")
    want, trained = _reference(made)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True))
    assert rel <= 1e-5, f"{losses} vs one process {want} ({rel:.3g})"
    assert json.loads((out / "summary.json").read_text())["ranks_agree"]
    assert "saved the adapters to" in proc.stdout and "\r" not in proc.stdout + proc.stderr
    # PEFT's adapter folder: it loads onto the base and holds the adapters one process trained
    adapter = out / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(made["folder"], dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, adapter)
    mine = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    theirs = {n: p for n, p in trained.named_parameters() if "lora_" in n}
    assert mine.keys() == theirs.keys() and mine
    for name, p in theirs.items():
        torch.testing.assert_close(mine[name], p, rtol=1e-4, atol=1e-6, msg=name)
    assert any(p.abs().sum() > 0 for n, p in mine.items() if "lora_B" in n)     # trained: lora_B starts at 0
    assert _digests(made["folder"]) == before                                   # the base folder untouched
    # the step checkpoint leaves the frozen (quantized) base out: it is rebuilt from the folder on resume
    manifest = json.loads((out / "ckpt" / f"step-{STEPS:06d}" / "manifest.json").read_text())
    absent = set(manifest["absent"])
    assert absent and all("lora_" not in n for n in absent) and any("q_proj.base_layer" in n for n in absent)


@pytest.mark.slow
def test_main_job_trains_qlora_nf4_read_into_the_shards(made, tmp_path):
    """``lora=r8 quant=nf4`` at data 2 ZeRO-3: each rank builds the model on the meta device, marks its
    linear layers NF4, draws the adapters, and reads and quantizes its rows of the folder
    (``engine.load_pretrained``); the losses are torchao's NF4 base with the same adapters in one process
    (128 wide: NF4 needs whole blocks of 64 values and 256 blocks a weight)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(made["folder"])
    cfg.update({"hidden_size": 128, "intermediate_size": 256, "num_key_value_heads": 4, "head_dim": 32})
    folder = tmp_path / "llama-128"
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(made["folder"] / name, folder / name)
    out = tmp_path / "run"
    _run({**made, "folder": folder}, out, "mesh=dp2", "parallel=zero3", "lora=r8", "quant=nf4",
         f"train.steps={STEPS}", f"data.path={made['root'] / 'docs.jsonl'}")
    want, _ = _reference(made, "nf4", folder)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True))
    assert rel <= 1e-5, f"{losses} vs one process {want} ({rel:.3g})"
    assert "all_gather(data) 76 KiB" in (out / "plan.txt").read_text()    # packed NF4 moves, not fp32 (256 KiB)


# ---- configuration errors: named by key, in this process, before any rank starts --------------------

def test_lora_and_quant_errors_are_named_by_key(made, tmp_path, monkeypatch):
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setenv("HF_DATASETS_CACHE", made["env"]["HF_DATASETS_CACHE"])
    problems_of = _example("train_gpt").problems_of
    base = ["mesh=dp2", "parallel=zero3", *COMMON, f"model.path={made['folder']}",
            f"data.path={made['root'] / 'docs.jsonl'}"]

    def one(*args: str, prefix: list[str] = base) -> str:
        got = problems_of([*prefix, *args])
        assert len(got) == 1, got
        return got[0]

    assert problems_of([*base, "lora=r16", "quant=int8"]) == problems_of([*base, "lora=r8", "quant=int4"]) == []
    assert problems_of([*base, "lora=r8"]) == []            # a float base: read whole, adapters drawn on it
    assert one("lora=r8", "quant=int8", "lora.target_modules=[q_proj,lm_head]") == (
        "lora.target_modules: ('q_proj', 'lm_head') adapts lm_head, which quant=int8 leaves in float (the output "
        "head, or a layer the format cannot take) — expected adapters on the quantized linear layers only (e.g. "
        "all-linear). Leave these out of lora.target_modules.")
    assert one("lora=r8", prefix=["mesh=dp2", "parallel=dp", "model=tiny"]) == (
        "lora: lora=r8 fine-tunes a transformers folder — got model=tiny (the reference GPT); expected model=hf "
        "model.path=<folder>, or lora=none.")
    assert one("quant=int8").startswith("quant: quant=int8 freezes the base in int8, and with lora=none nothing "
                                        "would train")
    assert one("lora=r8", "lora.r=0") == "lora.r: got 0; expected an int >= 1."
    assert one("lora=r8", "lora.dropout=1.5") == "lora.dropout: got 1.5; expected a probability in [0, 1)."
    got = one("lora=r8", "lora.target_modules=[qproj,v_proj]")
    assert got.startswith(f"lora.target_modules: 'qproj' matches no module of the model in model.path={made['folder']}"
                          " — expected names of its linear layers (q_proj, ") and got.endswith("Did you mean q_proj?")
    assert one("lora=r8", "quant=int8", "quant.method=fp8").startswith("quant.method: 'fp8' is unknown — expected one "
                                                                       "of int8, int4")
    assert one("lora=r8", "quant=int4", "quant.group_size=48") == (
        "quant.group_size: 48 does not divide the in-features of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj "
        "(32) and down_proj (64) — expected a divisor of every quantized layer's in-features. Use "
        "quant.group_size=32 (or 16, 8).")
    gpt2 = tmp_path / "gpt2"                       # Conv1D projections: nothing for quant=int8 to quantize
    AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", vocab_size=300, n_embd=32, n_layer=1, n_head=4,
                                                          n_positions=64)).save_pretrained(gpt2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(made["folder"] / name, gpt2 / name)
    assert one("lora=r8", "quant=int8", f"model.path={gpt2}") == (
        f"quant: quant=int8 quantizes nn.Linear layers, and the model in model.path={gpt2} has none but its output "
        "head (its projections are Conv1D) — expected a model of nn.Linear projections (Llama, Qwen2, Mistral, ...), "
        "or quant=none.")
    assert one("lora=r8", "quant=int3").startswith("quant=int3: no such quant preset — expected one of int4, int8, "
                                                   "nf4, none")
    assert one("lora=r8", "quant=int4", "quant.method=nf4") == (
        "quant.group_size: 32 is not used by quant.method=nf4 (blocks of 64 values) — remove it, or use quant=int4.")
    got = problems_of([*base, "lora=r8", "quant=nf4"])      # 32-wide: no whole NF4 block of 64 values
    assert got[0] == ("quant: quantize: model.layers.0.self_attn.q_proj [32, 32] cannot be quantized as nf4 — got "
                      "in-features 32 (expected a multiple of block_size 64). Use another quant.method for this model "
                      "(int8 takes any shape), or quant=none. (the same in 2 blocks: 0..1)"), got
    assert len(got) == 7 and all("model.layers.0." in p for p in got)
