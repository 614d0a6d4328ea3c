"""What the weights fingerprint costs (connectors/weights.py), for docs/vllm.md.

Writes a checkpoint of SHARDS safetensors-named files of GIB random GiB each plus a
config.json into a new directory, fingerprints it three ways and deletes it:
  cold    its pages dropped from the page cache first (posix_fadvise): read from the device
  again   a second full hash right after (what stayed in the page cache helps)
  cached  through the digest cache file a first fingerprint wrote: what a restart does

  python -m bench.lab weights_cost DIR [--shards 4] [--gib 4]     (4 x 4 GiB: an 8B model's size)
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from bench.lab import Result
from connectors.weights import FileDigests, fingerprint

_BLOCK = 64 << 20


def measure(directory: str, shards: int, gib: float) -> dict[str, float]:
    os.makedirs(directory)
    cache = directory.rstrip("/") + ".digests.json"
    try:
        block = os.urandom(_BLOCK)
        for i in range(shards):
            with open(os.path.join(directory, f"model-{i + 1:05d}-of-{shards:05d}.safetensors"), "wb") as f:
                for _ in range(max(1, int(gib * (1 << 30)) // _BLOCK)):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
        with open(os.path.join(directory, "config.json"), "w") as f:
            f.write('{"num_hidden_layers": 32}')
        for name in os.listdir(directory):
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        size = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
        result: dict[str, float] = {"bytes": size}
        for name, path in (("cold", None), ("again", cache), ("cached", cache)):
            started = time.perf_counter()
            digests = FileDigests(path)  # "cached" reads the file "again" wrote: a restart
            fingerprint(directory, digests)
            result[f"{name}_s"] = time.perf_counter() - started
            result[f"{name}_files_read"] = digests.hashed
        return result
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if os.path.exists(cache):
            os.unlink(cache)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write the checkpoint (must not exist; deleted after)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--gib", type=float, default=4.0, help="GiB per shard")


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    result = measure(args.directory, args.shards, args.gib)
    size = result["bytes"] / 1e9
    rate = size / result["cold_s"]
    return Result(f"{size:.1f} GB: first hash {result['cold_s']:.1f} s from the device ({rate:.2f} GB/s), "
                  f"again {result['again_s']:.1f} s, a restart (cached) {result['cached_s'] * 1e3:.2f} ms "
                  f"reading {result['cached_files_read']:.0f} files", result)
