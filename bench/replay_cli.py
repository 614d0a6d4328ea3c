"""`kvstore replay`'s command line: parse a replay's tiers and policies, run one replay, a
sweep of DRAM sizes, a cluster of hosts (bench/cluster_replay.py) or requests that end
(bench/next_turn_replay.py), and print or write the result. The replay itself is
bench/replay.py, which the cluster and next-turn replayers build on."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.replay import Replayer, parse_tier
from bench.trace import MOONCAKE_BLOCK_TOKENS, read_trace
from kvstore.format.errors import ConfigError
from kvstore.format.units import format_size
from kvstore.tiers.admission import ADMISSIONS
from kvstore.tiers.policy import DEFAULT_ADMISSION, EVICTIONS, TierPolicy

SWEEP_FACTORS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="Mooncake-format JSONL trace")
    parser.add_argument("--tier", action="append", default=[], metavar="NAME=SIZE",
                        help="a tier, top first (repeat): e.g. --tier host=64GiB --tier disk=2TiB; "
                             "a tier below the top not named gpu, hbm, host or dram is a disk "
                             "(disk admission applies to it and its writes are counted)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=131072,
                        help="KV bytes one token takes (2 x layers x kv_heads x head_dim x dtype); a "
                             "hybrid model: its full-attention groups' bytes plus each sliding-window "
                             "group's x the share of chunks it stores (the worker logs B/token per "
                             "group; docs/vllm.md)")
    parser.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS)
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--no-promote", action="store_true", help="lower-tier hits stay put")
    parser.add_argument("--admission", choices=tuple(ADMISSIONS), default=DEFAULT_ADMISSION,
                        help="disk admission policy (kvstore/tiers/admission.py; config `disk_admission`)")
    parser.add_argument("--eviction", choices=EVICTIONS, default="lru",
                        help="eviction of every tier: lru, or cost (recompute cost on a recency clock); "
                             "config `eviction`")
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
    parser.add_argument("--hosts", type=int,
                        help="N hosts sharing one array (the last --tier, split N ways) against N "
                             "private islands; other tiers are per host (bench/cluster_replay.py)")
    parser.add_argument("--routing", choices=("random", "prefix"), default="prefix",
                        help="with --hosts: uniform, or by a hash of the first block (a KV-aware router)")
    parser.add_argument("--seed", type=int, default=0, help="with --hosts: the random routing's seed")
    parser.add_argument("--next-turn", choices=("off", "warm", "predict", "oracle"),
                        help="also model what happens when a request ends (bench/next_turn_replay.py) "
                             "and report dram_resident_at_arrival and prefetch_wasted_bytes; `oracle` "
                             "knows when each chunk arrives next (the bound for `predict`)")
    parser.add_argument("--tpot-ms", type=float, default=20.0,
                        help="with --next-turn: a request ends output tokens x this after it arrives")
    parser.add_argument("--json", help="write the results here (a PNG plot goes next to it)")


def run(args: argparse.Namespace) -> int:
    tiers = [parse_tier(t) for t in args.tier]
    if args.hosts is not None:
        from bench.cluster_replay import run as run_cluster

        return run_cluster(args, tiers)
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
            from bench.plots import PlotUnavailable, plot_sweep

            try:
                print(f"plot: {plot_sweep(result['sweep'], Path(args.json).with_suffix('.png'))}")
            except PlotUnavailable as exc:
                print(exc)
    return 0


def _replay(args: argparse.Namespace, tiers: list[tuple[str, int]]) -> dict[str, Any]:
    replayer: Replayer
    if getattr(args, "next_turn", None):
        from bench.next_turn_replay import NextTurnReplayer

        replayer = NextTurnReplayer(tiers, args.kv_bytes_per_token, args.block_tokens, args.next_turn,
                                    tpot_s=args.tpot_ms / 1000, policy=_policy(args))
        if args.next_turn == "oracle":
            replayer.foresee(read_trace(args.trace, args.block_tokens, args.limit))
    else:
        replayer = Replayer(tiers, args.kv_bytes_per_token, args.block_tokens, policy=_policy(args))
    return replayer.run(read_trace(args.trace, args.block_tokens, args.limit))


def _policy(args: argparse.Namespace) -> TierPolicy:
    return TierPolicy(promote_on_hit=not args.no_promote, admission=args.admission,
                      eviction=args.eviction, chunk_tokens=args.block_tokens)


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
                            policy=_policy(args)) if config else None
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
    per_read = result["disk_bytes_written_per_byte_read"]
    print(f"admission {result['admission']}, eviction {result['eviction']}: disk "
          f"{format_size(result['disk_bytes_written'])} written ("
          f"{format_size(result['disk_bytes_written_never_read'])} never read), "
          f"{format_size(result['disk_bytes_read'])} read ({'-' if per_read is None else f'{per_read:.2f}'} "
          f"written per byte read), "
          f"{result['admission_refused']} chunks refused; recompute cost "
          f"{result['recompute_cost'] / max(1e-9, result['recompute_cost_no_cache']):.3f} of no cache")
    if "next_turn" in result:
        print(f"next turn {result['next_turn']}: {result['dram_resident_at_arrival']:.3f} of found chunks in "
              f"DRAM at arrival; read ahead {format_size(result['prefetch_read_bytes'])}, wasted "
              f"{format_size(result['prefetch_wasted_bytes'])} ({result['prefetch_wasted_fraction']:.0%})")


def _print_sweep(rows: list[dict[str, Any]]) -> None:
    print("\ncapacity scale   " + "  ".join(f"{t['name']:>10}" for t in rows[0]["tiers"]) + "   hit ratio")
    for row in rows:
        sizes = "  ".join(f"{format_size(t['capacity_bytes']):>10}" for t in row["tiers"])
        print(f"{row['factor']:>14.4g}   {sizes}   {row['hit_ratio']:>9.3f}")
