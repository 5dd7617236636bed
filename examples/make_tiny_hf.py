"""Make a small transformers causal-LM folder offline — config, tokenizer, random weights — to train
with the main job when you have no model folder at hand:

    python examples/make_tiny_hf.py tiny-llama                      # Llama, ~0.2 M parameters
    python examples/make_tiny_hf.py tiny-qwen --family qwen2 --hidden 128 --layers 4
    python examples/make_tiny_hf.py tiny-gpt2 --family gpt2         # Conv1D, fused q|k|v, tied embeddings
    python examples/train_gpt.py model=hf model.path=tiny-llama mesh=dp2_tp2 parallel=tp

What a Hub model folder holds, made here with no download: a byte-level BPE tokenizer trained with
the ``tokenizers`` library on local text (the Python standard library's source, or ``--text FILE``),
wrapped as a ``PreTrainedTokenizerFast`` and saved (``tokenizer.json``, ``tokenizer_config.json``);
a config of the family (``config.json``) whose vocabulary is the tokenizer's; the model built from
it with random weights (seeded) and written by ``save_pretrained`` (``model.safetensors``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

EOS = "<|endoftext|>"
FAMILIES = ("llama", "mistral", "qwen2", "gpt2")


def train_tokenizer(text: str, vocab: int):
    """A byte-level BPE of ``vocab`` entries (its 256 bytes, the end-of-text token, merges) on ``text``,
    as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = text.splitlines(keepends=True)
    tok.train_from_iterator((("".join(lines[i:i + 200])) for i in range(0, len(lines), 200)), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                   model_max_length=10**9)


def make(out: str | pathlib.Path, *, family: str = "llama", vocab: int = 384, hidden: int = 64, layers: int = 2,
         heads: int = 4, kv_heads: int = 2, intermediate: int = 172, positions: int = 256, seed: int = 0,
         text: str | None = None, megabytes: float = 1.0) -> pathlib.Path:
    """Write the folder ``out`` (created); return its path."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils.logging import disable_progress_bar

    from shardlib.frontend.config.run_config import DataConfig
    from shardlib.frontend.data.text import load_text

    if family not in FAMILIES:
        raise SystemExit(f"make_tiny_hf.py: --family {family} is not one of {', '.join(FAMILIES)}")
    data = DataConfig(source="file" if text else "stdlib", path=text, megabytes=megabytes)
    raw = bytes(load_text(data, 16).to(torch.uint8).tolist())
    tokenizer = train_tokenizer(raw.decode("utf-8", errors="ignore"), vocab)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=None,
               use_cache=False)          # packed text: no padding
    if family == "gpt2":          # Conv1D projections, fused q|k|v, learned positions, tied embeddings
        config = AutoConfig.for_model(family, vocab_size=len(tokenizer), n_embd=hidden, n_inner=intermediate,
                                      n_layer=layers, n_head=heads, n_positions=positions, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, **ids)
    else:
        config = AutoConfig.for_model(
            family, vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=hidden // heads, max_position_embeddings=positions, tie_word_embeddings=False,
            attention_dropout=0.0, **ids)
    disable_progress_bar()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out", help="the folder to write")
    ap.add_argument("--family", default="llama", choices=FAMILIES)
    ap.add_argument("--vocab", type=int, default=384, help="tokenizer entries (>= 257: bytes + end-of-text)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2, help="grouped-query KV heads (not gpt2)")
    ap.add_argument("--intermediate", type=int, default=172)
    ap.add_argument("--positions", type=int, default=256, help="max_position_embeddings")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", default=None, help="a UTF-8 text file to train the tokenizer on (default: the stdlib)")
    a = ap.parse_args(argv)
    if a.vocab < 257 or a.hidden % a.heads or a.heads % a.kv_heads:
        raise SystemExit("make_tiny_hf.py: expected --vocab >= 257, --heads dividing --hidden and --kv-heads "
                         f"dividing --heads — got vocab {a.vocab}, hidden {a.hidden}, heads {a.heads}, "
                         f"kv-heads {a.kv_heads}")
    out = make(a.out, family=a.family, vocab=a.vocab, hidden=a.hidden, layers=a.layers, heads=a.heads,
               kv_heads=a.kv_heads, intermediate=a.intermediate, positions=a.positions, seed=a.seed, text=a.text)
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}", file=sys.stdout)


if __name__ == "__main__":
    main()
