"""`kvstore replay`: what hit ratio a trace gets from tiers of given sizes.

Each tier is kvstore's own SlotTable (slots, index, prefix-aware LRU), sized in
chunks of `kv_bytes_per_token x block_tokens` bytes, and the policy is the store's:
a new chunk enters the top tier; a victim moves down one tier unless that tier
has it already; a hit in a lower tier is promoted to the top. For each request,
the leading run of its full blocks present in any tier is a hit (capped so one
prompt token is always computed); the rest is computed and stored.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, read_trace
from kvstore.errors import ConfigError
from kvstore.slots import SlotTable
from kvstore.units import format_size, parse_size


@dataclass
class TierStats:
    name: str
    capacity_bytes: int
    hit_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    hit_ratio: float = 0.0


class SimTier:
    """One tier: a SlotTable of whole chunks (no bytes move in a replay)."""

    def __init__(self, name: str, capacity_bytes: int, chunk_bytes: int) -> None:
        self.stats = TierStats(name, capacity_bytes)
        self.chunk_bytes = chunk_bytes
        self.table = SlotTable([max(1, capacity_bytes // chunk_bytes)])

    def __contains__(self, key: bytes) -> bool:
        return key in self.table.index

    def insert(self, key: bytes, parent: bytes | None) -> tuple[bytes, bytes | None] | None:
        """Store `key`; returns the evicted (key, parent), if one had to go."""
        evicted: list[tuple[bytes, bytes | None]] = []

        def note_victim(victim: bytes, slot: int) -> bool:
            evicted.append((victim, self.table.slots[slot].parent))
            return False  # do not keep it here: reserve() evicts it

        reserved = self.table.reserve(0, claim_victim=note_victim)
        assert reserved is not None  # nothing is ever pinned in a replay
        slot, victim = reserved
        self.table.publish(slot, key, parent, 0)
        self.table.unpin(slot)
        self.stats.bytes_written += self.chunk_bytes
        if victim is None:
            return None
        self.stats.evictions += 1
        return evicted[-1]


class Replayer:
    def __init__(self, tiers: Sequence[tuple[str, int]], kv_bytes_per_token: int,
                 block_tokens: int = MOONCAKE_BLOCK_TOKENS, promote_on_hit: bool = True) -> None:
        if not tiers:
            raise ConfigError("--tier", None, "give at least one tier, e.g. --tier host=64GiB")
        self.block_tokens = block_tokens
        self.chunk_bytes = kv_bytes_per_token * block_tokens
        self.tiers = [SimTier(name, capacity, self.chunk_bytes) for name, capacity in tiers]
        self.promote_on_hit = promote_on_hit
        self.total_tokens = 0
        self.requests = 0

    def run(self, requests: Iterable[TraceRequest]) -> dict[str, Any]:
        for request in requests:
            self.serve(request)
        return self.result()

    def serve(self, request: TraceRequest) -> list[int]:
        """Account one request; returns the tier index of each hit block, in order."""
        self.requests += 1
        self.total_tokens += request.input_tokens
        usable = min(len(request.keys), (request.input_tokens - 1) // self.block_tokens)
        found: list[int] = []
        for key in request.keys[:usable]:
            tier = next((i for i, t in enumerate(self.tiers) if key in t), None)
            if tier is None:
                break
            found.append(tier)
            stats = self.tiers[tier].stats
            stats.hit_tokens += self.block_tokens
            stats.bytes_read += self.chunk_bytes
        for tier in self.tiers:  # first, so that storing this prompt never evicts its own head
            tier.table.lru.touch_chain(request.keys)
        top = self.tiers[0]
        for i, key in enumerate(request.keys):
            if key in top or (i < len(found) and not self.promote_on_hit):
                continue
            self._insert(0, key, request.keys[i - 1] if i else None)
        return found

    def _insert(self, level: int, key: bytes, parent: bytes | None) -> None:
        victim = self.tiers[level].insert(key, parent)
        below = level + 1
        if victim is not None and below < len(self.tiers) and victim[0] not in self.tiers[below]:
            self._insert(below, *victim)

    def result(self) -> dict[str, Any]:
        for tier in self.tiers:
            tier.stats.hit_ratio = tier.stats.hit_tokens / max(1, self.total_tokens)
        hits = sum(t.stats.hit_tokens for t in self.tiers)
        return {"requests": self.requests, "prompt_tokens": self.total_tokens,
                "chunk_bytes": self.chunk_bytes, "hit_ratio": hits / max(1, self.total_tokens),
                "tiers": [asdict(t.stats) for t in self.tiers]}


def parse_tier(text: str) -> tuple[str, int]:
    name, sep, size = text.partition("=")
    if not sep or not name:
        raise ConfigError("--tier", text, "use NAME=SIZE, e.g. host=64GiB")
    try:
        return name, parse_size(size)
    except ValueError as exc:
        raise ConfigError("--tier", text, str(exc)) from None


SWEEP_FACTORS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="Mooncake-format JSONL trace")
    parser.add_argument("--tier", action="append", default=[], metavar="NAME=SIZE",
                        help="a tier, top first (repeat): e.g. --tier host=64GiB --tier disk=2TiB")
    parser.add_argument("--kv-bytes-per-token", type=int, default=131072,
                        help="KV bytes one token takes (2 x layers x kv_heads x head_dim x dtype)")
    parser.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS)
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--no-promote", action="store_true", help="lower-tier hits stay put")
    parser.add_argument("--sweep", action="store_true",
                        help="also scale every tier by 1/64 .. 4x and report the hit-ratio curve")
    parser.add_argument("--ttft", action="store_true",
                        help="also estimate TTFT and throughput for no cache, then each tier added")
    parser.add_argument("--hardware", default="h100", help="profile for --ttft: h100, h200, mi300x, rtx4090")
    parser.add_argument("--model", default="llama-3.1-8b",
                        help="for --ttft: a preset (llama-3.1-8b, ...) or a config.json; its KV "
                             "bytes per token replace --kv-bytes-per-token")
    parser.add_argument("--budget", type=int, default=8192, help="scheduler tokens per step (--ttft)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply arrival times (--ttft): >1 spreads a cluster's trace over one GPU")
    parser.add_argument("--json", help="write the results here (a PNG plot goes next to it)")


def run(args: argparse.Namespace) -> int:
    tiers = [parse_tier(t) for t in args.tier]
    if args.ttft:
        from bench.ttft_model import model_spec

        args.kv_bytes_per_token = model_spec(args.model).kv_bytes_per_token
    started = time.perf_counter()
    result = _replay(args, tiers)
    result["seconds"] = time.perf_counter() - started
    _print(result)
    if args.sweep:
        result["sweep"] = [{"factor": f, **_replay(args, [(n, int(c * f)) for n, c in tiers])}
                           for f in SWEEP_FACTORS]
        _print_sweep(result["sweep"])
    if args.ttft:
        result["ttft"] = _ttft_rows(args, tiers)
        _print_ttft(result["ttft"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        if args.sweep:
            from bench.plots import plot_sweep

            print(f"plot: {plot_sweep(result['sweep'], Path(args.json).with_suffix('.png'))}")
    return 0


def _replay(args: argparse.Namespace, tiers: list[tuple[str, int]]) -> dict[str, Any]:
    replayer = Replayer(tiers, args.kv_bytes_per_token, args.block_tokens,
                        promote_on_hit=not args.no_promote)
    return replayer.run(read_trace(args.trace, args.block_tokens, args.limit))


TIER_PATHS = {"gpu": "hbm", "hbm": "hbm", "host": "dram", "dram": "dram", "disk": "disk",
              "nvme": "disk", "ssd": "disk", "nvmeof": "nvmeof", "fabric": "nvmeof"}


def _ttft_rows(args: argparse.Namespace, tiers: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """One row per configuration: no cache, then the tiers added one at a time, top first."""
    from bench.sched_model import SimRequest, simulate
    from bench.ttft_model import PROFILES, model_spec

    if args.hardware not in PROFILES:
        raise ConfigError("--hardware", args.hardware, f"known: {', '.join(PROFILES)}")
    unknown = [name for name, _ in tiers if name not in TIER_PATHS]
    if unknown:
        raise ConfigError("--tier", unknown[0], f"--ttft needs a known tier kind: {', '.join(TIER_PATHS)}")
    model, hardware = model_spec(args.model), PROFILES[args.hardware]
    rows = []
    for count in range(len(tiers) + 1):
        config = tiers[:count]
        replayer = Replayer(config, args.kv_bytes_per_token, args.block_tokens,
                            promote_on_hit=not args.no_promote) if config else None
        requests = []
        for request in read_trace(args.trace, args.block_tokens, args.limit):
            hits: dict[str, int] = {}
            for tier in replayer.serve(request) if replayer else []:
                hits[config[tier][0]] = hits.get(config[tier][0], 0) + args.block_tokens
            requests.append(SimRequest(request.arrival_s * args.time_scale, request.input_tokens,
                                       max(1, request.output_tokens), hits))
        summary = simulate(requests, model, hardware, {n: TIER_PATHS[n] for n, _ in config}, args.budget)
        rows.append({"config": " + ".join(n for n, _ in config) or "no cache", **summary})
    return rows


def _print_ttft(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'configuration':<28} {'TTFT p50':>10} {'TTFT p90':>10} {'output tok/s':>13}")
    for row in rows:
        print(f"{row['config']:<28} {row['ttft_p50_s']:>9.2f}s {row['ttft_p90_s']:>9.2f}s "
              f"{row['throughput_tokens_per_s']:>13.0f}")


def _print(result: dict[str, Any]) -> None:
    print(f"{result['requests']} requests, {result['prompt_tokens']} prompt tokens, chunk "
          f"{format_size(result['chunk_bytes'])}, {result['seconds']:.1f} s")
    print(f"{'tier':<8} {'capacity':>10} {'hit ratio':>10} {'read':>10} {'written':>10} {'evictions':>10}")
    for tier in result["tiers"]:
        print(f"{tier['name']:<8} {format_size(tier['capacity_bytes']):>10} {tier['hit_ratio']:>10.3f} "
              f"{format_size(tier['bytes_read']):>10} {format_size(tier['bytes_written']):>10} "
              f"{tier['evictions']:>10}")
    print(f"{'all':<8} {'':>10} {result['hit_ratio']:>10.3f}")


def _print_sweep(rows: list[dict[str, Any]]) -> None:
    print("\ncapacity scale   " + "  ".join(f"{t['name']:>10}" for t in rows[0]["tiers"]) + "   hit ratio")
    for row in rows:
        sizes = "  ".join(f"{format_size(t['capacity_bytes']):>10}" for t in row["tiers"])
        print(f"{row['factor']:>14.4g}   {sizes}   {row['hit_ratio']:>9.3f}")
