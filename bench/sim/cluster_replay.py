"""`kvstore replay TRACE --hosts N`: N hosts sharing one array, against N private islands.

Every host has its own tiers above the array (`--tier dram=SIZE`: SIZE per host) and
writes its own part of the array (the last `--tier`, e.g. `disk=SIZE`, is the whole
array: each host's part holds SIZE/N), under the store's policy, as a cluster host does
(kvstore/cluster/: each host is the only writer of its own namespaces). Both runs see
the same requests on the same hosts:
- shared: a host's lookup also finds what the other hosts' parts hold (the index and
  peer reads); such hits are promoted into its DRAM and dropped when they leave it;
- private: the same hosts, each reading only its own part (capacity/N each).
Routing: `random` (uniform, seeded) or `prefix` (a hash of the request's first block
picks the host, as a KV-aware router keeps a prefix on one host).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.sim.replay import Replayer, SimTier, TierStats
from bench.support.trace import TraceRequest, read_trace
from kvstore.format.errors import ConfigError
from kvstore.format.units import format_size
from kvstore.tiers.policy import TierPolicy

ROUTINGS = ("random", "prefix")


class Cluster:
    """N hosts' replayers; `shared`: each reads the other hosts' parts of the array."""

    def __init__(self, tiers: list[tuple[str, int]], hosts: int, shared: bool, kv_bytes_per_token: int,
                 block_tokens: int, promote: bool) -> None:
        chunk_bytes = kv_bytes_per_token * block_tokens
        *upper, (array, capacity) = tiers
        parts = [SimTier(array, capacity // hosts, chunk_bytes) for _ in range(hosts)]
        self.hosts = [Replayer([*upper, part], kv_bytes_per_token, block_tokens,
                               policy=TierPolicy(promote_on_hit=promote),
                               peers=[p for p in parts if p is not part] if shared else [])
                      for part in parts]

    def result(self) -> dict[str, Any]:
        """Every host's tiers summed, level by level (the array's parts make the array)."""
        rows = [h.result() for h in self.hosts]
        total = sum(r["prompt_tokens"] for r in rows)
        tiers = []
        for level, first in enumerate(rows[0]["tiers"]):
            summed = TierStats(first["name"], 0)
            for row in rows:
                tier = row["tiers"][level]
                for field in ("capacity_bytes", "hit_tokens", "bytes_read", "bytes_written", "evictions"):
                    setattr(summed, field, getattr(summed, field) + tier[field])
            summed.hit_ratio = summed.hit_tokens / max(1, total)
            tiers.append(asdict(summed))
        if self.hosts[0].peers:  # the peers' parts are the array, counted once already
            tiers[-1]["capacity_bytes"] = 0
        return {"hit_ratio": sum(t["hit_tokens"] for t in tiers) / max(1, total), "tiers": tiers,
                "requests_per_host": [r["requests"] for r in rows]}


def route(requests: Iterable[TraceRequest], hosts: int, routing: str,
          seed: int) -> Iterable[tuple[int, TraceRequest]]:
    rng = random.Random(seed)
    for request in requests:
        if routing == "prefix" and request.keys:
            yield int.from_bytes(request.keys[0][:8], "little") % hosts, request
        else:  # random, or a prompt shorter than one block (no prefix to route by)
            yield rng.randrange(hosts), request


def replay_cluster(trace: str, tiers: list[tuple[str, int]], hosts: int, routing: str, *,
                   kv_bytes_per_token: int, block_tokens: int, limit: int | None = None,
                   promote: bool = True, seed: int = 0) -> dict[str, Any]:
    if hosts < 1:
        raise ConfigError("--hosts", hosts, "must be at least 1")
    if routing not in ROUTINGS:
        raise ConfigError("--routing", routing, f"one of {', '.join(ROUTINGS)}")
    if len(tiers) < 2:
        raise ConfigError("--tier", [name for name, _ in tiers], "--hosts needs a tier per host and "
                          "the array last, e.g. --tier dram=64GiB --tier disk=16TiB")
    shared, private = (Cluster(tiers, hosts, flag, kv_bytes_per_token, block_tokens, promote)
                       for flag in (True, False))
    requests = tokens = 0
    for host, request in route(read_trace(trace, block_tokens, limit), hosts, routing, seed):
        shared.hosts[host].serve(request)
        private.hosts[host].serve(request)
        requests += 1
        tokens += request.input_tokens
    together, alone = shared.result(), private.result()
    return {"requests": requests, "prompt_tokens": tokens, "chunk_bytes": kv_bytes_per_token * block_tokens,
            "hosts": hosts, "routing": routing, "hit_ratio": together["hit_ratio"],
            "private_hit_ratio": alone["hit_ratio"], "tiers": together["tiers"],
            "private_tiers": alone["tiers"], "requests_per_host": together["requests_per_host"]}


def run(args: argparse.Namespace, tiers: list[tuple[str, int]]) -> int:
    """`kvstore replay --hosts N`: print both runs, tier by tier, and write --json."""
    if args.sweep or args.ttft:
        raise ConfigError("--hosts", args.hosts, "is not combined with --sweep or --ttft")
    started = time.perf_counter()
    result = replay_cluster(args.trace, tiers, args.hosts, args.routing,
                            kv_bytes_per_token=args.kv_bytes_per_token, block_tokens=args.block_tokens,
                            limit=args.limit, promote=not args.no_promote, seed=args.seed)
    result["seconds"] = time.perf_counter() - started
    print(f"{result['requests']} requests, {result['prompt_tokens']} prompt tokens, chunk "
          f"{format_size(result['chunk_bytes'])}, {result['hosts']} hosts, {result['routing']} routing, "
          f"{result['seconds']:.1f} s")
    print(f"{'tier':<8} {'capacity':>10} {'shared array':>13} {'private':>10}")
    private = {t["name"]: t for t in result["private_tiers"]}
    for tier in result["tiers"]:
        alone = f"{private[tier['name']]['hit_ratio']:>10.3f}" if tier["name"] in private else f"{'-':>10}"
        capacity = format_size(tier["capacity_bytes"]) if tier["capacity_bytes"] else "(peers)"
        print(f"{tier['name']:<8} {capacity:>10} {tier['hit_ratio']:>13.3f} {alone}")
    print(f"{'all':<8} {'':>10} {result['hit_ratio']:>13.3f} {result['private_hit_ratio']:>10.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
