"""A tiny random-weight Llama and a locally trained tokenizer, built on demand.

No model can be downloaded on CI machines, and the product must still be shown on a
real vLLM engine: this builds one in a directory (a few MB, a few seconds), with a
fixed seed so two builds give the same weights and the same greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

_SYLLABLES = ("ka", "lo", "mi", "nu", "re", "sa", "ti", "vo", "ze", "qu", "ph", "ch")
MARKER = "kvstore-tiny-llama.json"


def build_tiny_llama(directory: str | Path, *, layers: int = 2, hidden: int = 256,
                     kv_heads: int = 2, heads: int = 4, vocab: int = 512,
                     max_positions: int = 32768, seed: int = 0) -> Path:
    """Write the model and tokenizer into `directory` (reused if already built)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(directory)
    spec = {"layers": layers, "hidden": hidden, "kv_heads": kv_heads, "heads": heads,
            "vocab": vocab, "max_positions": max_positions, "seed": seed}
    marker = path / MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"])
    words = [a + b + c for a in _SYLLABLES for b in _SYLLABLES for c in _SYLLABLES[:4]]
    corpus = [" ".join(words[(i * 7 + j * 13) % len(words)] for j in range(32)) for i in range(200)]
    tokenizer.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    marker.write_text(json.dumps(spec))
    return path


def prompt_token_ids(count: int, seed: int = 1, vocab: int = 512) -> list[int]:
    """A deterministic prompt of `count` token ids (skipping the special ids 0-2)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(count)]
