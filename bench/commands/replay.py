"""`kvstore replay`'s command line: parse a replay's tiers and policies, run one replay, a
sweep of DRAM sizes, a cluster of hosts (bench/sim/cluster_replay.py) or requests that end
(bench/sim/next_turn_replay.py), and print or write the result. The replay itself is
bench/sim/replay.py, which the cluster and next-turn replayers build on."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.sim.admission_path import ThresholdPath
from bench.sim.replay import MEMORY_TIERS, AnswerRule, Clairvoyant, Replayer, parse_tier
from bench.support.trace import MOONCAKE_BLOCK_TOKENS, read_passes, read_trace
from kvstore.format.errors import ConfigError
from kvstore.format.units import format_size, parse_write_budget
from kvstore.tiers.admission import ADMISSIONS, THRESHOLD, Tuning
from kvstore.tiers.loss_budget import LOSS
from kvstore.tiers.policy import DEFAULT_ADMISSION, EVICTIONS, TierPolicy

SWEEP_FACTORS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4)
TRACE_RULES = ("oracle", "answer-rule")  # admissions that read the trace (bench/sim/replay.py), not kvstore's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="Mooncake-format JSONL trace")
    parser.add_argument("--tier", action="append", default=[], metavar="NAME=SIZE",
                        help="a tier, top first (repeat): e.g. --tier dram=64GiB --tier disk=2TiB "
                             "(`host` is dram's old name, still read as dram); "
                             "a tier below the top not named gpu, hbm or dram is a disk "
                             "(disk admission applies to it and its writes are counted)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=131072,
                        help="KV bytes one token takes (2 x layers x kv_heads x head_dim x dtype); a "
                             "hybrid model: its full-attention groups' bytes plus each sliding-window "
                             "group's x the share of chunks it stores (the worker logs B/token per "
                             "group; docs/vllm.md)")
    parser.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS)
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--no-promote", action="store_true", help="lower-tier hits stay put")
    parser.add_argument("--admission", choices=(*ADMISSIONS, *TRACE_RULES),
                        help="disk admission policy (kvstore/tiers/admission.py; config `disk_admission`; "
                             f"{DEFAULT_ADMISSION}, or learned with --write-budget), or `oracle`: only "
                             "chunks a later request will read (the bound), or `answer-rule`: none of a "
                             "request whose answer ran to --answer-tokens (a threshold picked in hindsight)")
    parser.add_argument("--answer-tokens", type=int, default=128,
                        help="with --admission answer-rule: the answer length (tokens) from which a "
                             "request's chunks are refused")
    parser.add_argument("--answer-first-only", action="store_true",
                        help="with --admission answer-rule: refuse only chunks no earlier request held")
    parser.add_argument("--admission-loss", type=float, default=LOSS,
                        help="with --admission learned: the share of hits it may give up, which its "
                             "threshold is tuned to (config `disk_admission_loss`; 0: the threshold is "
                             "--admission-threshold alone)")
    parser.add_argument("--admission-threshold", type=float, default=THRESHOLD,
                        help="with --admission learned: the least return rate a chunk's bucket needs, "
                             "whatever the loss budget allows (config `disk_admission_threshold`)")
    parser.add_argument("--request-ends", choices=("reported", "inferred"), default="reported",
                        help="with --admission learned: how requests end is `reported` (output tokens, "
                             "turn, idle time, as the vLLM connector reports them) or `inferred` (none "
                             "reported, as from SGLang's and LMCache's backends: the service works turn and "
                             "idle time out of the puts)")
    parser.add_argument("--write-budget", metavar="SIZE|N dwpd",
                        help="the most bytes written to the disk tiers in any 24 hours of the trace: a "
                             "size, or drive writes per day of their capacity (config `disk_write_budget`)")
    parser.add_argument("--passes", type=int, default=1,
                        help="replay the trace this many times back to back and report the last: the "
                             "earlier passes (other traffic of the same kind: the requests again with their "
                             "blocks renamed, or a synthetic shape's next seeds) fill the tiers and teach "
                             "`learned` admission, as a service that ran before")
    parser.add_argument("--no-bound", action="store_true",
                        help="with a disk tier and an admission other than all or oracle, do not also "
                             "replay `all` and `oracle` to report this one against them")
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
                             "private islands; other tiers are per host (bench/sim/cluster_replay.py)")
    parser.add_argument("--routing", choices=("random", "prefix"), default="prefix",
                        help="with --hosts: uniform, or by a hash of the first block (a KV-aware router)")
    parser.add_argument("--seed", type=int, default=0, help="with --hosts: the random routing's seed")
    parser.add_argument("--next-turn", choices=("off", "warm", "predict", "oracle"),
                        help="also model what happens when a request ends "
                             "(bench/sim/next_turn_replay.py) and report dram_resident_at_arrival "
                             "and prefetch_wasted_bytes; `oracle` knows when each chunk arrives next "
                             "(the bound for `predict`)")
    parser.add_argument("--tpot-ms", type=float, default=20.0,
                        help="a request ends output tokens x this after it arrives (when --next-turn acts "
                             "and `learned` admission hears how it ended)")
    parser.add_argument("--json", help="write the results here (a PNG plot goes next to it)")


def run(args: argparse.Namespace) -> int:
    tiers = [parse_tier(t) for t in args.tier]
    args.admission = args.admission or ("learned" if args.write_budget else DEFAULT_ADMISSION)
    if args.admission in TRACE_RULES and (args.ttft or args.hosts is not None):
        raise ConfigError("--admission", args.admission, "a rule that reads the trace is replayed alone: "
                                                          "not with --ttft or --hosts")
    if args.passes != 1 and (args.ttft or args.hosts is not None):
        raise ConfigError("--passes", args.passes, "passes are replayed alone: not with --ttft or --hosts")
    if args.hosts is not None:
        from bench.sim.cluster_replay import run as run_cluster

        return run_cluster(args, tiers)
    if args.ttft:
        from bench.sim.ttft_model import model_spec

        args.kv_bytes_per_token = model_spec(args.model).kv_bytes_per_token
    started = time.perf_counter()
    result = _replay(args, tiers, path=True)
    result["seconds"] = time.perf_counter() - started
    if not args.no_bound and args.admission not in ("all", "oracle") and result["disk_bytes_written"] + \
            result["admission_refused"]:
        result["bound"] = _bound(args, tiers, result)
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
        _plot(args, result)
    return 0


def _plot(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The PNGs beside the JSON: the sweep's (its name's), `learned`'s threshold path (-threshold)."""
    from bench.commands.plots import PlotUnavailable, plot_sweep, plot_threshold

    out = Path(args.json)
    try:
        if args.sweep:
            print(f"plot: {plot_sweep(result['sweep'], out.with_suffix('.png'))}")
        if "threshold_path" in result:
            title = f"{Path(args.trace).name}: learned admission, {args.passes} pass(es)"
            png = out.with_name(out.stem + "-threshold.png")
            print(f"plot: {plot_threshold(result['threshold_path'], title, png)}")
    except PlotUnavailable as exc:
        print(exc)


def _replay(args: argparse.Namespace, tiers: list[tuple[str, int]], admission: str | None = None,
            budget: bool = True, path: bool = False) -> dict[str, Any]:
    """One replay; `admission` in place of --admission, and without the budget if not `budget`;
    with `path`, `learned`'s threshold over it (bench/sim/admission_path.py)."""
    admission = admission or args.admission
    policy = _policy(args, admission)
    runs = read_passes(args.trace, args.block_tokens, args.limit, getattr(args, "passes", 1))
    requests = [request for run in runs for request in run]
    replayer = Replayer(tiers, args.kv_bytes_per_token, args.block_tokens, policy=policy,
                        tpot_s=args.tpot_ms / 1000)
    if path and admission == "learned":
        ThresholdPath(replayer)
    replayer.ends.reported = args.request_ends == "reported"
    if getattr(args, "next_turn", None):
        from bench.sim.next_turn_replay import NextTurnReads

        reads = NextTurnReads(replayer, args.next_turn)
        if args.next_turn == "oracle":
            reads.foresee(requests)
    if args.write_budget and budget:
        disks = sum(t.stats.capacity_bytes for i, t in enumerate(replayer.tiers) if i in replayer.disks)
        try:
            per_day = parse_write_budget(args.write_budget, disks)
        except ValueError as exc:
            raise ConfigError("--write-budget", args.write_budget, str(exc)) from None
        policy.set_budget(per_day, replayer.chunk_bytes)
    if admission == "oracle":
        policy.use_admission(Clairvoyant(requests, args.block_tokens, lambda: replayer.requests - 1))
    elif admission == "answer-rule":
        policy.use_admission(AnswerRule(requests, args.answer_tokens, lambda: replayer.requests - 1,
                                        args.answer_first_only))
    for run in runs[:-1]:
        replayer.run(run)
    if len(runs) > 1:
        replayer.reset_stats()
    return replayer.run(runs[-1])


def _policy(args: argparse.Namespace, admission: str) -> TierPolicy:
    try:
        tuning = Tuning(args.admission_threshold, args.admission_loss)
    except ValueError as exc:
        raise ConfigError("--admission-loss", args.admission_loss, str(exc)) from None
    return TierPolicy(promote_on_hit=not args.no_promote,
                      admission="all" if admission in TRACE_RULES else admission,
                      tuning=tuning, eviction=args.eviction, chunk_tokens=args.block_tokens)


def _bound(args: argparse.Namespace, tiers: list[tuple[str, int]], result: dict[str, Any]) -> dict[str, Any]:
    """This replay against `all` (what loses nothing) and `oracle` (what writes only what will
    be read) on the same tiers: the share of the oracle's saving of disk writes it gets, the
    hit ratio it loses, and what the disk tiers gain under `all` (their hit ratio: what any
    admission could lose at most, give or take DRAM's share)."""
    everything = _replay(args, tiers, "all", budget=False)
    oracle = _replay(args, tiers, "oracle", budget=False)
    written = everything["disk_bytes_written"]
    saving = 1 - result["disk_bytes_written"] / written if written else 0.0
    oracle_saving = 1 - oracle["disk_bytes_written"] / written if written else 0.0
    return {"all_disk_bytes_written": written, "oracle_disk_bytes_written": oracle["disk_bytes_written"],
            "of_all_written": 1 - saving, "oracle_of_all_written": 1 - oracle_saving,
            "of_oracle_saving": saving / oracle_saving if oracle_saving else None,
            "hit_ratio_lost": everything["hit_ratio"] - result["hit_ratio"],
            "oracle_hit_ratio_lost": everything["hit_ratio"] - oracle["hit_ratio"],
            "all_disk_hit_ratio": sum(t["hit_ratio"] for i, t in enumerate(everything["tiers"])
                                      if i and t["name"] not in MEMORY_TIERS)}


TIER_PATHS = {"gpu": "hbm", "hbm": "hbm", "dram": "dram", "disk": "disk",
              "nvme": "disk", "ssd": "disk", "nvmeof": "nvmeof", "fabric": "nvmeof"}


def _ttft_rows(args: argparse.Namespace, tiers: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """One row per configuration: no cache, then the tiers added one at a time, top first."""
    from bench.sim.sched_model import SimRequest, simulate
    from bench.sim.ttft_model import PROFILES, model_spec

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
                            policy=_policy(args, args.admission)) if config else None
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
    budget = result["admission_info"].get("budget_bytes_per_day")
    if budget is not None:
        print(f"write budget {format_size(budget)} a day: at most "
              f"{format_size(result['disk_bytes_written_max_day'])} written in any 24 h of the trace's "
              f"{result['trace_seconds'] / 3600:.2f} h; "
              f"{result['budget_refused']} chunks refused for it")
    bound = result.get("bound")
    if bound is not None:
        share = bound["of_oracle_saving"]
        print(f"against the bound: disk writes {bound['of_all_written']:.3f} of all's "
              f"({format_size(bound['all_disk_bytes_written'])}), the oracle's "
              f"{bound['oracle_of_all_written']:.3f}: "
              f"{'-' if share is None else f'{share:.2f}'} of the oracle's saving, hit ratio lost "
              f"{bound['hit_ratio_lost']:.4f} (oracle {bound['oracle_hit_ratio_lost']:.4f}; all's disk "
              f"hits {bound['all_disk_hit_ratio']:.3f})")
    if "next_turn" in result:
        print(f"next turn {result['next_turn']}: {result['dram_resident_at_arrival']:.3f} of found chunks in "
              f"DRAM at arrival; read ahead {format_size(result['prefetch_read_bytes'])}, wasted "
              f"{format_size(result['prefetch_wasted_bytes'])} ({result['prefetch_wasted_fraction']:.0%})")


def _print_sweep(rows: list[dict[str, Any]]) -> None:
    print("\ncapacity scale   " + "  ".join(f"{t['name']:>10}" for t in rows[0]["tiers"]) + "   hit ratio")
    for row in rows:
        sizes = "  ".join(f"{format_size(t['capacity_bytes']):>10}" for t in row["tiers"])
        print(f"{row['factor']:>14.4g}   {sizes}   {row['hit_ratio']:>9.3f}")
