"""kvstore as an LMCache storage plugin, against the installed LMCache (lmcache==0.5.6, in a
virtualenv of its own: docs/lmcache.md): created by LMCache's own CreateStorageBackends
from `storage_plugins`, its chunks allocated by LMCache's own CPU backend, through a real
kvstore service with a disk tier. The backend contract (tests/backend_contract.py) runs on
it through `PluginDriver`; the stored header's parser is fuzzed alone too. The bad and
made-up LMCache headers here serve the MP server's L2 adapter's cases as well (the same
header). Not collected by the main run: tests/test_own_process.py runs this file under
.venv-lmcache's Python (scripts/setup_lmcache.sh builds it); under another Python
without lmcache it skips."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

pytest.importorskip("lmcache.v1.storage_backend", reason="needs lmcache (docs/lmcache.md)")
import torch
from backend_contract import COUNT, BackendCalls, Contract
from hypothesis import given, settings
from hypothesis import strategies as st
from support.services import service_client, small_service

from engine_plugin.lmcache.storage import (
    DTYPES,
    HEADER,
    KV_FORMATS,
    BadHeader,
    KVStoreBackend,
    StoredChunk,
    parse_header,
)
from kvstore.format.errors import ConfigError, KVStoreError

CHUNK_TOKENS, LAYERS, HEADS, HEAD_DIM = 16, 2, 2, 64
POOL_GB = 0.01  # LMCache's CPU pool: about 600 chunks of 16 KiB


def lmcache_backends(store: dict, layers: int = LAYERS, head_dim: int = HEAD_DIM,
                     module_path: str = "engine_plugin.lmcache.storage"):
    """LMCache's own set-up, as its engine does it: (backends, a stop function)."""
    import asyncio
    import threading

    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS, local_cpu=True, max_local_cpu_size=POOL_GB, storage_plugins=["kvstore"],
        extra_config={"storage_plugin.kvstore.module_path": module_path,
                      "storage_plugin.kvstore.class_name": "KVStoreBackend", "kvstore.config": store,
                      "kvstore.model_revision": "test"})
    metadata = LMCacheMetadata(model_name="test/model", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.float16,
                               kv_shape=(layers, 2, CHUNK_TOKENS, HEADS, head_dim))
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


# -- LMCache's chunk header, planted and made up (this plugin's and the L2 adapter's) --------


def header_record(header: dict[str, Any] | bytes, payload_bytes: int) -> bytes:
    """A whole record: the header (a mapping, written as JSON, or raw bytes) in its 4 KiB,
    then a payload of recognisable bytes."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    payload = np.arange(payload_bytes, dtype=np.uint32).astype(np.uint8).tobytes()
    return text[:HEADER].ljust(HEADER, b"\0") + payload


def bad_headers(good: dict[str, Any], itemsize: int) -> dict[str, dict[str, Any] | bytes]:
    """Headers no load may act on, against `good` (the header of a full chunk the engine
    would load): sizes past its memory, shapes and dtypes of another kind (some of the
    very same bytes), formats LMCache allocates on the heap or refuses, and what is not a
    header at all."""
    shape, size = good["shape"], good["size"]
    last = shape[-1]
    bad: dict[str, dict[str, Any] | bytes] = {
        "size of five chunks (it overwrote four neighbours)": {**good, "size": 5 * size},
        "size of a terabyte (it crashed the engine)": {**good, "size": 1 << 40},
        "size a byte short of the shape's": {**good, "size": size - 1},
        "size a float": {**good, "size": float(size)},
        "size true": {**good, "size": True},
        "no size (it leaked an allocation)": {k: v for k, v in good.items() if k != "size"},
        "an extra field": {**good, "extra": 1},
        "a shape of a terabyte (it waited for memory for ever)": {
            **good, "shape": [1 << 20, 1 << 20], "size": (1 << 40) * itemsize},
        "a shape of twice the tokens": {**good, "shape": [shape[0] * 2, *shape[1:]], "size": 2 * size},
        "a negative dimension": {**good, "shape": [-shape[0], *shape[1:]]},
        "a zero dimension": {**good, "shape": [0, *shape[1:]], "size": 0},
        "a float dimension": {**good, "shape": [float(shape[0]), *shape[1:]]},
        "a shape of another kind, the same bytes": {**good, "shape": [2, *shape[:-1], last // 2]},
        "a dtype not allowed": {**good, "dtype": "float64", "shape": [*shape[:-1], last * itemsize // 8]},
        "a dtype naming a torch function": {**good, "dtype": "load"},
        "a dtype of another kind, the same bytes": {**good, "dtype": "uint8",
                                                    "shape": [*shape[:-1], last * itemsize]},
        "format BINARY_BUFFER (a heap buffer of any size)": {**good, "fmt": "BINARY_BUFFER"},
        "format UNDEFINED (LMCache raises)": {**good, "fmt": "UNDEFINED"},
        "a format of another kind": {**good, "fmt": "KV_T2D" if good["fmt"] != "KV_T2D" else "KV_2TD"},
        "not JSON": b"{shape: [1]",
        "not UTF-8": b"\xff\xfe\xfd{}",
        "a JSON list": json.dumps(list(good.values())).encode(),
        "nested 4000 deep": b"[" * HEADER,
        "empty": b"",
    }
    return bad


def fuzzed_headers(good: dict[str, Any]) -> st.SearchStrategy[dict[str, Any] | bytes]:
    """Headers near `good` (each field replaced by a plausible or arbitrary value, or
    dropped) and arbitrary bytes."""
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
    json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4), max_leaves=8)
    near = {
        "shape": st.lists(st.sampled_from([0, 1, 2, 3, 8, 16, 64, 128, -1, 1 << 31, 1 << 40]),
                          min_size=0, max_size=9) | st.just(good["shape"]) | json_values,
        "dtype": st.sampled_from([*DTYPES, "float64", "bool", "load", ""]) | json_values,
        "fmt": st.sampled_from([*KV_FORMATS, "BINARY_BUFFER", "UNDEFINED", "BINARY", "EC_TD"]) | json_values,
        "size": st.sampled_from([good["size"], good["size"] - 1, good["size"] + 1, 0, -1, 1 << 40])
        | st.integers() | json_values,
    }
    mutated = st.fixed_dictionaries({}, optional={k: st.just(v) | near[k] for k, v in good.items()})
    return mutated | st.binary(max_size=64)


def header_of(shape: Sequence[int], dtype: torch.dtype, fmt: str) -> dict[str, Any]:
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "fmt": fmt,
            "size": math.prod(shape) * dtype.itemsize}


# -- the plugin as the backend contract's driver ---------------------------------------------


class PluginDriver:
    """The plugin made by LMCache's own CreateStorageBackends; chunk i is a float16 KV
    chunk (the last of COUNT a prompt's shorter one). A load goes into LMCache's pool
    filled with guard objects but for holes where it may allocate."""

    headers, allocates, payload_at = True, True, HEADER

    def __init__(self, store: dict[str, Any], layers: int = LAYERS, head_dim: int = HEAD_DIM) -> None:
        self.store = store
        self.calls = BackendCalls()
        self.layers, self.head_dim = layers, head_dim
        self.backends, self._stop = lmcache_backends(store, layers, head_dim)
        self.plugin = self.backends["kvstore"]
        self.cpu = self.backends["LocalCPUBackend"]
        assert isinstance(self.plugin, KVStoreBackend)
        self.full = self.shape(0)

    def shape(self, i: int) -> torch.Size:
        tokens = CHUNK_TOKENS // 2 if i == COUNT - 1 else CHUNK_TOKENS
        return torch.Size([2, self.layers, tokens, HEADS * self.head_dim])

    @staticmethod
    def cache_key(i: int) -> Any:
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey("test/model", 1, 0, 1000 + i, torch.float16)

    def key(self, i: int) -> bytes:
        return self.plugin.key(self.cache_key(i))

    def expected(self, i: int) -> bytes:
        data = torch.randn(self.shape(i), generator=torch.Generator().manual_seed(i)).half()
        return data.view(-1).view(torch.uint8).numpy().tobytes()

    def _allocate(self, shape: torch.Size) -> Any:
        from lmcache.v1.memory_management import MemoryFormat

        return self.cpu.allocate(shape, torch.float16, MemoryFormat.KV_2LTD, eviction=False, busy_loop=False)

    def save(self, indices: Sequence[int]) -> list[bool]:
        objs = [self._allocate(self.shape(i)) for i in indices]
        for i, obj in zip(indices, objs, strict=True):
            obj.tensor.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(self.expected(i)),
                                                                         dtype=torch.uint8))
        done: list = []
        try:
            keys = [self.cache_key(i) for i in indices]
            self.calls(lambda: self.plugin.batched_submit_put_task(keys, objs,
                                                                   on_complete_callback=done.append))
        finally:
            for obj in objs:
                obj.ref_count_down()
        return [self.cache_key(i) in done for i in indices]

    def exists(self, indices: Sequence[int]) -> int:
        keys = [self.cache_key(i) for i in indices]
        return int(self.calls(lambda: self.plugin.batched_contains(keys)))

    def load(self, indices: Sequence[int], room: int | None = None) -> tuple[list[bytes | None], bool]:
        fillers = []  # every byte of the pool, in full chunks
        while (obj := self._allocate(self.full)) is not None:
            fillers.append(obj)
        holes = room if room is not None else len(indices) + 1
        assert len(fillers) > 2 * holes, "LMCache's pool is too small for the guard"
        kept = [obj for j, obj in enumerate(fillers) if not (j % 2 and j < 2 * holes)]
        for j, obj in enumerate(fillers):
            if j % 2 and j < 2 * holes:
                obj.ref_count_down()
        for j, obj in enumerate(kept):
            obj.tensor.view(-1).view(torch.uint8).fill_(j % 251)
        try:
            keys = [self.cache_key(i) for i in indices]
            objs = self.calls(lambda: self.plugin.batched_get_blocking(keys))
            found = [None if o is None else o.tensor.view(-1).view(torch.uint8).numpy().tobytes()
                     for o in objs]
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()
            intact = all(bool(obj.tensor.view(-1).view(torch.uint8).eq(j % 251).all())
                         for j, obj in enumerate(kept))
        finally:
            for obj in kept:
                obj.ref_count_down()
        return found, intact

    def wrong_size(self, indices: Sequence[int]) -> tuple[list[bytes | None], bool]:
        """An engine whose chunks hold the same bytes in another shape (4 layers of half
        the head size) loads them: the plugin must not hand it objects of this shape."""
        other = PluginDriver(self.store, layers=2 * self.layers, head_dim=self.head_dim // 2)
        try:
            return other.load(indices)
        finally:
            other.close()

    def good_header(self) -> dict[str, Any]:
        return header_of(self.full, torch.float16, "KV_2LTD")

    def bad_records(self) -> dict[str, bytes]:
        size = self.good_header()["size"]
        return {label: header_record(h, size) for label, h in bad_headers(self.good_header(), 2).items()}

    def fuzz_records(self) -> Any:
        size = self.good_header()["size"]
        return fuzzed_headers(self.good_header()).map(lambda h: header_record(h, size))

    def plant(self, i: int, record: bytes) -> bool:
        page = np.frombuffer(record, np.uint8)
        return bool(self.plugin.writes.save([self.key(i)], [[(page.ctypes.data, page.size)]])[0])

    def allocations(self) -> int:
        return int(self.cpu.memory_allocator.pin_allocator.num_active_allocations)

    def close(self) -> None:
        self._stop()


class TestContract(Contract):
    driver = "lmcache_plugin_cases:PluginDriver"


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([header_of([2, 2, 16, 128], torch.float16, "KV_2LTD")]).flatmap(fuzzed_headers))
def test_a_stored_header_is_checked_or_refused_never_raised_past(header):
    """parse_header on anything: BadHeader, or a chunk whose size is its shape's bytes
    within the payload, of an allowed dtype and KV format."""
    row = np.frombuffer(header_record(header, 0), np.uint8)
    try:
        chunk = parse_header(row, 16384)
    except BadHeader:
        return
    assert isinstance(chunk, StoredChunk)
    assert chunk.dtype in DTYPES.values() and chunk.fmt in KV_FORMATS.values()
    assert 0 < chunk.size == math.prod(chunk.shape) * chunk.dtype.itemsize <= 16384


@pytest.fixture
def store(tmp_path, disk_dir):
    with small_service(tmp_path, disk_dir) as config:
        yield config


def test_remove_hides_a_chunk_and_clear_starts_a_generation_that_finds_nothing_before(store):
    """LMCache's `remove` (a chunk, e.g. `remove_after_retrieve`) and `clear` (everything,
    after a weight update, through its storage manager): this plugin never finds those
    chunks again, and finds what it stores after; nothing is deleted from the store."""
    driver = PluginDriver(store)
    try:
        plugin, keys = driver.plugin, [driver.cache_key(i) for i in range(COUNT)]
        assert driver.save(range(COUNT)) == [True] * COUNT
        assert plugin.batched_contains(keys) == COUNT
        assert plugin.remove(keys[2])
        assert plugin.batched_contains(keys) == 2 and not plugin.contains(keys[2])
        assert driver.load([1, 2])[0][1] is None
        before = [plugin.key(k) for k in keys]
        assert plugin.clear() == 0  # what LMCache's StorageManager.clear calls
        assert plugin.scope.weights.generation
        assert plugin.batched_contains(keys) == 0 and driver.load(range(COUNT))[0] == [None] * COUNT
        assert plugin.contains(keys[0]) is False
        assert driver.save(range(COUNT)) == [True] * COUNT
        assert plugin.batched_contains(keys) == COUNT  # the new generation's chunks, and key 2 again
        client = service_client(store)
        try:
            assert client.residency(before)[0] == COUNT  # the old generation's records: not deleted
            assert {e["description"]["generation"] for e in client.namespaces()} == {
                "", plugin.scope.weights.generation}
        finally:
            client.close()
    finally:
        driver.close()


def test_a_clear_that_cannot_connect_misses_and_drops_until_one_does(store, monkeypatch):
    """clear() whose connections in the new generation cannot be made (a service that
    cannot start): no exception for LMCache, and the old generation's connections are not
    used (their records would name the old generation, whose purge would take them):
    loads miss, saves drop, and the next clear() connects again."""
    driver = PluginDriver(store)
    try:
        plugin, keys = driver.plugin, [driver.cache_key(i) for i in range(COUNT)]
        assert driver.save(range(COUNT)) == [True] * COUNT
        pages = plugin.scope.pages

        def fails(*args, **kwargs):
            raise KVStoreError("kvstore service failed to start: (a fault)")

        monkeypatch.setattr(plugin.scope, "pages", fails)
        assert plugin.clear() == 0
        assert plugin.batched_contains(keys) == 0 and driver.load(range(COUNT))[0] == [None] * COUNT
        assert driver.save(range(COUNT)) == [False] * COUNT
        monkeypatch.setattr(plugin.scope, "pages", pages)
        assert plugin.clear() == 0
        assert driver.save(range(COUNT)) == [True] * COUNT
        assert plugin.batched_contains(keys) == COUNT
    finally:
        driver.close()


def test_the_module_path_configs_named_before_the_engines_rooms_still_loads(store):
    """docs/lmcache.md names engine_plugin.lmcache.storage; a config written before each
    engine had its room names engine_plugin.lmcache_storage, and LMCache still makes it."""
    backends, stop = lmcache_backends(store, module_path="engine_plugin.lmcache_storage")
    try:
        assert isinstance(backends["kvstore"], KVStoreBackend)
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
    from bench.lab.lmcache_bench import main

    rounds = main(["--total", "32MiB", "--dir", disk_dir, "--fio-seconds", "1"])
    assert [(r.backend, r.hits) for r in rounds] == [("LMCache LocalDiskBackend", "disk"),
                                                     ("kvstore plugin", "warm"), ("kvstore plugin", "disk")]
    assert all(r.verified and r.gib_s > 0 for r in rounds)
    if shutil.which("fio"):  # the disk's ceiling, measured in the same sitting
        assert "depth 16 " in capsys.readouterr().out


def test_a_stored_chunk_fits_with_fewer_tokens_only():
    """A prompt's shorter last chunk has fewer tokens; a chunk of fewer layers or heads is
    another engine's (an MLA model saved by one rank of another pipeline split shares the
    key), and is refused: LMCache would read the missing layers from the memory after it."""
    from lmcache.v1.memory_management import MemoryFormat

    def chunk(layers: int, tokens: int) -> StoredChunk:
        return StoredChunk(torch.Size([1, layers, tokens, 576]), torch.bfloat16, MemoryFormat.KV_MLA_FMT,
                           layers * tokens * 576 * 2)

    full = chunk(32, 256)
    assert chunk(32, 100).within(full) and chunk(32, 256).within(full)
    assert not chunk(16, 256).within(full) and not chunk(16, 100).within(full)
    assert not chunk(32, 300).within(full)
