"""Loading LMCache chunks: kvstore's storage plugin against LMCache's own LocalDiskBackend.

    .venv-lmcache/bin/python -m bench.lab lmcache_bench [--dir DIR] [--total 512MiB] [--fio-seconds 3]
        [--json out.json]

(.venv-lmcache holds lmcache==0.5.6 and kvstore: scripts/setup_lmcache.sh.) LMCache's own
CreateStorageBackends makes both from one config (`local_disk` with O_DIRECT and its 4
read threads, and `storage_plugins: [kvstore]`); both store the same chunks, then each
round loads all of them with `batched_get_blocking` in batches, into objects from
LMCache's CPU backend, and checks them against what was stored, outside the timed part.

- warm: kvstore from its DRAM tier; LMCache's disk backend has no DRAM tier of its own
  (its O_DIRECT reads go to the disk), so its warm and disk rounds are the same reads.
- disk: kvstore after a service restart (its DRAM tier empty; O_DIRECT reads into it, in
  huge pages reserved for the service as root, as fio's buffers are).

CPU s/GiB counts this process and, for kvstore, its service process too. fio reads the
same disk before and after the rounds (bench/lab/backend_rounds.py): the disk's ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

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
from kvstore.config.store import load_config
from kvstore.format.units import parse_size
from kvstore.service.client import stop_service

CHUNK_TOKENS, LAYERS, HEADS, HEAD_DIM = 64, 32, 8, 128  # 8 MiB chunks, fp16
BATCH = 16


def _backends(directory: str, store: dict[str, Any], count: int, chunk_bytes: int) -> tuple[Any, Any]:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends

    gib = 1 << 30
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK_TOKENS, local_cpu=True, max_local_cpu_size=(2 * BATCH + 8) * chunk_bytes / gib,
        local_disk=os.path.join(directory, "lmcache"), max_local_disk_size=(count + 4) * chunk_bytes / gib,
        storage_plugins=["kvstore"],
        extra_config={"use_odirect": True, "disk_io_threads": 4, "kvstore.config": store,
                      "kvstore.model_revision": "bench",
                      "storage_plugin.kvstore.module_path": "engine_plugin.lmcache.storage",
                      "storage_plugin.kvstore.class_name": "KVStoreBackend"})
    metadata = LMCacheMetadata(model_name="bench/model", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.float16,
                               kv_shape=(LAYERS, 2, CHUNK_TOKENS, HEADS, HEAD_DIM))
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return CreateStorageBackends(config, metadata, loop), loop


def _digest(obj: Any) -> bytes:
    return xxhash.xxh3_64_digest(obj.tensor.view(torch.uint8).numpy())


WORKDIR_PARENT = "."  # the default work directory: here, on a disk that takes O_DIRECT (tmpfs does not)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_round_arguments(parser, "chunks")


def main(argv: list[str] | None = None) -> list[Round]:
    """This experiment as `python -m bench.lab lmcache_bench` runs it; its rounds (the backend's
    tests check them)."""
    return run("lmcache_bench", argv).value


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    yardstick = Yardstick(args.fio_seconds)
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    chunk_bytes = LAYERS * 2 * CHUNK_TOKENS * HEADS * HEAD_DIM * 2
    count = max(BATCH, parse_size(args.total) // chunk_bytes // BATCH * BATCH)
    with tempfile.TemporaryDirectory(dir=args.dir or workdir, prefix="lmcache-bench-") as directory:
        store = {"tiers": {"dram": {"capacity": int(count * (chunk_bytes + 8192) * 1.3)},
                           "disk": [{"path": os.path.join(directory, "kvstore"),
                                     "capacity": int(count * (chunk_bytes + 8192) * 1.6)}]},
                 "service": {"socket": os.path.join(directory, "run", "kvstore.sock"), "staging": "256MiB"}}
        if args.fio_seconds > 0:
            measure_disk(yardstick, directory, chunk_bytes, count * chunk_bytes)
        with service_huge_pages(store, clients=2):  # the plugin reads and writes apart
            backends, loop = _backends(directory, store, count, chunk_bytes)
            cpu, disk, plugin = backends["LocalCPUBackend"], backends["LocalDiskBackend"], backends["kvstore"]
            keys = [CacheEngineKey("bench/model", 1, 0, i, torch.float16) for i in range(count)]
            absent = [CacheEngineKey("bench/model", 1, 0, count + i, torch.float16) for i in range(BATCH)]
            shape = plugin.metadata.get_shapes(CHUNK_TOKENS)[0]  # as LMCache's cache engine allocates
            digests = []
            for start in range(0, count, BATCH):
                objs = [cpu.allocate(shape, torch.float16, MemoryFormat.KV_2LTD) for _ in range(BATCH)]
                for i, obj in enumerate(objs):
                    raw = obj.tensor.view(torch.uint8)
                    seeded = torch.Generator().manual_seed(start + i)
                    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=seeded))
                    digests.append(_digest(obj))
                disk.batched_submit_put_task(keys[start : start + BATCH], objs)
                plugin.batched_submit_put_task(keys[start : start + BATCH], objs)
                for obj in objs:
                    obj.ref_count_down()
                while any(disk.exists_in_put_tasks(k) for k in keys[start : start + BATCH]):
                    time.sleep(0.001)

            def timed(name: str, hits: str, backend: Any, service: bool) -> Round:
                # Untimed, keys never stored: buffers warm as in a running engine, no chunk promoted.
                assert not any(backend.batched_get_blocking(absent))
                os.sync()
                service0 = service_cpu(store) if service else 0.0
                seen: list[bytes | None] = []
                elapsed = cpu = 0.0
                for start in range(0, count, BATCH):
                    wall0, cpu0 = time.perf_counter(), time.process_time()
                    objs = backend.batched_get_blocking(keys[start : start + BATCH])
                    elapsed, cpu = elapsed + time.perf_counter() - wall0, cpu + time.process_time() - cpu0
                    for obj in objs:  # checked, and handed back, outside the timed part
                        seen.append(None if obj is None else _digest(obj))
                        if obj is not None:
                            obj.ref_count_down()
                cpu += (service_cpu(store) - service0) if service else 0.0
                gib = count * chunk_bytes / (1 << 30)
                return Round(name, hits, gib / elapsed, cpu / gib, seen == digests)

            try:
                rounds = [timed("LMCache LocalDiskBackend", "disk", disk, False),
                          timed("kvstore plugin", "warm", plugin, True)]
                plugin.close()
                stop_service(load_config(store))
                from engine_plugin.lmcache.storage import KVStoreBackend

                again = KVStoreBackend("cpu", plugin.config, plugin.metadata, cpu, loop)
                rounds.append(timed("kvstore plugin", "disk", again, True))
                again.close()
            finally:
                stop_service(load_config(store))
                disk.close()
                loop.call_soon_threadsafe(loop.stop)
        if args.fio_seconds > 0:
            measure_disk(yardstick, directory, chunk_bytes, count * chunk_bytes)
    base = next(r.gib_s for r in rounds if r.backend.startswith("LMCache"))
    return result(rounds, yardstick, f"{count} chunks of {chunk_bytes >> 20} MiB "
                  f"({count * chunk_bytes / (1 << 30):.2f} GiB), batches of {BATCH}",
                  report(rounds, lambda r: base, "x LMCache"),
                  "LMCache LocalDiskBackend" if args.fio_seconds > 0 else None, chunk_bytes)
