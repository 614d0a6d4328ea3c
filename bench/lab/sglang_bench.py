"""Loading SGLang HiCache pages: kvstore's backend against SGLang's own `file` backend.

    python -m bench.lab sglang_bench [--dir DIR] [--total 512MiB] [--fio-seconds 3] [--json out.json]

Both backends get the same pages of one of SGLang's own host pools (MHA, page-first,
bench/support/sglang_host_pools.py) and load them back into it the way SGLang's cache controller
calls each: kvstore through `batch_get_v1` (zero-copy, `interface_v1`), HiCacheFile
through `batch_get` into SGLang's flat page tensors and `set_from_flat_data_page` (the
controller's generic path, the one `file` gets). Every round checks the loaded bytes
against what was stored.

- warm: kvstore from its DRAM tier; HiCacheFile from the OS page cache (its files were
  just written).
- disk: kvstore after a service restart (its DRAM tier is empty; O_DIRECT reads into it,
  in huge pages reserved for the service as root, as fio's buffers are);
  HiCacheFile after its files were dropped from the page cache (posix_fadvise DONTNEED).

CPU s/GiB counts this process and, for kvstore, its service process too. fio reads the
same disk before and after the rounds (bench/lab/backend_rounds.py): the disk's ceiling.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

from bench.lab import Result
from bench.lab.backend_rounds import (
    Round,
    add_round_arguments,
    measure_disk,
    report,
    result,
    service_cpu,
    service_huge_pages,
)
from bench.lab.runner import run
from bench.support.fio import Yardstick
from bench.support.sglang_host_pools import PAGE_SIZE, mha_host_pool, storage_config
from kvstore.config.store import load_config
from kvstore.format.units import parse_size
from kvstore.service.client import stop_service

Loader = Callable[[list[str], torch.Tensor], bool]
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE: pages per storage call
LAYERS, HEADS, HEAD_DIM = 32, 8, 128  # a Llama-3-8B-like shard: 2 MiB pages of 16 tokens, fp16


class _Pages:
    """The pool's written pages, a second region to load into, and the check."""

    def __init__(self, pages: int) -> None:
        self.pool = mha_host_pool("page_first", 2 * pages, LAYERS, HEADS, HEAD_DIM)
        raw = self.pool.kv_buffer.view(torch.uint8)
        seeded = torch.Generator().manual_seed(7)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=seeded))
        self.keys = [f"{i:064x}" for i in range(pages)]
        self.written = self.pool.alloc(pages * PAGE_SIZE)
        self.loaded = self.pool.alloc(pages * PAGE_SIZE)
        self.digest = self.checksum(self.written)
        self.page_bytes = self.pool.get_data_page(0).numel() * self.pool.dtype.itemsize

    def checksum(self, indices: torch.Tensor) -> list[bytes]:
        pages = [self.pool.get_data_page(indices[i * PAGE_SIZE]) for i in range(len(self.keys))]
        return [xxhash.xxh3_64_digest(page.view(torch.uint8).numpy()) for page in pages]

    def batches(self, indices: torch.Tensor) -> list[tuple[list[str], torch.Tensor]]:
        return [(self.keys[i : i + BATCH], indices[i * PAGE_SIZE : (i + BATCH) * PAGE_SIZE])
                for i in range(0, len(self.keys), BATCH)]



def _timed(name: str, hits: str, pages: _Pages, load: Loader,
           service_cpu: Callable[[], float] | None) -> Round:
    """One round: every page loaded (timed), then checked against what was stored."""
    pages.pool.kv_buffer[:, pages.loaded[0] : pages.loaded[-1] + 1].zero_()
    os.sync()  # neither backend's round pays for flushing the writes before it
    cpu0, service0, wall0 = time.process_time(), service_cpu() if service_cpu else 0.0, time.perf_counter()
    loaded = all([load(keys, indices) for keys, indices in pages.batches(pages.loaded)])
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0 + ((service_cpu() - service0) if service_cpu else 0.0)
    gib = len(pages.keys) * pages.page_bytes / (1 << 30)
    return Round(name, hits, gib / wall, cpu / gib, loaded and pages.checksum(pages.loaded) == pages.digest)


def kvstore_rounds(pages: _Pages, directory: str) -> list[Round]:
    total = len(pages.keys) * pages.page_bytes
    store = {"tiers": {"dram": {"capacity": int(total * 1.25)},
                       "disk": [{"path": os.path.join(directory, "kvstore"), "capacity": int(total * 1.5)}]},
             "service": {"socket": os.path.join(directory, "run", "kvstore.sock"), "staging": "256MiB"}}
    extra = {"backend_name": "kvstore", "module_path": "engine_plugin.sglang.hicache",
             "class_name": "KVStoreHiCache", "interface_v1": 1, "config": store, "model_revision": "bench"}
    from engine_plugin.sglang.hicache import KVStoreHiCache

    def open_backend() -> KVStoreHiCache:
        backend = KVStoreHiCache(storage_config(extra), {})
        backend.register_mem_pool_host(pages.pool)
        return backend

    def load(backend: KVStoreHiCache) -> Loader:
        return lambda keys, indices: all(backend.batch_get_v1(keys, indices))

    with service_huge_pages(store, clients=2):  # the backend's reads and writes connect apart
        backend = open_backend()
        try:
            assert all(all(backend.batch_set_v1(k, i)) for k, i in pages.batches(pages.written))
            cpu = lambda: service_cpu(store)  # noqa: E731
            rounds = [_timed("kvstore", "warm", pages, load(backend), cpu)]
            backend.close()
            stop_service(load_config(store))  # a restart: the DRAM tier is empty, the disk tier recovered
            backend = open_backend()
            rounds.append(_timed("kvstore", "disk", pages, load(backend), cpu))
        finally:
            backend.close()
            stop_service(load_config(store))
    return rounds


def file_rounds(pages: _Pages, directory: str) -> list[Round]:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    path = os.path.join(directory, "hicache-file")
    backend = StorageBackendFactory.create_backend(
        "file", storage_config({"file_storage_path": path}), pages.pool)
    pool = pages.pool

    def load(keys: list[str], indices: torch.Tensor) -> bool:  # cache_controller._generic_page_get
        data = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        for i, page in enumerate(data):
            if page is None:
                return False
            pool.set_from_flat_data_page(indices[i * PAGE_SIZE], page)
        return True

    for keys, indices in pages.batches(pages.written):  # cache_controller._generic_page_set
        assert backend.batch_set(keys, [pool.get_data_page(indices[i * PAGE_SIZE]) for i in range(len(keys))])
    rounds = [_timed("HiCacheFile", "warm", pages, load, None)]
    os.sync()  # dirty pages are not dropped: written back first
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    rounds.append(_timed("HiCacheFile", "disk", pages, load, None))
    backend.clear()
    return rounds


WORKDIR_PARENT = "."  # the default work directory: here, on a disk that takes O_DIRECT (tmpfs does not)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_round_arguments(parser, "pages")


def main(argv: list[str] | None = None) -> list[Round]:
    """This experiment as `python -m bench.lab sglang_bench` runs it; its rounds (the backend's
    tests check them)."""
    return run("sglang_bench", argv).value


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    total_wanted = parse_size(args.total)
    yardstick = Yardstick(args.fio_seconds)
    with tempfile.TemporaryDirectory(dir=args.dir or workdir, prefix="sglang-bench-") as directory:
        pages = _Pages(max(1, total_wanted // (2 * PAGE_SIZE * LAYERS * HEADS * HEAD_DIM * 2)))
        total = len(pages.keys) * pages.page_bytes
        for_fio = args.fio_seconds > 0
        if for_fio:
            measure_disk(yardstick, directory, pages.page_bytes, total)
        rounds = file_rounds(pages, directory) + kvstore_rounds(pages, directory)
        if for_fio:
            measure_disk(yardstick, directory, pages.page_bytes, total)
    base = {r.hits: r.gib_s for r in rounds if r.backend == "HiCacheFile"}
    return result(rounds, yardstick, f"{len(pages.keys)} pages of {pages.page_bytes >> 20} MiB "
                  f"({total / (1 << 30):.2f} GiB), batches of {BATCH}",
                  report(rounds, lambda r: base[r.hits], "x file"), "HiCacheFile" if for_fio else None,
                  pages.page_bytes)
