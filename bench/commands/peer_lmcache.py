"""The peer row of `kvstore bench --peer lmcache`: LMCache's own LocalDiskBackend
stores and reads the same number of chunks of the same size on the same filesystem.

LMCache's objects do all the work (its config, CreateStorageBackends, its CPU
allocator, its put tasks and `batched_get_blocking` with its read threads); nothing of
it is re-implemented here. It runs in a child process so that `kvstore bench` never
imports it, its globals and threads do not outlive the case, and its CPU time is its
own. The child prints one result line:

  python -m bench.commands.peer_lmcache --dir DIR --chunk-bytes N --count N --batch N
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench.commands.storage_cases import CaseResult, clock

RESULT_PREFIX = "PEER_RESULT "
MISSING_EXIT = 3  # the child could not import lmcache
INSTALL = ("it lives in a virtualenv of its own (its pins clash with vllm's): "
           "bash scripts/setup_lmcache.sh builds .venv-lmcache (torch==2.13.0, then "
           "pip install -e '.[dev,peer]'; scripts/setup.sh runs it), "
           "then run .venv-lmcache/bin/kvstore bench --peer lmcache (docs/benchmarks.md)")
THREADS = 4  # LMCache's default disk_io_threads, set explicitly so the row can say it


def peer_case(workdir: str, chunk_bytes: int, count: int, batch: int,
              queue_depth: int) -> CaseResult | str:
    """LMCache's write and read of `count` chunks under `workdir`; why not, as a string.
    `queue_depth` is the sitting's, for the fio it is compared with."""
    directory = tempfile.mkdtemp(prefix="lmcache-", dir=workdir)
    command = [sys.executable, "-m", "bench.commands.peer_lmcache", "--dir", directory,
               "--chunk-bytes", str(chunk_bytes), "--count", str(count), "--batch", str(batch)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode == MISSING_EXIT:
        return f"lmcache is not importable here ({done.stdout.strip()}); {INSTALL}"
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"LMCache's run failed: {tail}"
    figures: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX):])
    return CaseResult("disk", "lmcache", chunk_bytes, queue_depth, figures.pop("read_gibps"),
                      figures.pop("write_gibps"), figures.pop("cpu_s_per_gib_read"),
                      extra={"batch": batch, **figures})


def _run(directory: str, chunk_bytes: int, count: int, batch: int) -> dict[str, Any]:
    """In the child: LMCache as its engine would set it up, minus the engine."""
    import asyncio
    import threading

    import torch
    from lmcache import __version__
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend import CreateStorageBackends

    gib_of = 2**30
    # Its CPU pool only stages (local_cpu off: no DRAM cache of its own): one batch at a time.
    pool_gb = (batch + 4) * chunk_bytes * 1.25 / gib_of
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=False, max_local_cpu_size=pool_gb, local_disk=directory,
        max_local_disk_size=(count + 4) * chunk_bytes / gib_of,
        extra_config={"use_odirect": True, "disk_io_threads": THREADS})
    metadata = LMCacheMetadata(model_name="kvstore-bench", world_size=1, local_world_size=1,
                               worker_id=0, local_worker_id=0, kv_dtype=torch.uint8,
                               kv_shape=(1, 2, 256, 1, chunk_bytes // 512))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    backends = CreateStorageBackends(config, metadata, loop)
    cpu, disk = backends["LocalCPUBackend"], backends["LocalDiskBackend"]
    shape, dtype = torch.Size([chunk_bytes]), torch.uint8
    keys = [CacheEngineKey("kvstore-bench", 1, 0, i, dtype) for i in range(count)]
    sources = [torch.randint(0, 256, (chunk_bytes,), dtype=dtype) for _ in range(4)]
    try:
        with clock() as wrote:
            for start in range(0, count, batch):
                picked = keys[start : start + batch]
                objects = [cpu.allocate(shape, dtype, MemoryFormat.KV_2LTD) for _ in picked]
                for i, obj in enumerate(objects):
                    obj.tensor.copy_(sources[i % 4])
                disk.batched_submit_put_task(picked, objects)
                for obj in objects:
                    obj.ref_count_down()  # the put task holds its own reference
                while any(disk.exists_in_put_tasks(key) for key in picked):
                    time.sleep(0.001)
        stored = sum(disk.contains(key) for key in keys)
        if stored != count:
            raise RuntimeError(f"LMCache stored {stored} of {count} chunks")
        order = random.Random(0).sample(keys, count)
        _load(disk, keys[:batch])  # untimed, as kvstore's get case warms its buffers
        with clock() as read:
            served = sum(_load(disk, order[start : start + batch]) for start in range(0, count, batch))
        if served != count:
            raise RuntimeError(f"LMCache read back {served} of {count} chunks")
        for key in keys:
            disk.remove(key)
    finally:
        disk.close()
        cpu.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    gib = count * chunk_bytes / gib_of
    return {"read_gibps": gib / read["wall"], "write_gibps": gib / wrote["wall"],
            "cpu_s_per_gib_read": read["cpu"] / gib, "lmcache_version": __version__,
            "backend": type(disk).__name__, "threads": THREADS, "o_direct": True,
            "verified": False}


def _load(disk: Any, keys: list[Any]) -> int:
    """One `batched_get_blocking`; its buffers go back to LMCache's pool. Chunks read."""
    loaded = disk.batched_get_blocking(keys)
    for obj in loaded:
        if obj is not None:
            obj.ref_count_down()
    return sum(obj is not None for obj in loaded)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.commands.peer_lmcache", description=__doc__)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--chunk-bytes", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    args = parser.parse_args(argv)
    try:
        import lmcache.v1.storage_backend  # noqa: F401
    except ImportError as exc:
        print(exc)
        return MISSING_EXIT
    figures = _run(os.path.abspath(args.dir), args.chunk_bytes, args.count, args.batch)
    print(RESULT_PREFIX + json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
