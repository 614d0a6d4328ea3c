"""The index under load: one Redis instance against a Redis Cluster of 3 shards, same run.

  python -m bench.lab index_load [--hosts 4] [--peers 16] [--chunks 20000] [--lookup-keys 60]
      [--seconds 10] [--json out.json]

Starts both on loopback (bench/support/redis_server.py: one redis-server; 6 more as a cluster
of 3 masters with a replica each), fills each with the entries of --peers hosts
(--chunks each, and their leases, in kvstore's key schema), then runs --hosts
processes at once, each an IndexReader (kvstore/cluster/index.py, the code a host's
lookup runs) asking for prompts of --lookup-keys chunks of random peers, back to back,
for --seconds. Per host: lookups/s, p50/p99 latency and its CPU per lookup; then the cluster against the
single instance (ratios), and each server's (each master's) commands/s and CPU. Every
lookup must find every chunk it asks for.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.lab import Result, Unavailable
from bench.support.redis_server import RedisClusterServers, RedisServer, redis_server_unavailable
from kvstore.cluster.connection import Command, IndexConnection
from kvstore.cluster.index import IndexKeys, IndexReader, Location
from kvstore.config.store import ClusterConfig, load_config
from kvstore.tiers.stats import Stats

LEASE_S = 600.0


def _config(url: str, peers: int) -> ClusterConfig:
    config = load_config({"tiers": {"dram": {"capacity": "1MiB"}},
                          "cluster": {"host_id": "reader", "index_url": url, "index_deadline_s": 5,
                                      "lease_s": LEASE_S,
                                      "peers": [{"host_id": f"h{i}",  # devices never opened here
                                                 "disk": [{"path": f"/nonexistent/h{i}", "capacity": "1GiB"}]}
                                                for i in range(peers)]}})
    assert config.cluster is not None
    return config.cluster


def _chunk_keys(peer: int, chunks: int) -> list[bytes]:
    return [peer.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(chunks)]


def fill(url: str, peers: int, chunks: int) -> None:
    """Every peer's lease and `chunks` entries, as their publishers would have sent them."""
    index = IndexConnection(url, 30)
    keys = IndexKeys("kvstore:", index.cluster)
    try:
        for peer in range(peers):
            host, generation = f"h{peer}", peer + 1
            index.client.set(keys.lease(host), generation.to_bytes(8, "little"), px=int(LEASE_S * 1000))
            for start in range(0, chunks, 4096):
                commands: list[Command] = []
                for i, key in enumerate(_chunk_keys(peer, chunks)[start : start + 4096], start):
                    location = Location(generation, 0, bytes(8), i, i).pack()
                    commands.append(("hset", (keys.chunk(key), host, location)))
                    commands.append(("sadd", (keys.published(host), key)))
                failed = [answer for answer in index.run(commands) if isinstance(answer, BaseException)]
                if failed:
                    raise failed[0]
    finally:
        index.close()


def _host(url: str, peers: int, chunks: int, lookup_keys: int, seconds: float, seed: int,
          start_at: float, out: Any) -> None:
    """One host: lookups back to back until `seconds` have passed; its latencies to `out`."""
    reader = IndexReader(_config(url, peers), Stats())
    rng = random.Random(seed)
    prompts = [_chunk_keys(peer, chunks) for peer in range(peers)]
    samples, wrong = [], 0
    time.sleep(max(0.0, start_at - time.time()))
    stop = time.monotonic() + seconds
    cpu = time.process_time()
    while time.monotonic() < stop:
        owned = prompts[rng.randrange(peers)]
        first = rng.randrange(len(owned) - lookup_keys)
        wanted = owned[first : first + lookup_keys]
        started = time.perf_counter()
        found = reader.locate(wanted)
        samples.append(time.perf_counter() - started)
        wrong += found is None or len(found) != len(wanted)
    cpu = time.process_time() - cpu
    reader.close()
    out.put((seed, samples, wrong, cpu))


def _server_load(ports: list[int]) -> list[tuple[int, float]]:
    """Each server's commands processed and CPU seconds so far."""
    import redis

    load = []
    for port in ports:
        with redis.Redis(port=port) as server:
            stats, cpu = server.info("stats"), server.info("cpu")
        load.append((stats["total_commands_processed"], cpu["used_cpu_user"] + cpu["used_cpu_sys"]))
    return load


def measure(url: str, ports: list[int], hosts: int, peers: int, chunks: int, lookup_keys: int,
            seconds: float) -> dict[str, Any]:
    """`hosts` processes' lookups against the index at `url`, whose servers (masters) are `ports`."""
    fill(url, peers, chunks)
    before = _server_load(ports)
    context = multiprocessing.get_context("spawn")  # no client state inherited
    out = context.Queue()
    start_at = time.time() + 3  # every host starts at once, after the slowest spawn
    shape = (url, peers, chunks, lookup_keys, seconds)
    workers = [context.Process(target=_host, args=(*shape, h, start_at, out)) for h in range(hosts)]
    for worker in workers:
        worker.start()
    rows: list[tuple[int, list[float], int, float]] = []
    deadline = time.monotonic() + seconds + 120
    while len(rows) < hosts:
        try:
            rows.append(out.get(timeout=1))
        except queue.Empty:
            failed = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for worker in workers:
                    worker.kill()
                raise RuntimeError(f"a host process failed (exit {failed}) or hung") from None
    for worker in workers:
        worker.join(30)
    rows.sort()
    shards = [{"commands_per_s": (c1 - c0) / seconds, "cpu_share": (t1 - t0) / seconds}
              for (c0, t0), (c1, t1) in zip(before, _server_load(ports), strict=True)]
    per_host = []
    for _, samples, wrong, cpu in rows:
        samples.sort()
        per_host.append({"lookups_per_s": len(samples) / seconds, "p50_ms": 1000 * statistics.median(samples),
                         "p99_ms": 1000 * samples[int(0.99 * len(samples))], "incomplete": wrong,
                         "client_cpu_ms_per_lookup": 1000 * cpu / len(samples)})
    return {"per_host": per_host, "shards": shards,
            "lookups_per_s": sum(h["lookups_per_s"] for h in per_host),
            "p99_ms_worst_host": max(h["p99_ms"] for h in per_host),
            "incomplete": sum(h["incomplete"] for h in per_host)}


def both(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The same load on one redis-server and on a Redis Cluster, one after the other."""
    (root / "single").mkdir(exist_ok=True)
    (root / "cluster").mkdir(exist_ok=True)
    single, cluster = RedisServer(root / "single"), RedisClusterServers(root / "cluster")
    try:
        single.start()
        cluster.start()
        shape = (args.hosts, args.peers, args.chunks, args.lookup_keys, args.seconds)
        result: dict[str, Any] = {"hosts": args.hosts, "peers": args.peers, "chunks_per_peer": args.chunks,
                                  "lookup_keys": args.lookup_keys, "seconds": args.seconds,
                                  "cpus": os.cpu_count()}
        result["single"] = measure(single.url, [single.port], *shape)
        result["cluster"] = measure(cluster.url, sorted(cluster.primaries(cluster.live())), *shape)
    finally:
        single.stop()
        cluster.stop()
    result["cluster_vs_single_lookups"] = (result["cluster"]["lookups_per_s"]
                                           / result["single"]["lookups_per_s"])
    result["cluster_vs_single_p99"] = (result["cluster"]["p99_ms_worst_host"]
                                       / result["single"]["p99_ms_worst_host"])
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", type=int, default=4, help="reading hosts (processes) at once")
    parser.add_argument("--peers", type=int, default=16, help="hosts whose entries fill the index")
    parser.add_argument("--chunks", type=int, default=20000, help="entries per peer")
    parser.add_argument("--lookup-keys", type=int, default=60)
    parser.add_argument("--seconds", type=float, default=10.0)


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    reason = redis_server_unavailable(cluster=True)
    if reason:
        raise Unavailable(reason)
    if args.chunks <= args.lookup_keys or min(args.hosts, args.peers) < 1:
        raise Unavailable("needs --hosts and --peers of at least 1 and --chunks above --lookup-keys")
    result = both(workdir, args)
    return Result(table(result), result)


def table(result: dict[str, Any]) -> str:
    lines = []
    for name in ("single", "cluster"):
        for host, row in enumerate(result[name]["per_host"]):
            lines.append(f"{name:>8} host {host}: {row['lookups_per_s']:8.0f} lookups/s  p50 "
                         f"{row['p50_ms']:6.2f} ms  p99 {row['p99_ms']:6.2f} ms  client CPU "
                         f"{row['client_cpu_ms_per_lookup']:.2f} ms/lookup")
        lines.append(f"{name:>8} all: {result[name]['lookups_per_s']:8.0f} lookups/s, worst p99 "
                     f"{result[name]['p99_ms_worst_host']:.2f} ms, incomplete {result[name]['incomplete']}")
        for shard, row in enumerate(result[name]["shards"]):
            lines.append(f"{name:>8} server {shard}: {row['commands_per_s']:8.0f} commands/s, "
                         f"{100 * row['cpu_share']:5.1f}% of a core")
    lines.append(f"cluster / single: {result['cluster_vs_single_lookups']:.2f}x lookups/s, "
                 f"{result['cluster_vs_single_p99']:.2f}x p99")
    return "\n".join(lines)
