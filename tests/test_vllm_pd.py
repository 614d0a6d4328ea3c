"""Prefill/decode disaggregation through the shared store, behind vLLM's own router.

A prefill server (`kv_producer`, host id `prefill`) and a decode server (`kv_consumer`,
host id `decode`), each with its own kvstore service and device in one shared "array"
directory, one real redis-server as the cluster index, and `vllm-router
--vllm-pd-disaggregation` in front (bench/support/pd_cluster.py). The model is a 4-layer random Llama with
8 KV heads of 128 (4 MiB per 256-token chunk; the 8B geometry's 32 layers take too long
to compute three times over on a shared 2-core machine); vLLM's prefix cache is off, so
every cached token is kvstore's. Through the router the decode's cached tokens are its
engine's own count (vLLM's metrics): the router empties usage.prompt_tokens_details.

The reference answers are the decode server's own, computed cold before any handoff
(same process, same start-up: the CPU engine's thread count changes greedy near-ties);
a decode that loaded answers as vLLM's tests require (bench/support/answers.py), one that
recomputed gives the same tokens and logprobs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.engines import assert_close

from bench.support.answers import identical
from bench.support.openai_server import Completion, complete, completion_body
from bench.support.pd_cluster import PDCluster, prefill_body, replay, router_unavailable
from bench.support.redis_server import redis_server_unavailable
from bench.support.tiny_model import build_tiny_llama, prompt_token_ids
from engine_plugin.vllm.core.handoff import PARAMS_KEY

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

CHUNK = 256
PD_WAIT_S = 3.0
MAX_TOKENS = 8
PROMPTS = {  # name: token ids; 2,100-2,700 tokens, as in the issue
    "a": prompt_token_ids(2100, seed=21), "b": prompt_token_ids(2400, seed=22),
    "c": prompt_token_ids(2700, seed=23),
    "replayed": prompt_token_ids(2305, seed=24),
    "lost": prompt_token_ids(2200, seed=25),
    "late": prompt_token_ids(2600, seed=26),
}
ROUTED = ("a", "b", "c")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[PDCluster]:
    reason = router_unavailable() or redis_server_unavailable()
    if reason:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("pd")
    model = build_tiny_llama(workdir / "model", layers=4, hidden=256, heads=8, kv_heads=8, head_dim=128)
    with PDCluster(model, workdir, pd_wait_s=PD_WAIT_S) as running:
        assert running.router is not None
        yield running


@pytest.fixture(scope="module")
def reference(cluster) -> dict[str, Completion]:
    """Each prompt computed by the decode server alone, before anything was handed off."""
    return {name: cluster.decode.complete(tokens, MAX_TOKENS) for name, tokens in PROMPTS.items()}


def test_a_consumer_alone_computes_everything_and_saves_nothing(cluster, reference):
    assert all(done.cached_tokens == 0 for done in reference.values())
    decode = cluster.counters("decode")
    assert not any(key.startswith(("put.", "dram.put", "disk.put")) for key in decode), decode
    info = cluster.decode_info()
    assert [tier["chunks"] for tier in info["tiers"]] == [0, 0], info["tiers"]


def test_through_the_router_the_decode_loads_what_the_prefill_wrote(cluster, reference):
    """The router sends the decode request the moment the prefill's reply arrives; the
    decode loads >= 90% of each prompt from the prefill's device and answers the same."""
    before = cluster.counters("decode")
    for name in ROUTED:
        done = cluster.send(PROMPTS[name], MAX_TOKENS)
        loadable = (len(PROMPTS[name]) - 1) // CHUNK * CHUNK
        assert done.cached_tokens == loadable >= 0.9 * len(PROMPTS[name]), name
        assert_close(reference[name], done, f"decode of {name}")
    after = cluster.counters("decode")
    grew = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    assert grew["handoff.requests"] == len(ROUTED)
    assert grew.get("handoff.expired", 0) == 0 and grew.get("handoff.mismatch", 0) == 0
    chunks = sum((len(PROMPTS[name]) - 1) // CHUNK for name in ROUTED)
    assert grew["peer.bytes_read"] >= chunks * cluster.decode_info()["chunk_bytes"]  # from the array
    assert [tier["chunks"] for tier in cluster.decode_info()["tiers"]][1] == 0  # nothing on its own device


def test_the_prefill_reply_names_its_chunks_and_a_decode_sent_at_once_hits(cluster, reference):
    """The router's two requests replayed by hand, the decode sent as the reply arrives."""
    tokens = PROMPTS["replayed"]
    prefilled, decoded = replay(cluster.prefill.url, cluster.decode.url,
                                completion_body(cluster.model, tokens, MAX_TOKENS))
    handoff = (prefilled.kv_transfer_params or {}).get(PARAMS_KEY)
    assert handoff is not None and handoff["chunks"] == len(tokens) // CHUNK
    assert handoff["host"] == "prefill"
    assert decoded.cached_tokens == (len(tokens) - 1) // CHUNK * CHUNK
    assert_close(reference["replayed"], decoded)


def test_saves_landing_after_the_prefill_replied_are_waited_for_and_loaded(cluster, reference):
    """The prefill's saves are still on their way when its reply reaches the decode: its
    service is paused from before the prefill request until a second after the decode
    request went out, so none of the prompt's chunks is stored when the decode first asks.
    The decode holds the request until every named chunk is readable, then loads them all."""
    tokens = PROMPTS["late"]
    body = completion_body(cluster.model, tokens, MAX_TOKENS)
    before = cluster.counters("decode")
    with ThreadPoolExecutor(1) as pool:
        with cluster.prefill_service_stopped():
            prefilled = complete(cluster.prefill.url, prefill_body(body))
            handoff = (prefilled.kv_transfer_params or {}).get(PARAMS_KEY)
            assert handoff is not None and handoff["chunks"] == len(tokens) // CHUNK
            decoding = pool.submit(complete, cluster.decode.url,
                                   {**body, "kv_transfer_params": prefilled.kv_transfer_params})
            time.sleep(1.0)  # the decode asks meanwhile and finds nothing yet
        decoded = decoding.result()
    assert decoded.cached_tokens == (len(tokens) - 1) // CHUNK * CHUNK
    assert_close(reference["late"], decoded)
    after = cluster.counters("decode")
    assert after.get("handoff.expired", 0) == before.get("handoff.expired", 0)


def test_with_the_prefill_saves_lost_the_decode_recomputes_within_its_deadline(cluster, reference):
    tokens = PROMPTS["lost"]
    body = completion_body(cluster.model, tokens, MAX_TOKENS)
    expired = cluster.counters("decode").get("handoff.expired", 0)
    with cluster.prefill_service_stopped():  # its saves never land while the decode waits
        prefilled = complete(cluster.prefill.url, prefill_body(body))
        assert PARAMS_KEY in (prefilled.kv_transfer_params or {})
        decoded = complete(cluster.decode.url, {**body, "kv_transfer_params": prefilled.kv_transfer_params})
    assert decoded.cached_tokens == 0
    assert identical(decoded, reference["lost"])
    assert decoded.seconds < reference["lost"].seconds + PD_WAIT_S + 3, decoded.seconds
    assert cluster.counters("decode")["handoff.expired"] == expired + 1
