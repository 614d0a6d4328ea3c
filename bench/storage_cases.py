"""The cases `kvstore bench` measures: a tier's write and read, the I/O engine alone,
a serial read, a DRAM get, a lookup; and fio next to them. Figures, never assertions."""

from __future__ import annotations

import os
import random
import stat
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from bench.fio import fio_randread
from kvstore.aligned import AlignedBuffer
from kvstore.disk_layout import SB_COPIES
from kvstore.io import make_engine
from kvstore.io.base import IoRequest
from kvstore.keys import KVNamespace, chunk_keys
from kvstore.record import BLOCK
from kvstore.store import TieredStore
from kvstore.units import format_size


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


def capacity_for(count: int, devices: int, chunk_bytes: int) -> int:
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
        layout = store.disk.devices.layouts[0] if store.disk else None
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


def engine_case(geometry: dict[str, object], engine_name: str, chunk_bytes: int, queue_depth: int,
                count: int) -> CaseResult:
    """The I/O engine alone over the same slots (random order, batches of 2 x depth into
    aligned buffers, no verification, no copy): what the engine costs next to fio."""
    path, offset, block = str(geometry["file"]), int(geometry["offset"]), int(geometry["block"])
    slots = random.Random(2).sample(range(int(geometry["size"]) // block),
                                    min(count, int(geometry["size"]) // block))
    batch = 2 * queue_depth
    buffer = AlignedBuffer(batch * block)
    views = [buffer.view[i * block : (i + 1) * block] for i in range(batch)]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    engine = make_engine(engine_name, queue_depth)
    try:
        with _clock() as read:
            for start in range(0, len(slots), batch):
                picked = slots[start : start + batch]
                engine.run([IoRequest(fd, offset + slot * block, [views[i]])
                            for i, slot in enumerate(picked)], timeout_s=60)
    finally:
        engine.close()
        os.close(fd)
        views.clear()
        buffer.close()
    gib = len(slots) * block / 2**30
    return CaseResult("disk", f"{engine_name}-raw", chunk_bytes, queue_depth, gib / read["wall"],
                      cpu_s_per_gib_read=read["cpu"] / gib)


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


def remove_data(path: str) -> None:
    """Start the next case empty: remove a directory's data file, or zero a block
    device's superblocks (its record headers are already zeroed by the case's delete)."""
    data = os.path.join(path, "kvstore.data")
    if os.path.isfile(data):
        os.unlink(data)
    elif os.path.exists(path) and stat.S_ISBLK(os.stat(path).st_mode):
        size = SB_COPIES * BLOCK  # every superblock copy
        zeros = AlignedBuffer(size)
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        try:
            os.pwritev(fd, [zeros.view[:size]], 0)
        finally:
            os.close(fd)
            zeros.close()


def add_fio(results: list[CaseResult], geometry: dict[str, object], queue_depth: int,
             seconds: float) -> None:
    """fio randread over the slots the cases just used; each result gets its fraction."""
    fio = fio_randread(str(geometry["file"]), int(geometry["offset"]), int(geometry["size"]),
                       int(geometry["block"]), queue_depth, seconds)
    for result in results:
        if fio:
            result.extra.update({"fio_read_gibps": fio["read_gibps"],
                                 "fio_cpu_s_per_gib_read": fio["cpu_s_per_gib_read"],
                                 "fraction_of_fio": result.read_gibps / fio["read_gibps"]})
