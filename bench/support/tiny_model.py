"""Tiny random-weight models (Llama, Gemma-3) and a locally trained tokenizer, built on demand.

No model can be downloaded on CI machines, and the product must still be shown on a
real vLLM engine: this builds one in a directory (a few MB, a few seconds), with a
fixed seed so two builds give the same weights and the same greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_SYLLABLES = ("ka", "lo", "mi", "nu", "re", "sa", "ti", "vo", "ze", "qu", "ph", "ch")
MARKER = "kvstore-tiny-llama.json"


def build_tiny_llama(directory: str | Path, *, layers: int = 2, hidden: int = 256,
                     kv_heads: int = 2, heads: int = 4, head_dim: int | None = None,
                     vocab: int = 512, max_positions: int = 32768, seed: int = 0) -> Path:
    """Write the model and tokenizer into `directory` (reused if already built).
    `head_dim` None: hidden // heads (Llama's default)."""
    spec = {"layers": layers, "hidden": hidden, "kv_heads": kv_heads, "heads": heads,
            "head_dim": head_dim, "vocab": vocab, "max_positions": max_positions, "seed": seed}
    return _build(directory, "llama", spec)


def build_tiny_gemma3(directory: str | Path, *, layers: int = 3, sliding_window: int = 256,
                      seed: int = 0) -> Path:
    """A Gemma-3-style text model: two sliding-window layers, then one full-attention
    layer (repeating), which vLLM's hybrid KV cache manager splits into KV cache groups."""
    spec = {"layers": layers, "hidden": 256, "kv_heads": 2, "heads": 4, "head_dim": 64, "vocab": 512,
            "max_positions": 32768, "seed": seed, "sliding_window": sliding_window}
    return _build(directory, "gemma3", spec)


def build_llama3_8b_geometry(directory: str | Path) -> Path:
    """Llama-3-8B's KV geometry (32 layers, 8 KV heads, head_dim 128: 128 KiB of float16
    KV per token, 32 MiB per 256-token chunk) around a tiny hidden size, so the connector
    moves the bytes a real 8B model would while a prefill stays affordable on a CPU."""
    return build_tiny_llama(directory, layers=32, hidden=256, heads=8, kv_heads=8, head_dim=128)


def prompt_token_ids(count: int, seed: int = 1, vocab: int = 512) -> list[int]:
    """A deterministic prompt of `count` token ids (skipping the special ids 0-2)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(count)]


def prompt_words(count: int, seed: int = 1) -> str:
    """A deterministic text of `count` words the tiny tokenizer was trained on."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(_SYLLABLES) + rng.choice(_SYLLABLES) + rng.choice(_SYLLABLES[:4])
                    for _ in range(count))


def _build(directory: str | Path, kind: str, spec: dict[str, Any]) -> Path:
    import torch

    path = Path(directory)
    marker = path / MARKER
    if marker.exists() and json.loads(marker.read_text()) == {**spec, **_kind(kind)}:
        return path
    path.mkdir(parents=True, exist_ok=True)
    save_tokenizer(path, spec["vocab"])
    torch.manual_seed(spec["seed"])
    model = _model(kind, spec).to(torch.bfloat16)
    model.save_pretrained(path)
    marker.write_text(json.dumps({**spec, **_kind(kind)}))
    return path


def _kind(kind: str) -> dict[str, str]:
    """Llama markers carry no kind, so models built before Gemma existed are reused."""
    return {} if kind == "llama" else {"kind": kind}


def _model(kind: str, spec: dict[str, Any]) -> Any:
    common = {"vocab_size": spec["vocab"], "hidden_size": spec["hidden"],
              "intermediate_size": 2 * spec["hidden"], "num_hidden_layers": spec["layers"],
              "num_attention_heads": spec["heads"], "num_key_value_heads": spec["kv_heads"],
              "head_dim": spec["head_dim"] or spec["hidden"] // spec["heads"],
              "max_position_embeddings": spec["max_positions"], "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "bfloat16"}
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layer_types = ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(spec["layers"])]
    return Gemma3ForCausalLM(Gemma3TextConfig(sliding_window=spec["sliding_window"], pad_token_id=0,
                                              layer_types=layer_types, **common))


def save_tokenizer(path: Path, vocab: int, extra_tokens: tuple[str, ...] = ()) -> Any:
    """The tiny BPE tokenizer (ids 0-2: unk, bos, eos), `extra_tokens` as special tokens
    after its `vocab` ids; written to `path`, and returned."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"])
    words = [a + b + c for a in _SYLLABLES for b in _SYLLABLES for c in _SYLLABLES[:4]]
    corpus = [" ".join(words[(i * 7 + j * 13) % len(words)] for j in range(32)) for i in range(200)]
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    if extra_tokens:
        fast.add_special_tokens({"additional_special_tokens": list(extra_tokens)})
    fast.save_pretrained(path)
    return fast
