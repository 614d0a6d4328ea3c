"""`kvstore bench`: write and read throughput, CPU cost and latency per tier and engine,
with in-run baselines (a serial one-read-at-a-time loop, fio, a plain torch copy).

Figures are printed and written to JSON, never asserted: machines are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from bench.fio import fio_randread
from bench.loopdev import LoopNamespaces, loop_devices_unavailable
from kvstore.aligned import AlignedBuffer
from kvstore.config import load_config
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import KVNamespace, chunk_keys
from kvstore.nvmeof.config import dump_nvmeof, parse_nvmeof
from kvstore.nvmeof.tier import namespace_plans
from kvstore.store import TieredStore
from kvstore.units import format_size, parse_size


@dataclass
class CaseResult:
    tier: str
    engine: str
    chunk_bytes: int
    queue_depth: int
    read_gibps: float
    write_gibps: float = float("nan")
    cpu_s_per_gib_read: float = float("nan")
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    extra: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict[str, object]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


@contextmanager
def _clock() -> Iterator[dict[str, float]]:
    timing: dict[str, float] = {}
    wall, cpu = time.perf_counter(), time.process_time()
    yield timing
    timing["wall"] = time.perf_counter() - wall
    timing["cpu"] = time.process_time() - cpu


def _keys(count: int, case: str = "", chunk_tokens: int = 16) -> list[bytes]:
    """Keys of one case; another case's keys differ, so records a block device kept
    from an earlier case are never mistaken for this case's."""
    namespace = KVNamespace(f"bench{case}", "uint8", "flat", chunk_tokens)
    return chunk_keys(np.arange(count * chunk_tokens) % 50000, namespace)


def _payloads(count: int, chunk_bytes: int) -> list[torch.Tensor]:
    """A few distinct random buffers reused round-robin (content is not the point)."""
    distinct = [torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8) for _ in range(4)]
    return [distinct[i % 4] for i in range(count)]


def _capacity(count: int, devices: int, chunk_bytes: int) -> int:
    """Bytes per device for `count` chunks striped over `devices`, with headroom."""
    return (count // devices + 2) * (chunk_bytes + 8192) + (1 << 20)


def disk_case(tiers: dict[str, object], tier_name: str, engine: str, chunk_bytes: int,
              queue_depth: int, total: int, progress: bool, keep: bool = False,
              case_id: str = "") -> tuple[CaseResult, dict[str, object]]:
    """Write then randomly read `total` bytes through a store with only `tiers` (a disk
    or nvmeof block); the records are deleted afterwards unless `keep`."""
    count = max(1, total // chunk_bytes)
    config = {"tiers": tiers, "io": {"engine": engine, "queue_depth": queue_depth}}
    keys = _keys(count, f"-{tier_name}{case_id}-{engine}-{chunk_bytes}-{queue_depth}")
    payloads = _payloads(count, chunk_bytes)
    outs = [AlignedBuffer(chunk_bytes).view[:chunk_bytes] for _ in range(2 * queue_depth)]
    batch = 2 * queue_depth
    store = TieredStore(config, chunk_bytes)
    try:
        with _clock() as wrote:
            for start in range(0, count, batch):
                store.put_many(keys[start : start + batch], payloads[start : start + batch])
        order = random.Random(0).sample(range(count), count)
        store.stats.reset_latency()
        served = 0
        with _clock() as read:
            for start in range(0, count, batch):
                picked = [keys[i] for i in order[start : start + batch]]
                served += sum(store.get_many(picked, outs[: len(picked)]))
        if served != count:
            raise RuntimeError(f"bench: only {served} of {count} chunks read back")
        p50, p99 = store.stats.latency_ms("disk.read")
        layout = store.disk.layouts[0] if store.disk else None
        geometry = {"file": layout.device.path, "offset": layout.sb.data_offset,
                    "size": layout.sb.num_slots * store.slot_bytes,
                    "block": store.slot_bytes} if layout else {}
        if not keep:
            store.delete(keys)  # a block device keeps no file to remove: zero the headers
    finally:
        store.close()
    gib = count * chunk_bytes / 2**30
    if progress:
        print(f"  {tier_name} {engine:8} chunk {format_size(chunk_bytes):>7} qd {queue_depth:3}: "
              f"read {gib / read['wall']:.2f} GiB/s", file=sys.stderr)
    result = CaseResult(tier_name, engine, chunk_bytes, queue_depth, gib / read["wall"],
                        gib / wrote["wall"], read["cpu"] / gib, p50, p99)
    return result, geometry  # the slots' bytes stay for fio and the serial baseline


def nvmeof_cases(tier: dict[str, Any], engines: list[str], chunk_bytes: int, queue_depth: int,
                 total: int, fio_seconds: float | None) -> list[CaseResult]:
    """The same load over one namespace and over all of them (striped), in one run;
    fio on the first namespace (unless `fio_seconds` is None) is the yardstick."""
    namespaces = tier["namespaces"]
    count = max(1, total // chunk_bytes)
    results = []
    for used in sorted({1, len(namespaces)}):
        capacity = _capacity(count, used, chunk_bytes)
        subset = {**tier, "namespaces": [{**ns, "capacity": capacity} for ns in namespaces[:used]]}
        devices = [plan.path for plan in namespace_plans(parse_nvmeof(subset))]
        for engine in engines:
            for device in devices:
                _remove_data(device)
            result, geometry = disk_case({"nvmeof": subset}, "nvmeof", engine, chunk_bytes,
                                         queue_depth, total, progress=True, case_id=f"x{used}")
            result.extra["namespaces"] = used
            results.append(result)
        if used == 1 and fio_seconds is not None:
            _add_fio(results[-len(engines):], geometry, queue_depth, fio_seconds)
    for result in results:
        single = next(r for r in results if r.engine == result.engine and r.extra["namespaces"] == 1)
        result.extra["vs_one_namespace"] = result.read_gibps / single.read_gibps
    return results


def serial_case(geometry: dict[str, object], chunk_bytes: int, count: int) -> CaseResult:
    """One O_DIRECT pread at a time over the same slots: the no-parallelism baseline."""
    path, offset, block = str(geometry["file"]), int(geometry["offset"]), int(geometry["block"])
    slots = int(geometry["size"]) // block
    buffer = AlignedBuffer(block)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    latencies = []
    try:
        with _clock() as read:
            for slot in random.Random(1).sample(range(slots), min(count, slots)):
                started = time.perf_counter()
                os.preadv(fd, [buffer.view[:block]], offset + slot * block)
                latencies.append(time.perf_counter() - started)
    finally:
        os.close(fd)
        buffer.close()
    latencies.sort()
    gib = len(latencies) * block / 2**30
    return CaseResult("disk", "serial", chunk_bytes, 1, gib / read["wall"],
                      cpu_s_per_gib_read=read["cpu"] / gib,
                      p50_ms=1000 * latencies[len(latencies) // 2],
                      p99_ms=1000 * latencies[int(0.99 * (len(latencies) - 1))])


def host_case(chunk_bytes: int, total: int, progress: bool) -> CaseResult:
    """DRAM-tier get against a plain torch copy of the same bytes."""
    count = max(1, total // chunk_bytes)
    store = TieredStore({"tiers": {"host": {"capacity": (count + 1) * (chunk_bytes + 8192)}}},
                        chunk_bytes)
    keys, payloads = _keys(count), _payloads(count, chunk_bytes)
    outs = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(count)]
    try:
        with _clock() as wrote:
            store.put_many(keys, payloads)
        store.get_many(keys, outs)  # warm the destination pages
        with _clock() as read:
            served = sum(store.get_many(keys, outs))
        if served != count:
            raise RuntimeError(f"bench: only {served} of {count} host chunks read back")
        p50, p99 = store.stats.latency_ms("host.read")
        sources = [torch.empty(chunk_bytes, dtype=torch.uint8).copy_(p) for p in payloads]
        with _clock() as copied:
            for source, out in zip(sources, outs, strict=True):
                out.copy_(source)
    finally:
        store.close()
    gib = count * chunk_bytes / 2**30
    copy_gibps = gib / copied["wall"]
    if progress:
        print(f"  host chunk {format_size(chunk_bytes):>7}: get {gib / read['wall']:.2f} GiB/s, "
              f"torch copy {copy_gibps:.2f} GiB/s", file=sys.stderr)
    return CaseResult("host", "memcpy", chunk_bytes, 0, gib / read["wall"], gib / wrote["wall"],
                      read["cpu"] / gib, p50, p99,
                      {"torch_copy_gibps": copy_gibps,
                       "fraction_of_copy": gib / read["wall"] / copy_gibps})


def lookup_ms(keys_per_lookup: int = 512, repeats: int = 200) -> float:
    """Median time of `lookup` over a prompt of `keys_per_lookup` chunks, all present."""
    chunk_bytes = 4096
    store = TieredStore({"tiers": {"host": {"capacity": (keys_per_lookup + 1) * 3 * chunk_bytes}}},
                        chunk_bytes)
    keys = _keys(keys_per_lookup)
    store.put_many(keys, _payloads(keys_per_lookup, chunk_bytes))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        assert store.lookup(keys).count == keys_per_lookup
        times.append(time.perf_counter() - started)
    store.close()
    return 1000 * sorted(times)[repeats // 2]


def _remove_data(path: str) -> None:
    """Start the next case empty: remove a directory's data file, or zero a block
    device's superblock (its record headers are already zeroed by the case's delete)."""
    data = os.path.join(path, "kvstore.data")
    if os.path.isfile(data):
        os.unlink(data)
    elif os.path.exists(path) and stat.S_ISBLK(os.stat(path).st_mode):
        zeros = AlignedBuffer(4096)
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        try:
            os.pwritev(fd, [zeros.view[:4096]], 0)
        finally:
            os.close(fd)
            zeros.close()


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
        size = _capacity(max(1, total // chunk_bytes), 1, chunk_bytes) + (1 << 20)
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


def _add_fio(results: list[CaseResult], geometry: dict[str, object], queue_depth: int,
             seconds: float) -> None:
    """fio randread over the slots the cases just used; each result gets its fraction."""
    fio = fio_randread(str(geometry["file"]), int(geometry["offset"]), int(geometry["size"]),
                       int(geometry["block"]), queue_depth, seconds)
    for result in results:
        if fio:
            result.extra.update({"fio_read_gibps": fio["read_gibps"],
                                 "fio_cpu_s_per_gib_read": fio["cpu_s_per_gib_read"],
                                 "fraction_of_fio": result.read_gibps / fio["read_gibps"]})


def _disk_cases(args: argparse.Namespace, chunk: int, depths: list[int], engines: list[str],
                total: int, paths: list[str]) -> list[CaseResult]:
    """Each engine and depth on the disk paths, then fio and the serial baseline there."""
    results: list[CaseResult] = []
    count = max(1, total // chunk)
    tier = {"disk": [{"path": p, "capacity": _capacity(count, len(paths), chunk)} for p in paths]}
    geometry: dict[str, object] = {}
    for depth in depths:
        for engine in engines:
            for path in paths:
                _remove_data(path)  # every case writes its own records
            result, geometry = disk_case(tier, "disk", engine, chunk, depth, total, progress=True,
                                         keep=args.keep)
            results.append(result)
        if not args.no_fio:
            _add_fio(results[-len(engines):], geometry, depth, args.fio_seconds)
    results.append(serial_case(geometry, chunk, max(8, total // chunk // 2)))
    if not args.keep:
        for path in paths:
            _remove_data(path)
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
