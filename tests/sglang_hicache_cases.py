"""kvstore as SGLang's HiCache storage backend, against the installed SGLang (the `sglang`
extra): created by SGLang's own StorageBackendFactory from its `dynamic` extra config,
moving pages in and out of SGLang's own host KV pools (built on the CPU,
bench/sglang_pools.py), through a real kvstore service with a disk tier.

Not collected by the main run: tests/test_own_process.py runs this file in a pytest
process of its own, because importing SGLang patches transformers (and points JIT caches
at its own directory through the environment) for the rest of the process."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import corrupt_record
from engine_harness import service_client, small_service_config, stop_service

from bench.sglang_pools import PAGE_SIZE, mha_host_pool, mla_host_pool, storage_config
from kvstore.format.errors import ConfigError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs the sglang extra")


ROOT = Path(__file__).resolve().parents[1]
PAGES = 6


@pytest.fixture
def store(tmp_path, disk_dir):
    raw = small_service_config(tmp_path, disk_dir)
    yield raw
    stop_service(raw)


def extra(store: dict) -> dict:
    return {"backend_name": "kvstore", "module_path": "engine_plugin.sglang_hicache",
            "class_name": "KVStoreHiCache", "interface_v1": 1, "config": store}


def backend(store: dict, pool, **config):
    """As SGLang's cache controller does it: the factory, then the host pool."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from engine_plugin.sglang_hicache import KVStoreHiCache

    made = StorageBackendFactory.create_backend("dynamic", storage_config(extra(store), **config), pool)
    assert isinstance(made, KVStoreHiCache)
    made.register_mem_pool_host(pool)
    return made


def pool_of(kind: str, pages: int = 3 * PAGES):
    if kind == "mla":
        return mla_host_pool("page_first", pages)
    return mha_host_pool(kind, pages)


def fill(pool, seed: int) -> None:
    buffers = pool.kv_buffer if isinstance(pool.kv_buffer, list | tuple) else [pool.kv_buffer]
    generator = torch.Generator().manual_seed(seed)
    for buffer in buffers:
        raw = buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def pages_of(pool, indices: torch.Tensor, count: int) -> list[bytes]:
    return [pool.get_data_page(indices[i * PAGE_SIZE]).contiguous().view(torch.uint8).numpy().tobytes()
            for i in range(count)]


KEYS = [f"page-hash-{i}" for i in range(PAGES)]


@pytest.mark.parametrize("kind", ["page_first", "page_first_direct", "page_head", "layer_first", "mla"])
def test_pages_round_trip_in_place_and_through_the_older_calls(store, kind):
    pool = pool_of(kind)
    fill(pool, 1)
    hicache = backend(store, pool, mla=kind == "mla", page_first=kind.startswith("page_first"))
    try:
        written = pool.alloc(PAGES * PAGE_SIZE)
        assert hicache.batch_exists(KEYS) == 0
        assert hicache.batch_set_v1(KEYS, written) == [True] * PAGES
        assert hicache.batch_exists(KEYS) == PAGES
        assert hicache.batch_exists([*KEYS[:2], "never-stored", *KEYS[2:]]) == 2
        assert hicache.exists(KEYS[3]) and not hicache.exists("never-stored")

        loaded = pool.alloc(PAGES * PAGE_SIZE)
        assert hicache.batch_get_v1([*KEYS, "never-stored"], torch.cat(
            [loaded, pool.alloc(PAGE_SIZE)])) == [True] * PAGES + [False]
        assert pages_of(pool, loaded, PAGES) == pages_of(pool, written, PAGES)

        # SGLang's generic path (no interface_v1): flat page tensors, the same bytes.
        targets = [pool.get_dummy_flat_data_page() for _ in KEYS]
        got = hicache.batch_get(KEYS, targets)
        assert [t.view(torch.uint8).numpy().tobytes() for t in got] == pages_of(pool, written, PAGES)
        assert hicache.batch_set(["older-call"], [pool.get_data_page(written[0])])
        assert hicache.get("older-call", pool.get_dummy_flat_data_page()) is not None
        stats = hicache.get_stats()
        assert stats.prefetch_pgs == [PAGES] and stats.backup_pgs == [PAGES]
        assert hicache.get_stats().prefetch_pgs == []  # since the last call
    finally:
        hicache.close()


FRESH = """
import json, sys, torch
from bench.sglang_pools import PAGE_SIZE
from sglang_hicache_cases import backend, pages_of, pool_of, KEYS
store, kind, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
pool = pool_of(kind)
hicache = backend(store, pool, mla=kind == "mla")
found = hicache.batch_exists(KEYS)
indices = pool.alloc(len(KEYS) * PAGE_SIZE)
loaded = hicache.batch_get_v1(KEYS, indices)
with open(out, "w") as f:
    json.dump({"found": found, "loaded": loaded,
               "pages": [p.hex() for p in pages_of(pool, indices, len(KEYS))]}, f)
hicache.close()
"""


def fresh_process(store: dict, kind: str, tmp_path: Path) -> dict:
    """A new Python process (a restarted SGLang) asks for the pages."""
    out = tmp_path / "fresh.json"
    path = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    subprocess.run([sys.executable, "-c", FRESH, json.dumps(store), kind, str(out)], cwd=ROOT, env=env,
                   check=True, timeout=240)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["page_first", "mla"])
def test_a_fresh_process_after_a_service_restart_loads_the_pages_from_disk(store, kind, tmp_path):
    pool = pool_of(kind)
    fill(pool, 2)
    hicache = backend(store, pool, mla=kind == "mla")
    written = pool.alloc(PAGES * PAGE_SIZE)
    assert all(hicache.batch_set_v1(KEYS, written))
    hicache.close()
    stop_service(store)  # its DRAM tier goes: what comes back comes from disk

    seen = fresh_process(store, kind, tmp_path)
    assert seen["found"] == PAGES and seen["loaded"] == [True] * PAGES
    assert [bytes.fromhex(p) for p in seen["pages"]] == pages_of(pool, written, PAGES)


@pytest.mark.slow
def test_a_flipped_byte_on_disk_is_a_miss_not_data(store, tmp_path):
    pool = pool_of("page_first")
    fill(pool, 3)
    hicache = backend(store, pool)
    written = pool.alloc(PAGES * PAGE_SIZE)
    assert all(hicache.batch_set_v1(KEYS, written))
    hicache.close()
    stop_service(store)
    corrupt_record(store["tiers"]["disk"][0]["path"])

    seen = fresh_process(store, "page_first", tmp_path)
    assert seen["loaded"].count(False) == 1
    good = pages_of(pool, written, PAGES)
    for ok, page, expected in zip(seen["loaded"], seen["pages"], good, strict=True):
        assert not ok or bytes.fromhex(page) == expected
    client = service_client(store)
    try:
        assert client.info()["counters"]["disk.miss.bad_checksum"] == 1
    finally:
        client.close()


def test_tensor_parallel_ranks_are_keyed_apart(store):
    pool = pool_of("page_first")
    rank0 = backend(store, pool, tp_rank=0, tp_size=2)
    rank1 = backend(store, pool, tp_rank=1, tp_size=2)
    try:
        assert all(rank0.batch_set_v1(KEYS, pool.alloc(PAGES * PAGE_SIZE)))
        assert rank0.batch_exists(KEYS) == PAGES and rank1.batch_exists(KEYS) == 0
    finally:
        rank0.close()
        rank1.close()


def test_mla_ranks_share_one_copy_that_only_the_writer_stores(store):
    pool = pool_of("mla")
    rank0 = backend(store, pool, tp_rank=0, tp_size=2, mla=True)
    rank1 = backend(store, pool, tp_rank=1, tp_size=2, mla=True)
    try:
        assert all(rank1.batch_set_v1(KEYS, pool.alloc(PAGES * PAGE_SIZE)))  # not the writer
        assert rank0.batch_exists(KEYS) == 0
        assert all(rank0.batch_set_v1(KEYS, pool.alloc(PAGES * PAGE_SIZE)))
        assert rank1.batch_exists(KEYS) == PAGES
    finally:
        rank0.close()
        rank1.close()


def test_a_hung_service_is_a_miss_within_the_deadline_never_an_exception(store):
    pool = pool_of("page_first")
    hicache = backend(store, pool)
    assert all(hicache.batch_set_v1(KEYS, pool.alloc(PAGES * PAGE_SIZE)))
    pid = service_client(store).info()["service_pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        assert hicache.batch_get_v1(KEYS, pool.alloc(PAGES * PAGE_SIZE)) == [False] * PAGES
        assert hicache.batch_exists(KEYS) == 0  # the link waits before it reconnects
    finally:
        os.kill(pid, signal.SIGCONT)
        hicache.close()


def test_a_missing_kvstore_config_is_a_clear_error(store):
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    bad = {k: v for k, v in extra(store).items() if k != "config"}
    with pytest.raises(ConfigError, match="config"):
        StorageBackendFactory.create_backend("dynamic", storage_config(bad), None)


def test_the_benchmark_measures_kvstore_against_sglangs_file_backend(disk_dir, capsys):
    from bench.sglang_bench import main

    rounds = main(["--total", "16MiB", "--dir", disk_dir, "--fio-seconds", "1"])
    assert {(r.backend, r.hits) for r in rounds} == {(b, h) for b in ("HiCacheFile", "kvstore")
                                                    for h in ("warm", "disk")}
    assert all(r.verified and r.gib_s > 0 and r.cpu_s_per_gib > 0 for r in rounds)
    printed = capsys.readouterr().out
    if shutil.which("fio"):  # the disk's ceiling, measured in the same sitting
        assert "depth 1 " in printed and "depth 16 " in printed
        assert "kvstore disk hits:" in printed and "ceiling over HiCacheFile's disk hits" in printed
