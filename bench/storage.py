"""`kvstore bench`: write and read throughput, CPU cost and latency per tier and engine,
with in-run baselines (a serial one-read-at-a-time loop, fio, a plain torch copy).

Figures are printed and written to JSON, never asserted: machines are shared.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench.loopdev import LoopNamespaces, loop_devices_unavailable
from bench.storage_cases import (
    CaseResult,
    add_fio,
    capacity_for,
    disk_case,
    engine_case,
    host_case,
    lookup_ms,
    remove_data,
    serial_case,
)
from kvstore.config import load_config
from kvstore.errors import ConfigError, KVStoreError
from kvstore.nvmeof.config import dump_nvmeof, parse_nvmeof
from kvstore.nvmeof.tier import namespace_plans
from kvstore.units import format_size, parse_size


def nvmeof_cases(tier: dict[str, Any], engines: list[str], chunk_bytes: int, queue_depth: int,
                 total: int, fio_seconds: float | None) -> list[CaseResult]:
    """The same load over one namespace and over all of them (striped), in one run;
    fio on the first namespace (unless `fio_seconds` is None) is the yardstick."""
    namespaces = tier["namespaces"]
    count = max(1, total // chunk_bytes)
    results = []
    for used in sorted({1, len(namespaces)}):
        capacity = capacity_for(count, used, chunk_bytes)
        subset = {**tier, "namespaces": [{**ns, "capacity": capacity} for ns in namespaces[:used]]}
        plans = namespace_plans(parse_nvmeof(subset))
        absent = [plan.label for plan in plans if plan.path is None]
        if absent:
            raise KVStoreError(f"cannot measure namespaces not connected and live: {', '.join(absent)}")
        devices = [str(plan.path) for plan in plans]
        for engine in engines:
            for device in devices:
                remove_data(device)
            result, geometry = disk_case({"nvmeof": subset}, "nvmeof", engine, chunk_bytes,
                                         queue_depth, total, progress=True, case_id=f"x{used}")
            result.extra["namespaces"] = used
            results.append(result)
        if used == 1 and fio_seconds is not None:
            add_fio(results[-len(engines):], geometry, queue_depth, fio_seconds)
    for result in results:
        single = next(r for r in results if r.engine == result.engine and r.extra["namespaces"] == 1)
        result.extra["vs_one_namespace"] = result.read_gibps / single.read_gibps
    return results


def _sizes(values: list[str]) -> list[int]:
    return [parse_size(v) for item in values for v in item.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", action="append", default=[],
                        help="directory or block device for the disk tier (repeat to stripe); "
                             "default: a temporary directory")
    parser.add_argument("--chunk-size", action="append", default=[],
                        help="chunk payload size(s), e.g. 4MiB or 256KiB,4MiB (default 4MiB)")
    parser.add_argument("--queue-depth", action="append", default=[],
                        help="queue depth(s), e.g. 16 or 1,16,64 (default 16)")
    parser.add_argument("--engine", default="uring,threads", help="I/O engines to compare")
    parser.add_argument("--tiers", default="host,disk", help="tiers to measure")
    parser.add_argument("--total", default="1GiB", help="bytes written and read per case")
    parser.add_argument("--json", help="write results to this JSON file")
    parser.add_argument("--keep", action="store_true",
                        help="leave the records in the disk tier (for kvstore fsck)")
    parser.add_argument("--nvmeof", metavar="CONFIG",
                        help="also measure the NVMe-oF namespaces of this config's tiers.nvmeof, "
                             "one and all of them striped")
    parser.add_argument("--nvmeof-loop", type=int, metavar="N",
                        help="also measure N loop devices standing in for NVMe-oF namespaces "
                             "(root; resolved through a generated sysfs tree)")
    parser.add_argument("--no-fio", action="store_true", help="skip the fio comparison")
    parser.add_argument("--fio-seconds", type=float, default=5.0)


def run(args: argparse.Namespace) -> int:
    chunk_sizes = _sizes(args.chunk_size or ["4MiB"])
    depths = [int(v) for item in (args.queue_depth or ["16"]) for v in item.split(",")]
    engines = args.engine.split(",")
    tiers = args.tiers.split(",")
    total = parse_size(args.total)
    temp = tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir="/var/tmp")
    paths = args.path or [temp.name]
    results: list[CaseResult] = []
    print(f"kvstore bench: {format_size(total)} per case on {', '.join(paths)}", file=sys.stderr)
    with _nvmeof_tier(args, temp.name, total, max(chunk_sizes)) as nvmeof:
        results = _run_cases(args, chunk_sizes, depths, engines, tiers, total, paths, nvmeof)
    lookup = lookup_ms()
    print_table(results, lookup)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"results": [r.row() for r in results], "lookup_512_keys_ms": lookup,
                       "paths": paths, "total_bytes": total}, handle, indent=2)
    if args.keep and args.path:
        print(f"records kept in {', '.join(paths)} (check with: kvstore fsck PATH)", file=sys.stderr)
    else:
        temp.cleanup()
    return 0


@contextmanager
def _nvmeof_tier(args: argparse.Namespace, workdir: str, total: int,
                 chunk_bytes: int) -> Iterator[dict[str, Any] | None]:
    """The `tiers.nvmeof` block to measure: from --nvmeof, from loop stand-ins, or None."""
    if args.nvmeof:
        config = load_config(args.nvmeof)
        if config.nvmeof is None:
            raise ConfigError("tiers.nvmeof", None, f"{args.nvmeof} has no nvmeof tier")
        yield dump_nvmeof(config.nvmeof)
    elif args.nvmeof_loop:
        reason = loop_devices_unavailable()
        if reason:
            raise KVStoreError(f"--nvmeof-loop: {reason}")
        size = capacity_for(max(1, total // chunk_bytes), 1, chunk_bytes) + (1 << 20)
        with LoopNamespaces(workdir, args.nvmeof_loop, size) as fake:
            print(f"nvmeof stand-ins: {', '.join(fake.devices)}", file=sys.stderr)
            yield fake.tier_config(capacity=size)
    else:
        yield None


def _run_cases(args: argparse.Namespace, chunk_sizes: list[int], depths: list[int],
               engines: list[str], tiers: list[str], total: int, paths: list[str],
               nvmeof: dict[str, Any] | None) -> list[CaseResult]:
    results: list[CaseResult] = []
    for chunk in chunk_sizes:
        if "host" in tiers:
            results.append(host_case(chunk, total, progress=True))
        if "disk" in tiers:
            results += _disk_cases(args, chunk, depths, engines, total, paths)
        if nvmeof is not None:
            for depth in depths:
                results += nvmeof_cases(nvmeof, engines, chunk, depth, total,
                                        None if args.no_fio else args.fio_seconds)
    return results


def _disk_cases(args: argparse.Namespace, chunk: int, depths: list[int], engines: list[str],
                total: int, paths: list[str]) -> list[CaseResult]:
    """Each engine and depth on the disk paths, then fio and the serial baseline there."""
    results: list[CaseResult] = []
    count = max(1, total // chunk)
    tier = {"disk": [{"path": p, "capacity": capacity_for(count, len(paths), chunk)} for p in paths]}
    geometry: dict[str, object] = {}
    for depth in depths:
        for engine in engines:
            for path in paths:
                remove_data(path)  # every case writes its own records
            result, geometry = disk_case(tier, "disk", engine, chunk, depth, total, progress=True,
                                         keep=args.keep)
            results.append(result)
        results += [engine_case(geometry, engine, chunk, depth, count) for engine in engines]
        if not args.no_fio:
            add_fio(results[-2 * len(engines):], geometry, depth, args.fio_seconds)
    results.append(serial_case(geometry, chunk, max(8, total // chunk // 2)))
    if not args.keep:
        for path in paths:
            remove_data(path)
    return results


def print_table(results: list[CaseResult], lookup: float) -> None:
    header = (f"{'tier':9} {'engine':8} {'chunk':>8} {'qd':>3} {'write GiB/s':>11} "
              f"{'read GiB/s':>10} {'cpu s/GiB':>9} {'p50 ms':>7} {'p99 ms':>7} {'vs fio':>7} "
              f"{'vs copy':>7} {'vs 1 ns':>7}")
    print(header)

    def ratio(value: object) -> str:
        return "" if value is None else f"{value:.0%}"

    for r in results:
        tier = f"{r.tier} x{r.extra['namespaces']}" if "namespaces" in r.extra else r.tier
        print(f"{tier:9} {r.engine:8} {format_size(r.chunk_bytes):>8} {r.queue_depth:>3} "
              f"{r.write_gibps:>11.2f} {r.read_gibps:>10.2f} {r.cpu_s_per_gib_read:>9.3f} "
              f"{r.p50_ms:>7.2f} {r.p99_ms:>7.2f} {ratio(r.extra.get('fraction_of_fio')):>7} "
              f"{ratio(r.extra.get('fraction_of_copy')):>7} {ratio(r.extra.get('vs_one_namespace')):>7}")
    print(f"lookup of 512 keys: {lookup:.3f} ms (median)")
