"""`kvstore bench`: write and read throughput, CPU cost and latency per tier and engine,
against in-run yardsticks: the best fio of the sitting (huge-page and malloc buffers,
alternated with the cases), a serial one-read-at-a-time loop, a plain torch copy,
and optionally LMCache's own disk backend on the same load (`--peer lmcache`).

Figures are printed and written to JSON, never asserted: machines are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from bench.commands.storage_cases import (
    CaseResult,
    DiskSet,
    capacity_for,
    delete_set,
    dram_case,
    engine_case,
    get_case,
    hash_cpu_s_per_gib,
    lookup_ms,
    prefetch_case,
    remove_data,
    serial_case,
    service_case,
    write_set,
)
from bench.support.fio import HUGE, MALLOC, Geometry, Yardstick
from bench.support.loopdev import LoopNamespaces, loop_devices_unavailable
from bench.support.vm import drop_page_cache
from kvstore.config.nvmeof import dump_nvmeof, parse_nvmeof
from kvstore.config.store import load_config
from kvstore.devices.nvmeof.plans import namespace_plans
from kvstore.format.errors import ConfigError, KVStoreError
from kvstore.format.record import record_bytes
from kvstore.format.units import format_size, parse_size

CASES = ("get", "bounce", "service", "raw", "prefetch", "serial", "dram")
OLD_NAMES = {"host": "dram"}  # the DRAM tier's and case's old name, still read
PEERS = ("lmcache",)


class Sitting:
    """One run's shared state: the fio yardstick, whether the page cache can be
    dropped between cases, and the notes the table ends with."""

    def __init__(self, yardstick: Yardstick | None, drop_caches: bool) -> None:
        self.yardstick = yardstick
        self.drop_caches = drop_caches
        self.notes: list[str] = []

    def before_case(self) -> None:
        if not self.drop_caches:
            return
        if drop_page_cache():
            note = "page cache: dropped before each case"
            if note not in self.notes:
                self.notes.append(note)
        else:
            self.drop_caches = False
            self.notes.append("page cache: not dropped between cases (needs root)")

    def alternate(self, cases: list[Callable[[], list[CaseResult]]], geometry: Geometry,
                  queue_depth: int, fio: bool = True) -> list[CaseResult]:
        """Run the cases with a fio run before each and after the last, so fio and
        the cases see the same machine over the sitting (cache, thermal, neighbours)."""
        results: list[CaseResult] = []
        for case in cases:
            self._fio(geometry, queue_depth, fio)
            self.before_case()
            for result in case():
                _progress(result)
                results.append(result)
        self._fio(geometry, queue_depth, fio)
        return results

    def _fio(self, geometry: Geometry, queue_depth: int, fio: bool) -> None:
        run = self.yardstick.measure(geometry, queue_depth) if fio and self.yardstick else None
        if run is not None:
            print(f"  fio {run.iomem:7} {format_size(run.block):>9} qd {run.queue_depth:3}: "
                      f"read {run.read_gibps:.2f} GiB/s", file=sys.stderr)


def _progress(r: CaseResult) -> None:
    print(f"  {r.label} {r.engine:21} {format_size(r.chunk_bytes):>7} qd {r.queue_depth:3}: "
          f"read {r.read_gibps:.2f} GiB/s, {r.cpu_s_per_gib_read:.3f} CPU s/GiB", file=sys.stderr)


def nvmeof_cases(sitting: Sitting, tier: dict[str, Any], engines: list[str], chunk_bytes: int,
                 queue_depth: int, batch: int | None, total: int) -> list[CaseResult]:
    """The same load over one namespace and over all of them (striped), in one run;
    fio on the first namespace of the one-namespace set is the yardstick."""
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
        for plan in plans:
            remove_data(str(plan.path))
        data = write_set({"nvmeof": subset}, "nvmeof", f"nvmeof x{used}", engines[0], chunk_bytes,
                         queue_depth, total, case_id=f"x{used}")
        size = min(batch or 4 * queue_depth, data.count)
        cases = [_one(get_case, data, engine, queue_depth, size) for engine in engines]
        for result in sitting.alternate(cases, data.geometry, queue_depth, fio=used == 1):
            result.extra["namespaces"] = used
            results.append(result)
        delete_set(data)
    for result in results:
        single = next(r for r in results if r.engine == result.engine and r.extra["namespaces"] == 1)
        result.extra["vs_one_namespace"] = result.read_gibps / single.read_gibps
    return results


def _one(case: Callable[..., CaseResult], *args: Any) -> Callable[[], list[CaseResult]]:
    return lambda: [case(*args)]


def _sizes(values: list[str]) -> list[int]:
    return [parse_size(v) for item in values for v in item.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", action="append", default=[],
                        help="directory or block device for the disk tier (repeat to stripe); "
                             "default: a temporary directory")
    parser.add_argument("--chunk-size", action="append", default=[],
                        help="chunk payload size(s) of the disk cases, e.g. 4MiB or 4MiB,32MiB "
                             "(default 4MiB)")
    parser.add_argument("--dram-chunk-size", "--host-chunk-size", action="append", default=[],
                        help="chunk size(s) of the DRAM case (default: the --chunk-size ones)")
    parser.add_argument("--queue-depth", action="append", default=[],
                        help="queue depth(s), e.g. 16 or 1,16,64 (default 16)")
    parser.add_argument("--batch", type=int,
                        help="chunks per get_many and per engine batch (default 4 x depth)")
    parser.add_argument("--engine", default="uring,threads", help="I/O engines to compare")
    parser.add_argument("--tiers", default="dram,disk",
                        help="tiers to measure, of dram, disk (and nvmeof with --nvmeof*)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"cases to run, of {','.join(CASES)} (default all)")
    parser.add_argument("--peer", choices=PEERS,
                        help="also run a peer's disk backend on the same load (lmcache: "
                             "the `peer` extra)")
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
    parser.add_argument("--fio-seconds", type=float, default=5.0, help="seconds of each fio run")
    parser.add_argument("--no-drop-caches", action="store_true",
                        help="do not drop the page cache between cases (dropped as root)")


def run(args: argparse.Namespace) -> int:
    chunk_sizes = _sizes(args.chunk_size or ["4MiB"])
    dram_sizes = _sizes(args.dram_chunk_size) or chunk_sizes
    depths = [int(v) for item in (args.queue_depth or ["16"]) for v in item.split(",")]
    engines = args.engine.split(",")
    tiers = [OLD_NAMES.get(tier, tier) for tier in args.tiers.split(",")]
    cases = [OLD_NAMES.get(case, case) for case in args.cases.split(",")]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise KVStoreError(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    total = parse_size(args.total)
    temp = tempfile.TemporaryDirectory(prefix="kvstore-bench-", dir="/var/tmp")
    paths = args.path or [temp.name]
    sitting = Sitting(None if args.no_fio else Yardstick(args.fio_seconds), not args.no_drop_caches)
    print(f"kvstore bench: {format_size(total)} per case on {', '.join(paths)}", file=sys.stderr)
    try:
        results: list[CaseResult] = []
        with _nvmeof_tier(args, temp.name, total, max(chunk_sizes)) as nvmeof:
            for chunk in chunk_sizes:
                if "disk" in tiers:
                    results += _disk_cases(args, sitting, chunk, depths, engines, cases, total, paths,
                                           temp.name)
                if nvmeof is not None:
                    for depth in depths:
                        results += nvmeof_cases(sitting, nvmeof, engines, chunk, depth, args.batch,
                                                total)
        if "dram" in tiers and "dram" in cases:
            for chunk in dram_sizes:
                sitting.before_case()
                results.append(dram_case(chunk, total))
                _progress(results[-1])
        lookup = lookup_ms()
        hashing = {chunk: hash_cpu_s_per_gib(chunk) for chunk in chunk_sizes} if "disk" in tiers else {}
    finally:
        if not (args.keep and args.path):
            temp.cleanup()
    _compare_with_fio(results, sitting.yardstick)
    print_table(results, sitting, lookup, hashing)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"results": [r.row() for r in results],
                       "fio": sitting.yardstick.rows() if sitting.yardstick else [],
                       "notes": _notes(sitting), "lookup_512_keys_ms": lookup, "paths": paths,
                       "hash_cpu_s_per_gib": {str(chunk): v for chunk, v in hashing.items()},
                       "total_bytes": total}, handle, indent=2)
    if args.keep and args.path:
        print(f"records kept in {', '.join(paths)} (check with: kvstore fsck PATH)", file=sys.stderr)
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


def _disk_cases(args: argparse.Namespace, sitting: Sitting, chunk: int, depths: list[int],
                engines: list[str], cases: list[str], total: int, paths: list[str],
                workdir: str) -> list[CaseResult]:
    """One written set per chunk size; at each depth its read cases alternate with fio."""
    disk_cases = [c for c in cases if c != "dram"]
    if not disk_cases and not args.peer:
        return []
    count = max(1, total // chunk)
    tier = {"disk": [{"path": p, "capacity": capacity_for(count, len(paths), chunk)} for p in paths]}
    for path in paths:
        remove_data(path)  # a set of another chunk size may be there (--keep)
    data = write_set(tier, "disk", "disk", engines[0], chunk, max(depths), total)
    results: list[CaseResult] = []
    for i, depth in enumerate(depths):
        batch = min(args.batch or 4 * depth, count)
        readers: list[Callable[[], list[CaseResult]]] = []
        if "get" in cases:
            readers += [_one(get_case, data, engine, depth, batch) for engine in engines]
        if "bounce" in cases:
            readers += [_one(get_case, data, engine, depth, batch, True) for engine in engines]
        if "service" in cases:
            readers += [_one(service_case, data, engine, depth, workdir) for engine in engines]
        if "raw" in cases:
            readers.append(partial(_engine_cases, data, engines, depth, batch))
        if "prefetch" in cases:
            readers += [partial(prefetch_case, data, engine, depth) for engine in engines]
        if args.peer and i == 0:
            readers.append(partial(_peer, sitting, paths, workdir, data, depth, batch))
        results += sitting.alternate(readers, data.geometry, depth)
    if "serial" in cases:
        results.append(serial_case(data, max(8, count // 2)))
        _progress(results[-1])
    if not args.keep:
        delete_set(data)
        for path in paths:
            remove_data(path)
    return results


def _engine_cases(data: DiskSet, engines: list[str], depth: int, batch: int) -> list[CaseResult]:
    return [engine_case(data, engine, depth, batch) for engine in engines]


def _peer(sitting: Sitting, paths: list[str], workdir: str, data: DiskSet, depth: int,
          batch: int) -> list[CaseResult]:
    """The peer on the disk tier's filesystem (its first directory), or a note why not."""
    from bench.commands.peer_lmcache import peer_case

    where = paths[0]
    if stat.S_ISBLK(os.stat(where).st_mode):
        where = workdir
        sitting.notes.append(f"peer lmcache: writes files, so it ran in {workdir}, not on the block "
                             f"device {paths[0]}")
    result = peer_case(where, data.chunk_bytes, data.count, batch, depth)
    if isinstance(result, str):
        sitting.notes.append(f"peer lmcache: no row: {result}")
        return []
    return [result]


def _compare_with_fio(results: list[CaseResult], yardstick: Yardstick | None) -> None:
    """Each result's fraction of the best fio at its tier, block and depth."""
    if yardstick is None:
        return
    for result in results:
        block = record_bytes(result.chunk_bytes)
        best = yardstick.best(result.label, block, result.queue_depth)
        if best is None:
            continue
        for iomem in (HUGE, MALLOC):
            kind = yardstick.best(result.label, block, result.queue_depth, iomem)
            if kind is not None:
                result.extra[f"fio_{iomem}_read_gibps"] = kind.read_gibps
        result.extra.update({"fio_read_gibps": best.read_gibps, "fio_iomem": best.iomem,
                             "fio_cpu_s_per_gib_read": best.cpu_s_per_gib_read,
                             "fraction_of_fio": result.read_gibps / best.read_gibps})


def _notes(sitting: Sitting) -> list[str]:
    notes = list(sitting.notes)
    if sitting.yardstick is not None:
        notes += sitting.yardstick.notes
        notes.append(f"vs best fio: against the fastest of the sitting's fio runs at the same tier, "
                     f"block (one record slot) and depth; fio ran before each case and after the last, "
                     f"{sitting.yardstick.seconds:g} s each, with --iomem={HUGE} (vm.nr_hugepages "
                     f"raised for the run, then restored) and --iomem={MALLOC} in turn")
    return notes


def print_table(results: list[CaseResult], sitting: Sitting, lookup: float,
                hashing: dict[int, dict[str, float]]) -> None:
    header = (f"{'tier':9} {'engine':21} {'chunk':>8} {'qd':>3} {'batch':>5} {'write GiB/s':>11} "
              f"{'read GiB/s':>10} {'cpu s/GiB':>9} {'p50 ms':>7} {'p99 ms':>7} {'vs fio':>7} "
              f"{'vs copy':>7} {'vs 1 ns':>7}")
    print(header)

    def ratio(value: object) -> str:
        return "" if value is None else f"{value:.0%}"

    def num(value: float, width: int, digits: int = 2) -> str:
        return " " * width if value != value else f"{value:>{width}.{digits}f}"  # NaN: blank

    def line(tier: str, engine: str, chunk: int, qd: object, batch: object, write: float,
             read: float, cpu: float, p50: float, p99: float, extra: dict[str, Any]) -> None:
        print(f"{tier:9} {engine:21} {format_size(chunk):>8} {qd!s:>3} {batch!s:>5} {num(write, 11)} "
              f"{num(read, 10)} {num(cpu, 9, 3)} {num(p50, 7)} {num(p99, 7)} "
              f"{ratio(extra.get('fraction_of_fio')):>7} {ratio(extra.get('fraction_of_copy')):>7} "
              f"{ratio(extra.get('vs_one_namespace')):>7}")

    nan = float("nan")
    groups: dict[tuple[str, int, int], list[CaseResult]] = {}
    for r in results:
        groups.setdefault((r.label, r.chunk_bytes, r.queue_depth), []).append(r)
    for (label, chunk, depth), rows in groups.items():
        for r in rows:
            line(r.label, r.engine, r.chunk_bytes, r.queue_depth or "-", r.extra.get("batch", ""),
                 r.write_gibps, r.read_gibps, r.cpu_s_per_gib_read, r.p50_ms, r.p99_ms, r.extra)
        yardstick = sitting.yardstick
        best = yardstick.best(label, record_bytes(chunk), depth) if yardstick else None
        for iomem in (HUGE, MALLOC):
            run = yardstick.best(label, record_bytes(chunk), depth, iomem) if yardstick else None
            if run is not None and best is not None:
                line(label, f"fio {iomem}", chunk, depth, "", nan, run.read_gibps,
                     run.cpu_s_per_gib_read, nan, nan, {"fraction_of_fio": run.read_gibps / best.read_gibps})
        for r in rows:
            if "torch_copy_gibps" in r.extra:
                line(label, "torch copy", chunk, "-", r.extra["batch"], nan, r.extra["torch_copy_gibps"],
                     r.extra["torch_copy_cpu_s_per_gib"], nan, nan, {"fraction_of_copy": 1.0})
    print(f"lookup of 512 keys: {lookup:.3f} ms (median)")
    for chunk, cpu in hashing.items():
        print(f"xxh3-64 of {format_size(chunk)} chunks out of cache: {cpu['hash']:.3f} CPU s/GiB "
              f"(the floor of a verified read's CPU here); hash then copy {cpu['hash_then_copy']:.3f}, "
              f"fused in one pass {cpu['fused']:.3f} (what a staged get does)")
    for note in _notes(sitting):
        print(f"note: {note}")
