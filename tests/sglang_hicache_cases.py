"""kvstore as SGLang's HiCache storage backend, against the installed SGLang (the `sglang`
extra): created by SGLang's own StorageBackendFactory from its `dynamic` extra config,
moving pages in and out of SGLang's own host KV pools (built on the CPU,
bench/support/sglang_host_pools.py), through a real kvstore service with a disk tier; the backend
contract (tests/backend_contract.py) runs on it through `HiCacheDriver`.

Not collected by the main run: tests/test_own_process.py runs this file in a pytest
process of its own, because importing SGLang patches transformers (and points JIT caches
at its own directory through the environment) for the rest of the process."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from backend_contract import BackendCalls, Contract
from hypothesis import strategies as st
from support.records import corrupt_record
from support.services import service_client, small_service_config, stop_service

from bench.support.processes import paused
from bench.support.sglang_host_pools import PAGE_SIZE, mha_host_pool, mla_host_pool, storage_config
from bench.support.tiny_model import build_tiny_llama
from connectors.weights import FileDigests, fingerprint
from kvstore.format.errors import ConfigError, KVStoreError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs the sglang extra")


PAGES = 6
ROOT = Path(__file__).resolve().parents[1]


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


def extra(store: dict, module_path: str = "engine_plugin.sglang.hicache") -> dict:
    return {"backend_name": "kvstore", "module_path": module_path,
            "class_name": "KVStoreHiCache", "interface_v1": 1, "config": store, "model_revision": "test"}


def backend(store: dict, pool, module_path: str = "engine_plugin.sglang.hicache", **config):
    """As SGLang's cache controller does it: the factory, then the host pool."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from engine_plugin.sglang.hicache import KVStoreHiCache

    made = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra(store, module_path), **config), pool)
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


def test_the_module_path_configs_named_before_the_engines_rooms_still_loads(store):
    """docs/sglang.md names engine_plugin.sglang.hicache; a config written before each engine
    had its room names engine_plugin.sglang_hicache, and SGLang's factory still makes it."""
    pool = pool_of("page_first")
    fill(pool, 1)
    hicache = backend(store, pool, module_path="engine_plugin.sglang_hicache", page_first=True)
    try:
        written = pool.alloc(PAGE_SIZE)
        assert hicache.batch_set_v1(KEYS[:1], written) == [True]
        assert hicache.batch_exists(KEYS[:1]) == 1
    finally:
        hicache.close()


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


class HiCacheDriver:
    """The backend made by SGLang's own factory on SGLang's page_first MHA host pool;
    chunk i is one page of made-up bytes. A load's destinations are pages of the pool,
    every other page of which is the guard."""

    headers, allocates, payload_at = False, False, 0

    def __init__(self, store: dict[str, Any]) -> None:
        self.store = store
        self.calls = BackendCalls()
        self.pool = pool_of("page_first", 6 * PAGES)
        fill(self.pool, 7)
        self.hicache = backend(store, self.pool)
        flat = self.pool.get_dummy_flat_data_page()
        self.page_bytes = flat.numel() * flat.element_size()

    def key(self, i: int) -> bytes:
        return self.hicache.key(f"page-hash-{i}")

    def expected(self, i: int) -> bytes:
        return np.random.default_rng(i).bytes(self.page_bytes)

    def save(self, indices: Sequence[int]) -> list[bool]:
        source = self.pool.alloc(len(indices) * PAGE_SIZE)
        try:
            for j, i in enumerate(indices):
                flat = self.pool.get_dummy_flat_data_page()
                flat.view(torch.uint8).copy_(torch.frombuffer(bytearray(self.expected(i)), dtype=torch.uint8))
                self.pool.set_from_flat_data_page(int(source[j * PAGE_SIZE]), flat)
            keys = [f"page-hash-{i}" for i in indices]
            return list(self.calls(lambda: self.hicache.batch_set_v1(keys, source)))
        finally:
            self.pool.free(source)

    def exists(self, indices: Sequence[int]) -> int:
        keys = [f"page-hash-{i}" for i in indices]
        return int(self.calls(lambda: self.hicache.batch_exists(keys)))

    def _pages(self) -> list[bytes]:
        return pages_of(self.pool, torch.arange(self.pool.size), self.pool.size // PAGE_SIZE)

    def load(self, indices: Sequence[int], room: int | None = None) -> tuple[list[bytes | None], bool]:
        """Into pages the engine allocated; with `room`, the pool then exhausted."""
        into = self.pool.alloc(len(indices) * PAGE_SIZE)
        rest = self.pool.alloc(self.pool.available_size()) if room is not None else None
        before = self._pages()
        try:
            keys = [f"page-hash-{i}" for i in indices]
            done = self.calls(lambda: self.hicache.batch_get_v1(keys, into))
            after = self._pages()
        finally:
            self.pool.free(into)
            if rest is not None:
                self.pool.free(rest)
        mine = {int(into[j * PAGE_SIZE]) // PAGE_SIZE for j in range(len(indices))}
        found = [after[int(into[j * PAGE_SIZE]) // PAGE_SIZE] if ok else None for j, ok in enumerate(done)]
        return found, all(b == a for p, (b, a) in enumerate(zip(before, after, strict=True)) if p not in mine)

    def wrong_size(self, indices: Sequence[int]) -> tuple[list[bytes | None], bool]:
        """SGLang's older call, into host tensors of half a page (each between guard bytes)."""
        guard = torch.full((2 * len(indices) * self.page_bytes,), 0x5A, dtype=torch.uint8)
        half = self.page_bytes // 2
        targets = [guard[2 * j * self.page_bytes + half : 2 * j * self.page_bytes + 2 * half]
                   for j in range(len(indices))]
        got = self.hicache.batch_get([f"page-hash-{i}" for i in indices], targets)
        return [None if t is None else t.numpy().tobytes() for t in got], bool(guard.eq(0x5A).all())

    def bad_records(self) -> dict[str, bytes]:
        """No header to plant: pages of another prompt, zeros, random bytes."""
        return {"another chunk's page": self.expected(0), "zeros": bytes(self.page_bytes),
                "random bytes": np.random.default_rng(99).bytes(self.page_bytes)}

    def fuzz_records(self) -> Any:
        return st.integers(0, 2**32 - 1).map(lambda seed: np.random.default_rng(seed).bytes(self.page_bytes))

    def plant(self, i: int, record: bytes) -> bool:
        assert self.hicache.writes is not None
        page = np.frombuffer(record, np.uint8)
        return bool(self.hicache.writes.save([self.key(i)], [[(page.ctypes.data, page.size)]])[0])

    def allocations(self) -> int:
        return int(self.pool.size - self.pool.available_size())

    def close(self) -> None:
        self.hicache.close()


class TestContract(Contract):
    driver = "sglang_hicache_cases:HiCacheDriver"


def test_the_older_calls_fill_the_pages_they_are_given_or_miss(store):
    """A non-contiguous page is filled (through its contiguous copy, copied back); a page
    that is not host memory (here a meta tensor: no memory at all) is a miss, never a copy."""
    pool = pool_of("page_first")
    fill(pool, 4)
    hicache = backend(store, pool)
    try:
        written = pool.alloc(2 * PAGE_SIZE)
        assert hicache.batch_set_v1(KEYS[:2], written) == [True, True]
        flat = pool.get_dummy_flat_data_page()
        strided = [torch.zeros(2 * flat.numel(), dtype=flat.dtype)[::2] for _ in range(2)]
        assert not strided[0].is_contiguous()
        got = hicache.batch_get(KEYS[:2], strided)
        assert [t.contiguous().view(torch.uint8).numpy().tobytes() for t in got] == pages_of(pool, written, 2)
        nowhere = torch.empty(flat.shape, dtype=flat.dtype, device="meta")
        assert hicache.batch_get(KEYS[:1], [nowhere]) == [None]
        assert hicache.batch_get(KEYS[:2], [flat]) == [None, None]  # fewer pages than keys
    finally:
        hicache.close()


# In a process of its own (SGLang's server arguments are process-wide): for each set of
# flags (a JSON list), SGLang's own ServerArgs for the checkpoint, published as a server's
# scheduler publishes them (a later publish replaces the last), and the weights' identity
# the backend keys its pages by, a line each.
SERVED = """
import json, sys
from bench.support.sglang_cpu import install
install()
from sglang.srt.runtime_context import publish
from sglang.srt.server_args import ServerArgs
from bench.support.sglang_host_pools import storage_config
from engine_plugin.sglang.hicache import served_weights
for flags in json.loads(sys.argv[2]):
    publish(ServerArgs(model_path=sys.argv[1], device="cpu", **flags), role="scheduler")
    print("identity", served_weights(storage_config({}, model="served-name"), None), flush=True)
"""


def test_what_sglang_does_to_the_weights_names_other_weights(tmp_path):
    """One checkpoint served with `--quantization fp8`, with an fp8 KV cache filled by bf16
    or by fp16 compute, in the other fp8 format (both are `uint8` pages in the host pool),
    with `--json-model-override-args` or another `--mamba-ssm-dtype` makes other KV from the
    same files: each is named apart (before, all were the checkpoint's fingerprint alone, so
    one server loaded another's KV). A compute dtype the KV cache has anyway names nothing
    new, and the checkpoint is the server's model path, not the served name it hands over."""
    checkpoint = build_tiny_llama(tmp_path / "ckpt")
    rope = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    flags = [{}, {"dtype": "float16"}, {"quantization": "fp8"}, {**fp8, "dtype": "bfloat16"},
             {**fp8, "dtype": "float16"}, {"kv_cache_dtype": "fp8_e5m2", "dtype": "bfloat16"},
             {"json_model_override_args": json.dumps(rope)}, {"mamba_ssm_dtype": "float32"},
             {"json_model_override_args": json.dumps(rope, indent=2)}, {"json_model_override_args": "{ }"}]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", SERVED, str(checkpoint), json.dumps(flags)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-3000:]
    named = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("identity ")]
    plain = fingerprint(str(checkpoint), FileDigests(None))
    assert len(named) == len(flags) and named[0] == named[1] == plain, named
    assert named[2] == plain + "|quant:fp8" and named[3] == plain + "|compute:bfloat16|kv:fp8_e4m3", named
    assert len(set(named[2:8]) | {plain}) == 7, named
    assert named[8] == named[6] and named[9] == plain, named  # overrides as written: their content counts


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


def test_a_long_save_is_one_chain_whose_tail_cost_eviction_takes_first(store):
    """128 pages saved as SGLang's controller saves them: two calls of 64 (the second
    naming the first's pages as its prefix), each two waves of a 32-slot window. The store
    sees one chain, so under `cost` eviction, once single pages press on a DRAM that
    holds the chain and two more, the first of the chain's pages to leave DRAM is its
    last. Were a wave or a call a chain of its own, each would end in a leaf valued at its
    own shorter depth, and the oldest of them (page 31 or 63) would leave first."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from kvstore.format.record import record_bytes

    pages, half = 128, 64
    pool = pool_of("page_first", pages + 1)
    page_bytes = pool.get_data_page(0).numel() * pool.dtype.itemsize
    store["tiers"]["dram"]["capacity"] = (pages + 2) * record_bytes(page_bytes)
    store["service"]["staging"] = 32 * page_bytes
    store["eviction"] = "cost"
    hicache = backend(store, pool)
    watcher = service_client(store)
    try:
        assert hicache.writes is not None and page_bytes == hicache.writes.chunk_bytes
        keys = [f"long-{i}" for i in range(pages)]
        written = pool.alloc(pages * PAGE_SIZE)
        cursor = watcher.events(-1)[0]
        assert hicache.batch_set_v1(keys[:half], written[: half * PAGE_SIZE]) == [True] * half
        assert hicache.batch_set_v1(keys[half:], written[half * PAGE_SIZE :],
                                    HiCacheStorageExtraInfo(prefix_keys=keys[:half])) == [True] * half
        ours = {hicache.key(k): i for i, k in enumerate(keys)}
        left: list[int] = []
        for n in range(pages):  # single pages, each a chain of its own, until one of ours leaves
            assert hicache.batch_set_v1([f"pressure-{n}"], written[:PAGE_SIZE]) == [True]
            cursor, lost, events = watcher.events(cursor)
            assert lost == 0
            left += [ours[key] for stored, key, medium in events
                     if not stored and medium == "kvstore-dram" and key in ours]
            if left:
                break
        assert left == [pages - 1], f"first pages of the save to leave DRAM: {left}"
    finally:
        watcher.close()
        hicache.close()


def test_a_missing_kvstore_config_is_a_clear_error(store):
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    bad = {k: v for k, v in extra(store).items() if k != "config"}
    with pytest.raises(ConfigError, match="config"):
        StorageBackendFactory.create_backend("dynamic", storage_config(bad), None)


def test_the_benchmark_measures_kvstore_against_sglangs_file_backend(disk_dir, capsys):
    from bench.lab.sglang_bench import main

    rounds = main(["--total", "16MiB", "--dir", disk_dir, "--fio-seconds", "1"])
    assert {(r.backend, r.hits) for r in rounds} == {(b, h) for b in ("HiCacheFile", "kvstore")
                                                    for h in ("warm", "disk")}
    assert all(r.verified and r.gib_s > 0 and r.cpu_s_per_gib > 0 for r in rounds)
    printed = capsys.readouterr().out
    if shutil.which("fio"):  # the disk's ceiling, measured in the same sitting
        assert "depth 1 " in printed and "depth 16 " in printed
        assert "kvstore disk hits:" in printed and "ceiling over HiCacheFile's disk hits" in printed


# SGLang's v2 pool interface (hybrid models): a Mamba state pool (TRAILING_PAGES, one state
# per page, a page of 3 chunks and a padded fourth) and a sliding-window KV pool (an MHA
# pool of 2 layers: half a chunk per page), next to the KV pool, as SGLang's
# HybridCacheController registers them; every answer compared with SGLang's HiCacheFile.
MAMBA_AT = (2, 5)  # pages whose Mamba state is stored (node ends)
SWA_AT = (0, 1, 2, 4, 5)  # pages whose sliding-window KV is stored


def hybrid_pools(side_state: int = 0, kv: str = "page_first") -> dict:
    from bench.support.sglang_host_pools import mamba_host_pool

    pools = {"kv": pool_of(kv), "mamba": mamba_host_pool(3 * PAGES, side_state=side_state),
             "swa": mha_host_pool("page_first", 3 * PAGES, layers=2)}
    for seed, pool in enumerate(pools.values()):
        fill(pool, 10 + seed)
    return pools


def attach(made, pools: dict):
    """As HybridCacheController.attach_storage_backend: the anchor, then every entry."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    made.register_mem_pool_host(pools["kv"])
    for name, pool in pools.items():
        made.register_mem_host_pool_v2(pool, PoolName(name))
    made.on_host_pools_registered()
    return made


def file_backend(tmp_path: Path, pools: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    return attach(HiCacheFile(storage_config({}), file_path=str(tmp_path / "hicache")), pools)


def transfer(name: str, keys: list, indices=None, policy: str = "trailing_pages"):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    return PoolTransfer(name=PoolName(name), host_indices=indices, keys=keys,
                        hit_policy=PoolHitPolicy(policy))


def named(results: dict) -> dict:
    """A v2 answer keyed by plain pool names, as a failed assert prints them."""
    return {str(name): value for name, value in results.items()}


def pool_bytes(pool, indices: torch.Tensor) -> list[bytes]:
    size = pool.page_size
    return [pool.get_data_page(indices[i * size]).contiguous().view(torch.uint8).numpy().tobytes()
            for i in range(len(indices) // size)]


def both_backends(store: dict, tmp_path: Path, **pool_options) -> tuple[dict, Any, Any]:
    """SGLang's hybrid host pools, kvstore's backend attached to them, HiCacheFile beside it."""
    pools = hybrid_pools(**pool_options)
    return pools, attach(backend(store, pools["kv"]), pools), file_backend(tmp_path, pools)


def store_hybrid(kvstore, hicache_file, pools: dict) -> dict:
    """KV for every page, Mamba state and sliding-window KV where MAMBA_AT / SWA_AT say;
    the host indices written, by pool."""
    written = {name: pool.alloc(len(KEYS) * pool.page_size) for name, pool in pools.items()}
    assert kvstore.batch_set_v1(KEYS, written["kv"]) == [True] * PAGES
    assert hicache_file.batch_set(KEYS, [pools["kv"].get_data_page(written["kv"][i * PAGE_SIZE])
                                         for i in range(PAGES)])
    sets = [transfer("mamba", [KEYS[i] for i in MAMBA_AT], written["mamba"][list(MAMBA_AT)]),
            transfer("swa", [KEYS[i] for i in SWA_AT],
                     torch.cat([written["swa"][i * PAGE_SIZE : (i + 1) * PAGE_SIZE] for i in SWA_AT]))]
    for backend_ in (kvstore, hicache_file):
        assert named(backend_.batch_set_v2(sets)) == {"mamba": [True] * 2, "swa": [True] * 5}
    return written


QUERIES = {  # name: extra-pool transfers of a batch_exists_v2
    "mamba": [("mamba", 1, "trailing_pages")],
    "swa window": [("swa", 2, "trailing_pages")],
    "swa all": [("swa", 0, "all_pages")],
    "mamba + swa window": [("mamba", 1, "trailing_pages"), ("swa", 2, "trailing_pages")],
    "mamba + swa all": [("mamba", 1, "trailing_pages"), ("swa", 0, "all_pages")],
}


def exists_v2(made, keys: list, query: list):
    return made.batch_exists_v2(keys, [transfer(name, keys[-n:] if n else None, policy=policy)
                                       for name, n, policy in query])


def assert_exists_like_hicache_file(kvstore, hicache_file) -> dict:
    """Every query, on the stored keys and on a run with a gap, answers as HiCacheFile does."""
    seen = {}
    for label, query in QUERIES.items():
        for keys in (KEYS, [*KEYS[:4], "never-stored", *KEYS[5:]]):
            ours, theirs = exists_v2(kvstore, keys, query), exists_v2(hicache_file, keys, query)
            assert ours == theirs, (label, keys)
        seen[label] = exists_v2(kvstore, KEYS, query)
    return seen


def load_hybrid(made, pools: dict) -> tuple[dict, dict]:
    """batch_get_v2 of every page of both extra pools into fresh host indices."""
    into = {name: pools[name].alloc(PAGES * pools[name].page_size) for name in ("mamba", "swa")}
    got = made.batch_get_v2([transfer(name, KEYS, into[name]) for name in into])
    return got, into


@pytest.mark.parametrize("side_state", [0, 100], ids=["zero-copy", "flat-pages"])
def test_v2_pools_round_trip_and_answer_as_sglangs_own_file_backend(store, tmp_path, side_state):
    pools, kvstore, hicache_file = both_backends(store, tmp_path, side_state=side_state)
    try:
        assert named(kvstore.batch_get_v2([transfer("mamba", KEYS[:1], pools["mamba"].alloc(1))])) == {
            "mamba": [False]}
        chunk = kvstore.reads.chunk_bytes  # the KV page: a Mamba state is 3 chunks and a part
        mamba, swa = kvstore.pools.pools["mamba"], kvstore.pools.pools["swa"]
        assert mamba.zero_copy == (not side_state) and mamba.parts(chunk) == 4 and mamba.page_bytes % chunk
        assert swa.zero_copy and swa.parts(chunk) == 1 and 2 * swa.page_bytes == chunk
        written = store_hybrid(kvstore, hicache_file, pools)
        seen = assert_exists_like_hicache_file(kvstore, hicache_file)
        # Mamba restorable only at its states (3 and 6 pages); a 2-page window of
        # sliding-window KV at 1, 2, 3 and 6; every page of it only up to 3.
        assert seen["mamba"].restorable_prefix_pages == [3, 6] and seen["mamba"].kv_hit_pages == 6
        assert seen["swa window"].restorable_prefix_pages == [1, 2, 3, 6]
        assert seen["mamba + swa all"].kv_hit_pages == 3

        for made in (kvstore, hicache_file):
            got, into = load_hybrid(made, pools)
            assert named(got) == {"mamba": [i in MAMBA_AT for i in range(PAGES)],
                           "swa": [i in SWA_AT for i in range(PAGES)]}
            for name, at in (("mamba", MAMBA_AT), ("swa", SWA_AT)):
                size = pools[name].page_size
                loaded, stored = pool_bytes(pools[name], into[name]), pool_bytes(pools[name], written[name])
                assert [loaded[i] for i in at] == [stored[i] for i in at]
                assert all(loaded[i] != stored[i] for i in range(PAGES) if i not in at)
                assert size == (1 if name == "mamba" else PAGE_SIZE)

        fresh = attach(backend(store, pools["kv"]), pools)  # a new backend instance finds them
        try:
            assert assert_exists_like_hicache_file(fresh, hicache_file) == seen
        finally:
            fresh.close()
    finally:
        kvstore.close()


def test_a_flipped_byte_or_a_missing_page_in_an_extra_pool_shrinks_the_hit(patient_store, tmp_path):
    from sglang.srt.mem_cache.hicache_storage import PoolName

    pools, kvstore, hicache_file = both_backends(patient_store, tmp_path)
    store_hybrid(kvstore, hicache_file, pools)
    chunk = kvstore.reads.chunk_bytes
    flipped = {"mamba": (5, kvstore.pools.pools["mamba"].chunk_keys([KEYS[5]], chunk)[1]),  # its 2nd part
               "swa": (1, kvstore.pools.pools["swa"].chunk_keys([KEYS[1]], chunk)[0])}
    kvstore.close()
    stop_service(patient_store)  # its DRAM tier goes: what comes back is read from disk and verified
    for name, (page, key) in flipped.items():
        corrupt_record(patient_store["tiers"]["disk"][0]["path"], key=key)
        # HiCacheFile, given the same presence pattern: that page's file is gone.
        (tmp_path / "hicache" / f"{hicache_file._get_component_key(KEYS[page], PoolName(name))}.bin").unlink()

    fresh = attach(backend(patient_store, pools["kv"]), pools)
    try:
        got, _ = load_hybrid(fresh, pools)
        assert named(got) == {"mamba": [i == 2 for i in range(PAGES)],
                              "swa": [i in (0, 2, 4, 5) for i in range(PAGES)]}
        assert named(load_hybrid(hicache_file, pools)[0]) == named(got)
        client = service_client(patient_store)
        try:
            assert client.info()["counters"]["disk.miss.bad_checksum"] == 2
        finally:
            client.close()
        # The pages that failed verification are gone from the index: the hit shrinks,
        # TRAILING_PAGES (Mamba: 6 pages -> 3) and ALL_PAGES (sliding-window KV: 3 -> 1).
        seen = assert_exists_like_hicache_file(fresh, hicache_file)
        assert seen["mamba"].restorable_prefix_pages == [3]
        assert seen["swa all"].kv_hit_pages == 1 and seen["swa window"].restorable_prefix_pages == [1, 6]
        assert seen["mamba + swa all"].kv_hit_pages == 0
    finally:
        fresh.close()


def test_v2_calls_it_cannot_serve_are_misses_never_exceptions(store, tmp_path):
    pools, kvstore, hicache_file = both_backends(store, tmp_path)
    try:
        store_hybrid(kvstore, hicache_file, pools)
        # A hit policy it does not implement (SGLang's HiCacheFile raises; SGLang counts that as 0).
        unsupported = exists_v2(kvstore, KEYS, [("mamba", 1, "block_groups")])
        assert (unsupported.kv_hit_pages, unsupported.extra_pool_hit_pages) == (0, {})
        with pytest.raises(ValueError, match="hit policy"):
            exists_v2(hicache_file, KEYS, [("mamba", 1, "block_groups")])
        # A pool never registered, and host indices that do not match the keys.
        assert named(kvstore.batch_get_v2([transfer("indexer", KEYS[:2], pools["swa"].alloc(2 * PAGE_SIZE)),
                                           transfer("swa", KEYS[:2], pools["swa"].alloc(PAGE_SIZE))])) == {
            "indexer": [False, False], "swa": [False, False]}
        assert exists_v2(kvstore, KEYS, [("indexer", 0, "all_pages")]).kv_hit_pages == 0
        # A stopped service: misses within the deadline.
        pid = service_client(store).info()["service_pid"]
        with paused(pid):
            got, _ = load_hybrid(kvstore, pools)
            assert named(got) == {"mamba": [False] * PAGES, "swa": [False] * PAGES}
            assert exists_v2(kvstore, KEYS, QUERIES["mamba"]).kv_hit_pages == 0
    finally:
        kvstore.close()


def test_mla_ranks_share_extra_pools_but_each_keeps_its_own_mamba_state(store):
    """As SGLang's file backend keys them: Mamba state is split across TP ranks even where
    the model's MLA KV (and its other pools) are the same on every rank and stored once."""
    pools = hybrid_pools(kv="mla")
    rank0, rank1 = (attach(backend(store, pools["kv"], tp_rank=r, tp_size=2, mla=True), pools)
                    for r in (0, 1))

    def stored(made) -> dict:
        hits = {name: exists_v2(made, KEYS[:1], [(name, 1, "trailing_pages")]) for name in ("mamba", "swa")}
        return {name: hit.extra_pool_hit_pages.get(name, 0) for name, hit in hits.items()}

    try:

        sets = [transfer("mamba", KEYS[:1], pools["mamba"].alloc(1)),
                transfer("swa", KEYS[:1], pools["swa"].alloc(PAGE_SIZE))]
        assert rank0.batch_set_v1(KEYS[:1], pools["kv"].alloc(PAGE_SIZE)) == [True]
        assert named(rank1.batch_set_v2(sets)) == {"mamba": [True], "swa": [True]}  # not the writer
        assert stored(rank1) == {"mamba": 1, "swa": 0} and stored(rank0) == {"mamba": 0, "swa": 0}
        assert named(rank0.batch_set_v2(sets)) == {"mamba": [True], "swa": [True]}
        assert stored(rank1) == {"mamba": 1, "swa": 1} and stored(rank0) == {"mamba": 1, "swa": 1}
    finally:
        rank0.close()
        rank1.close()


def test_a_reconnect_after_clear_that_fails_is_misses_for_a_while_not_for_good(store, monkeypatch):
    """clear() reconnects in the new generation's namespace on the next call, not on
    SGLang's thread that cleared; a reconnect that fails (a service that cannot start) is
    misses until a later one connects, never the storage tier off until a restart."""
    from engine_plugin.sglang import hicache

    pools = hybrid_pools()
    backend_ = attach(backend(store, pools["kv"]), pools)
    try:
        written = pools["kv"].alloc(PAGES * PAGE_SIZE)
        assert backend_.batch_set_v1(KEYS, written) == [True] * PAGES
        connect, tries = hicache.service_pages, []

        def fails_once(*args, **kwargs):
            tries.append(1)
            if len(tries) == 1:
                raise KVStoreError("kvstore service failed to start: (a fault)")
            return connect(*args, **kwargs)

        monkeypatch.setattr(hicache, "service_pages", fails_once)
        backend_.clear()
        assert tries == []  # nothing connected on the clearing thread
        assert backend_.batch_exists(KEYS) == 0  # the reconnect failed: a miss
        assert backend_.batch_get_v1(KEYS, pools["kv"].alloc(PAGES * PAGE_SIZE)) == [False] * PAGES
        assert tries == [1]  # not again before REOPEN_S
        monkeypatch.setattr(hicache, "REOPEN_S", 0.0)
        backend_.close()  # closed for good: no reconnect after it
        assert backend_.batch_exists(KEYS) == 0 and tries == [1]
    finally:
        backend_.close()
    again = attach(backend(store, pools["kv"]), pools)
    try:
        again.clear()
        monkeypatch.setattr(hicache, "REOPEN_S", 0.0)
        assert again.batch_set_v1(KEYS, written) == [True] * PAGES  # reconnected, new generation
        assert again.batch_exists(KEYS) == PAGES
    finally:
        again.close()


def test_a_cache_flush_starts_a_new_generation_as_a_weight_update_needs(store, tmp_path):
    """Every SGLang weight update flushes its caches, emptying the host pool, and never
    calls the storage backend's clear(): the backend clears itself at the flush, or it
    would serve KV computed with the old weights."""
    pools = hybrid_pools()
    flushed = attach(backend(store, pools["kv"]), pools)
    try:
        store_hybrid(flushed, file_backend(tmp_path, pools), pools)
        assert flushed.batch_exists(KEYS) == PAGES
        before = flushed.weights.generation
        pools["kv"].clear()  # what SGLang's flush_cache does to it (UnifiedRadixCache.reset)
        assert flushed.weights.generation and flushed.weights.generation != before
        assert flushed.batch_exists(KEYS) == 0
    finally:
        flushed.close()


def test_clear_starts_a_new_generation_whose_lookups_miss_what_was_stored_before(store, tmp_path):
    """SGLang's storage `clear()` (its answer to a weight update): this backend's lookups
    and loads miss every page it stored before, KV and extra pools alike, and what it stores
    after is found again; another engine's pages, and the records, stay (nothing deleted)."""
    from kvstore.format.keys import Weights

    pools = hybrid_pools()
    cleared, other = attach(backend(store, pools["kv"]), pools), attach(backend(store, pools["kv"]), pools)
    watcher = service_client(store)
    try:
        written = store_hybrid(cleared, file_backend(tmp_path, pools), pools)
        assert cleared.batch_exists(KEYS) == PAGES and exists_v2(cleared, KEYS, QUERIES["mamba"]).kv_hit_pages
        records = sum(tier["chunks"] for tier in watcher.info()["tiers"])
        cleared.clear()
        assert cleared.weights == Weights("rev:test", cleared.weights.generation)
        assert cleared.weights.generation
        assert cleared.batch_exists(KEYS) == 0
        assert cleared.batch_get_v1(KEYS, pools["kv"].alloc(PAGES * PAGE_SIZE)) == [False] * PAGES
        assert exists_v2(cleared, KEYS, QUERIES["mamba + swa all"]).restorable_prefix_pages == []
        got, _ = load_hybrid(cleared, pools)
        assert named(got) == {"mamba": [False] * PAGES, "swa": [False] * PAGES}
        assert other.batch_exists(KEYS) == PAGES  # not cleared: the old generation is still its own
        assert sum(tier["chunks"] for tier in watcher.info()["tiers"]) == records  # nothing deleted
        assert cleared.batch_set_v1(KEYS, written["kv"]) == [True] * PAGES
        assert cleared.batch_exists(KEYS) == PAGES
        announced = {entry["description"]["generation"] for entry in watcher.namespaces()}
        assert announced == {"", cleared.weights.generation}  # kvstore purge can name either
    finally:
        watcher.close()
        cleared.close()
        other.close()
