"""kvstore as an LMCache storage plugin, against the installed LMCache (lmcache==0.5.6, in a
virtualenv of its own: docs/lmcache.md): created by LMCache's own CreateStorageBackends
from `storage_plugins`, its chunks allocated by LMCache's own CPU backend, through a real
kvstore service with a disk tier. Not collected by the main run: tests/test_own_process.py
runs this file under .venv-lmcache's Python (scripts/setup_lmcache.sh builds it); under
another Python without lmcache it skips."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("lmcache.v1.storage_backend", reason="needs lmcache (docs/lmcache.md)")
import torch
from conftest import corrupt_record
from engine_harness import fresh_python, service_client, small_service_config, stop_service

from engine_plugin.lmcache_storage import KVStoreBackend
from kvstore.format.errors import ConfigError

CHUNK_TOKENS, LAYERS, HEADS, HEAD_DIM = 16, 2, 2, 64
COUNT = 5  # the last one a prompt's shorter final chunk


@pytest.fixture
def store(tmp_path, disk_dir):
    raw = small_service_config(tmp_path, disk_dir)
    yield raw
    stop_service(raw)


@pytest.fixture
def patient_store(store):
    """`store` with a 5 s I/O deadline: the first disk reads after a restart can outlast the
    short one the fault cases want on a busy machine, and these cases are about data."""
    store["io"]["timeout_s"] = 5.0
    return store


def lmcache_backends(store: dict):
    """LMCache's own set-up, as its engine does it: (backends, a stop function)."""
    import asyncio
    import threading

    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS, local_cpu=True, max_local_cpu_size=0.05, storage_plugins=["kvstore"],
        extra_config={"storage_plugin.kvstore.module_path": "engine_plugin.lmcache_storage",
                      "storage_plugin.kvstore.class_name": "KVStoreBackend", "kvstore.config": store,
                      "kvstore.model_revision": "test"})
    metadata = LMCacheMetadata(model_name="test/model", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.float16,
                               kv_shape=(LAYERS, 2, CHUNK_TOKENS, HEADS, HEAD_DIM))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    backends = CreateStorageBackends(config, metadata, loop)

    def stop() -> None:
        for backend in reversed(list(backends.values())):
            backend.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()

    return backends, stop


def keys():
    from lmcache.utils import CacheEngineKey

    return [CacheEngineKey("test/model", 1, 0, 1000 + i, torch.float16) for i in range(COUNT)]


def chunks(cpu) -> list:
    from lmcache.v1.memory_management import MemoryFormat

    made = []
    for i in range(COUNT):
        tokens = CHUNK_TOKENS if i < COUNT - 1 else CHUNK_TOKENS // 2
        shape = torch.Size([LAYERS, 2, tokens, HEADS * HEAD_DIM])
        obj = cpu.allocate(shape, torch.float16, MemoryFormat.KV_2LTD)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(i)))
        made.append(obj)
    return made


FRESH = """
import json, sys
from lmcache_plugin_cases import keys, lmcache_backends
store, out = json.loads(sys.argv[1]), sys.argv[2]
backends, stop = lmcache_backends(store)
plugin = backends["kvstore"]
found = plugin.batched_contains(keys())
def load():
    return [None if o is None else
            [list(o.get_shape()), o.tensor.view(-1).view(torch.uint8).numpy().tobytes().hex()]
            for o in plugin.batched_get_blocking(keys())]
first = load()  # no shape known yet: through scratch
again = load()  # full chunks straight into objects of the shape learnt, the shorter last one copied
with open(out, "w") as f:
    json.dump({"found": found, "chunks": first, "again": again}, f)
stop()
""".replace("import json, sys", "import json, sys, torch")


def fresh_process(store: dict, tmp_path: Path) -> dict:
    seen: dict = fresh_python(FRESH, store, tmp_path)
    return seen


def store_chunks(store: dict) -> list[tuple[list[int], str]]:
    backends, stop = lmcache_backends(store)
    try:
        plugin = backends["kvstore"]
        assert isinstance(plugin, KVStoreBackend)
        objs = chunks(backends["LocalCPUBackend"])
        done: list = []
        assert plugin.batched_contains(keys()) == 0
        plugin.batched_submit_put_task(keys(), objs, on_complete_callback=done.append)
        assert done == keys() and plugin.batched_contains(keys()) == COUNT
        assert plugin.contains(keys()[2]) and not plugin.exists_in_put_tasks(keys()[2])
        back = plugin.get_non_blocking(keys()[1]).result(timeout=30)
        assert torch.equal(back.tensor, objs[1].tensor)
        return [(list(o.get_shape()), o.tensor.view(-1).view(torch.uint8).numpy().tobytes().hex())
                for o in objs]
    finally:
        stop()


def test_a_fresh_process_after_a_service_restart_loads_every_chunk(patient_store, tmp_path):
    stored = store_chunks(patient_store)
    stop_service(patient_store)  # its DRAM tier goes: what comes back comes from disk
    seen = fresh_process(patient_store, tmp_path)
    assert seen["found"] == COUNT
    assert [tuple(c) for c in seen["chunks"]] == [tuple(c) for c in stored]
    assert [tuple(c) for c in seen["again"]] == [tuple(c) for c in stored]


def test_a_flipped_byte_on_disk_is_a_miss_not_data(patient_store, tmp_path):
    stored = store_chunks(patient_store)
    stop_service(patient_store)
    corrupt_record(patient_store["tiers"]["disk"][0]["path"])
    seen = fresh_process(patient_store, tmp_path)
    for loaded in (seen["chunks"], seen["again"]):
        assert loaded.count(None) == 1
        assert all(c is None or tuple(c) == tuple(s) for c, s in zip(loaded, stored, strict=True))


def test_remove_hides_a_chunk_and_clear_starts_a_generation_that_finds_nothing_before(store):
    """LMCache's `remove` (a chunk, e.g. `remove_after_retrieve`) and `clear` (everything,
    after a weight update, through its storage manager): this plugin never finds those
    chunks again, and finds what it stores after; nothing is deleted from the store."""
    backends, stop = lmcache_backends(store)
    try:
        plugin = backends["kvstore"]
        objs = chunks(backends["LocalCPUBackend"])
        plugin.batched_submit_put_task(keys(), objs)
        assert plugin.batched_contains(keys()) == COUNT
        assert plugin.remove(keys()[2])
        assert plugin.batched_contains(keys()) == 2 and not plugin.contains(keys()[2])
        assert plugin.batched_get_blocking(keys()[1:3])[1] is None
        before = [plugin.key(k) for k in keys()]
        assert plugin.clear() == 0  # what LMCache's StorageManager.clear calls
        assert plugin.scope.weights.generation
        assert plugin.batched_contains(keys()) == 0 and plugin.batched_get_blocking(keys()) == [None] * COUNT
        assert plugin.contains(keys()[0]) is False
        plugin.batched_submit_put_task(keys(), objs)
        assert plugin.batched_contains(keys()) == COUNT  # the new generation's chunks, and key 2 again
        client = service_client(store)
        try:
            assert client.residency(before)[0] == COUNT  # the old generation's records: not deleted
            assert {e["description"]["generation"] for e in client.namespaces()} == {
                "", plugin.scope.weights.generation}
        finally:
            client.close()
    finally:
        stop()


def test_a_missing_kvstore_config_is_a_clear_error():
    from lmcache.v1.config import LMCacheEngineConfig

    class CPU:  # any CPU backend: the config is checked before it is asked anything
        def get_full_chunk_size_bytes(self) -> int:
            return 1 << 20

    with pytest.raises(ConfigError, match=r"kvstore\.config"):
        KVStoreBackend("cpu", LMCacheEngineConfig.from_defaults(extra_config={}), None, CPU(), None)


def test_the_benchmark_measures_the_plugin_against_lmcaches_disk_backend(disk_dir, capsys):
    from bench.lmcache_bench import main

    rounds = main(["--total", "32MiB", "--dir", disk_dir, "--fio-seconds", "1"])
    assert [(r.backend, r.hits) for r in rounds] == [("LMCache LocalDiskBackend", "disk"),
                                                     ("kvstore plugin", "warm"), ("kvstore plugin", "disk")]
    assert all(r.verified and r.gib_s > 0 for r in rounds)
    if shutil.which("fio"):  # the disk's ceiling, measured in the same sitting
        assert "depth 16 " in capsys.readouterr().out
