"""A local transformers causal-LM folder as the main job's model (``model=hf model.path=<folder>``).

The folder is what ``save_pretrained`` writes (and what a Hub snapshot holds): ``config.json``,
the weights as safetensors (one file, or a sharded set with its index), the tokenizer's files.
``folder_problems`` reads the config and tokenizer only — no weights — and says by config key what
is wrong before any process starts: no folder, no config, not a causal LM, no weights, a tokenizer
that does not load or whose ids the model's vocabulary cannot hold, a sequence longer than the
model's positions.

The run's ``parallel`` preset means what it means for the reference GPT: ``parallel=tp`` (rules
``heads``/``mlp``/``vocab`` -> ``tensor``) gives the family's Megatron table (``planner/hf_tp.py``),
``zero3`` shards everything over ``data``, and a ``pipe`` axis cuts the model's layer stack. The
values never exist whole on a rank: each builds the model with its parameters on the meta device,
``sl.parallelize(..., init=False)``, and ``engine.load_pretrained(folder)`` reads its pieces.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch
from torch import nn

from .config.run_config import RunConfig


def layout_table(model: nn.Module, run: RunConfig) -> dict[str, Any]:
    """``model``'s table for the run's ``parallel`` preset: where its rules map ``heads``/``mlp`` to a
    mesh axis of size > 1, the family's Megatron table over that axis (``planner/hf_tp.tp_table``; the
    embedding and head vocab-parallel where ``vocab`` maps there too)."""
    from ..planner.hf_tp import tp_table
    rules, shape = run.rules(), run.mesh.shape
    axis = rules.get("heads") or rules.get("mlp")
    table: dict[str, Any] = {}
    if isinstance(axis, str) and shape.get(axis, 1) > 1:
        table.update(tp_table(model, vocab=rules.get("vocab") == axis, axis=axis))
    return table                  # under a pipe axis the planner finds the layer stack (planner/stack.py)


def _weights(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.safetensors.index.json"))


def folder_problems(run: RunConfig) -> list[str]:
    """What is wrong with ``model.path`` for training, by config key; reads config and tokenizer only."""
    path = run.model.path
    folder = pathlib.Path(path).expanduser()
    if not folder.exists():
        return [f"model.path: {path} does not exist — expected a transformers causal-LM folder (config.json, "
                f"safetensors, tokenizer files). Check the path (relative paths are taken from {pathlib.Path.cwd()}), "
                "or make a small one with python examples/make_tiny_hf.py <folder>."]
    if not folder.is_dir() or not (folder / "config.json").is_file():
        what = "is a file" if not folder.is_dir() else "has no config.json"
        return [f"model.path: {path} {what} — expected a folder written by save_pretrained (config.json, safetensors, "
                "tokenizer files)."]
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL
    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [f"model.path: {path}/config.json cannot be read as a transformers config ({first}) — expected the "
                "config.json save_pretrained writes."]
    problems = []
    archs = getattr(config, "architectures", None) or []
    causal = set(CAUSAL.values())
    if config.model_type not in CAUSAL or (archs and not any(a in causal for a in archs)):
        problems.append(f"model.path: {path} holds a {', '.join(archs) or config.model_type} (model_type "
                        f"{config.model_type!r}), not a causal language model — expected a folder of a *ForCausalLM "
                        "model (Llama, Qwen2, Mistral, GPT-2, ...), which trains on next-token prediction.")
        return problems
    if not _weights(folder):
        problems.append(f"model.path: {path} has no weights — expected model.safetensors, or model-*.safetensors "
                        "with model.safetensors.index.json (save_pretrained(..., safe_serialization=True)).")
    try:
        tokenizer = load_tokenizer(str(folder))
    except Exception as e:  # noqa: BLE001 — transformers raises many kinds for a missing or broken tokenizer
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        problems.append(f"model.path: {path}'s tokenizer does not load ({type(e).__name__}: {first}) — expected the "
                        "tokenizer files tokenizer.save_pretrained writes (tokenizer.json, tokenizer_config.json).")
    else:
        vocab = config.get_text_config().vocab_size
        if len(tokenizer) > vocab:
            problems.append(f"model.path: {path}'s tokenizer has {len(tokenizer)} entries, more than the model's "
                            f"vocab_size={vocab} — expected a tokenizer whose ids the embedding holds; the folder "
                            "mixes a tokenizer and a model of different vocabularies.")
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if positions is not None and run.seq > positions:
        key = "train.seq" if run.train.seq is not None else "model.seq_len"
        problems.append(f"{key}: {run.seq} tokens is longer than the model's max_position_embeddings={positions} — "
                        f"expected {key} <= {positions}.")
    return problems


def load_tokenizer(folder: str):
    """The folder's own tokenizer (``AutoTokenizer``)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


def meta_model(run: RunConfig) -> nn.Module:
    """The folder's model on the meta device (no values), its layout table attached: what ``check``
    plans on an ``AbstractMesh``, and what each rank parallelizes with ``init=False`` (which computes
    the buffers the weights do not carry, such as rotary tables) and fills with
    ``engine.load_pretrained(model.path)``."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(run.model.path)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _annotated(model, run)


def pretrained_model(run: RunConfig) -> nn.Module:
    """The folder's model with its values (``from_pretrained``, fp32), its layout table attached: the
    base a LoRA run quantizes and wraps on every rank (``frontend/finetune.py``)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.logging import disable_progress_bar
    disable_progress_bar()            # a bar per rank, on the job's own output
    model = AutoModelForCausalLM.from_pretrained(run.model.path, dtype=torch.float32)
    model.config.use_cache = False
    return _annotated(model, run)


def _annotated(model: nn.Module, run: RunConfig) -> nn.Module:
    from ..planner.specs import shard
    model.train()
    table = layout_table(model, run)
    return shard(table)(model) if table else model


def example_batch(run: RunConfig) -> dict[str, torch.Tensor]:
    """A global batch of zeros as ``model(**batch)`` takes it: real tensors (small), since transformers'
    mask helpers read values and the planner's trace then runs on the CPU."""
    ids = torch.zeros(run.train.batch, run.seq, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}

