"""What the cluster path costs on this machine: index lookups, publishing, peer reads.

  python -m bench.lab cluster_bench [--workdir DIR] [--chunk-size 4MiB] [--chunks 128]
      [--lookup-keys 60] [--index-url redis://...] [--json out.json]

Two stores stand for two hosts (each its own device under DIR, each reading the
other's), with a redis-server of its own on a loopback port unless --index-url names
one. It measures: a lookup's index read (one pipeline: the peers' leases and one
HMGET per key) for --lookup-keys keys, p50/p99; publishing --chunks chunks (one
pipeline per batch), updates per second and Redis memory per published chunk; and
reading the chunks from the peer's device against reading them from the owner's own
(both O_DIRECT through the same I/O engine), GiB/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.lab import Result, Unavailable
from bench.support.redis_server import RedisServer, redis_server_unavailable
from kvstore.config.store import CLUSTER_SCHEMES
from kvstore.format.keys import KVNamespace, chunk_keys
from kvstore.format.record import record_bytes
from kvstore.format.units import parse_size
from kvstore.store.tiered import TieredStore


def _config(me: str, other: str, root: str, capacity: int, url: str) -> dict[str, Any]:
    return {"tiers": {"disk": [{"path": os.path.join(root, me), "capacity": capacity}]},
            "io": {"engine": "auto", "queue_depth": 32, "timeout_s": 30},
            "cluster": {"host_id": me, "index_url": url, "index_deadline_s": 1.0,
                        "peers": [{"host_id": other, "disk": [{"path": os.path.join(root, other),
                                                                "capacity": capacity}]}]}}


def _gibps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / (1 << 30)


def measure(root: str, url: str, chunk_bytes: int, chunks: int, lookup_keys: int) -> dict[str, Any]:
    import redis

    capacity = (chunks + 8) * record_bytes(chunk_bytes) + (1 << 20)
    namespace = KVNamespace(model="bench", kv_dtype="uint8", kv_layout="flat", chunk_tokens=256)
    keys = chunk_keys(np.random.default_rng(0).integers(0, 32000, chunks * 256), namespace)
    payloads = [np.random.default_rng(i).integers(0, 256, chunk_bytes, dtype=np.uint8) for i in range(chunks)]
    a = TieredStore(_config("a", "b", root, capacity, url), chunk_bytes, background=False)
    b = TieredStore(_config("b", "a", root, capacity, url), chunk_bytes, background=False)
    index = redis.Redis.from_url(url)
    try:
        assert a.step()  # b's device found, the empty start-up reconcile and the lease
        memory_before = index.info("memory")["used_memory"]
        assert all(a.put_many(keys, payloads))
        started = time.perf_counter()
        assert a.step()  # with one superblock read of b's device, small beside the updates
        publish_s = time.perf_counter() - started
        memory_per_chunk = (index.info("memory")["used_memory"] - memory_before) / chunks

        wanted = (keys * (lookup_keys // len(keys) + 1))[:lookup_keys]
        samples = []
        for _ in range(300):
            started = time.perf_counter()
            assert b.probe.at_peers(wanted) == set(wanted)
            samples.append(time.perf_counter() - started)
        samples.sort()

        outs = b.buffers(chunks)
        started = time.perf_counter()
        assert all(b.get_many(keys, outs))
        peer_s = time.perf_counter() - started
        own = a.buffers(chunks)
        started = time.perf_counter()
        assert all(a.get_many(keys, own))
        local_s = time.perf_counter() - started
        assert all(bytes(x) == bytes(y) for x, y in zip(outs[:4], own[:4], strict=True))
        return {"chunk_bytes": chunk_bytes, "chunks": chunks, "lookup_keys": lookup_keys,
                "io_engine": a.info()["io_engine"],
                "lookup_p50_ms": 1000 * statistics.median(samples),
                "lookup_p99_ms": 1000 * samples[int(0.99 * len(samples))],
                "publish_updates_per_s": chunks / publish_s,
                "redis_bytes_per_chunk": memory_per_chunk,
                "peer_read_gibps": _gibps(chunks * chunk_bytes, peer_s),
                "local_read_gibps": _gibps(chunks * chunk_bytes, local_s)}
    finally:
        index.close()
        a.close()
        b.close()


WORKDIR_PARENT = "/var/tmp"  # the two devices go here: it takes O_DIRECT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunk-size", default="4MiB")
    parser.add_argument("--chunks", type=int, default=128)
    parser.add_argument("--lookup-keys", type=int, default=60,
                        help="keys per lookup (60: a 15k-token prompt of 256-token chunks)")
    parser.add_argument("--index-url", help="an existing Redis (default: start one on loopback)")


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    if args.index_url and args.index_url.startswith(CLUSTER_SCHEMES):
        raise Unavailable("--index-url: one instance (its memory per chunk is read with INFO); "
                          "python -m bench.lab index_load measures a Redis Cluster")
    server = None
    url = args.index_url
    if url is None:
        reason = redis_server_unavailable()
        if reason:
            raise Unavailable(reason)
        server = RedisServer(workdir)
        server.start()
        url = server.url
    try:
        result = measure(str(workdir), url, parse_size(args.chunk_size), args.chunks, args.lookup_keys)
    finally:
        if server is not None:
            server.stop()
    return Result("\n".join(f"{name:>24}: {value:.3f}" if isinstance(value, float) else f"{name:>24}: {value}"
                            for name, value in result.items()), result)
