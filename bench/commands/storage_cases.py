"""The cases `kvstore bench` measures, each what its name says: a disk tier's write,
its verified get path, the I/O engine alone, a serial read, a prefetch after a
restart, a DRAM get next to a plain torch copy, a lookup. Figures, never assertions.

The disk cases share one written set of records per geometry: it is written once,
then every read case reopens the store on it (a restart: DRAM empty, the records on
disk only), so fio and every case read the very same slots.
"""

from __future__ import annotations

import os
import random
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from bench.support.fio import Geometry
from bench.support.processes import process_cpu
from bench.support.vm import huge_pages
from kvstore.devices.layout import SB_COPIES
from kvstore.format.checksum import xxh3_64, xxh3_64_copy
from kvstore.format.keys import KVNamespace, chunk_keys
from kvstore.format.record import BLOCK, record_bytes
from kvstore.io import make_engine
from kvstore.io.aligned import AlignedBuffer
from kvstore.io.base import IoBuffer, IoRequest
from kvstore.io.copier import copy_bytes
from kvstore.store.tiered import TieredStore


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
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The tier as the table and the fio yardstick name it ("nvmeof x2")."""
        return f"{self.tier} x{self.extra['namespaces']}" if "namespaces" in self.extra else self.tier

    def row(self) -> dict[str, object]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


@contextmanager
def clock() -> Iterator[dict[str, float]]:
    """Wall and process CPU seconds (every thread of this process) of the body."""
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


@dataclass
class DiskSet:
    """Records written once through a store with only `tiers`, read by every case."""

    tiers: dict[str, Any]
    tier_name: str  # "disk" or "nvmeof"
    label: str
    chunk_bytes: int
    keys: list[bytes]
    geometry: Geometry  # the written slots of the first device
    write_gibps: float
    write_engine: str

    @property
    def count(self) -> int:
        return len(self.keys)

    def config(self, engine: str, queue_depth: int, **extra: Any) -> dict[str, Any]:
        return {"tiers": self.tiers, "io": {"engine": engine, "queue_depth": queue_depth}, **extra}


def write_set(tiers: dict[str, Any], tier_name: str, label: str, engine: str, chunk_bytes: int,
              queue_depth: int, total: int, case_id: str = "") -> DiskSet:
    """Write `total` bytes of chunks (batches of 2 x depth) and close the store."""
    count = max(1, total // chunk_bytes)
    keys = _keys(count, f"-{tier_name}{case_id}-{chunk_bytes}-{queue_depth}")
    payloads = _payloads(count, chunk_bytes)
    batch = 2 * queue_depth
    with TieredStore({"tiers": tiers, "io": {"engine": engine, "queue_depth": queue_depth}},
                     chunk_bytes) as store:
        with clock() as wrote:
            for start in range(0, count, batch):
                stored = store.put_many(keys[start : start + batch], payloads[start : start + batch])
                if not all(stored):
                    raise RuntimeError(f"bench: {stored.count(False)} chunks were not stored")
        devices, slot_bytes = store.probe.devices(), record_bytes(chunk_bytes)
        if not devices or devices[0].data_offset is None:
            raise RuntimeError(f"bench: the {tier_name} tier opened no device")
        # The first device's slots are reserved in order: its written ones come first.
        written = -(-count // len(devices))
        geometry = Geometry(label, devices[0].path, devices[0].data_offset,
                            written * slot_bytes, slot_bytes)
    return DiskSet(tiers, tier_name, label, chunk_bytes, keys, geometry,
                   count * chunk_bytes / 2**30 / wrote["wall"], engine)


def delete_set(data: DiskSet) -> None:
    """Delete the set's records (a block device keeps no file to remove: its headers
    are zeroed, so a later case never finds them)."""
    with TieredStore(data.config("auto", 16), data.chunk_bytes) as store:
        store.delete(data.keys)


def get_case(data: DiskSet, engine: str, queue_depth: int, batch: int,
             bounce: bool = False) -> CaseResult:
    """The verified get path after a restart: `get_many` of `batch` random chunks at a
    time (read, check header, key and xxh3 of the payload). Into the store's own read
    buffers (`TieredStore.buffers`: the read lands in them, no copy), or with `bounce`
    into page-aligned buffers of the caller's (read into staging, then copied)."""
    order = random.Random(0).sample(range(data.count), data.count)
    served = 0
    config = data.config(engine, queue_depth)
    own = AlignedBuffer(batch * data.chunk_bytes) if bounce else None
    try:
        with TieredStore(config, data.chunk_bytes) as store:
            if own is not None:
                outs = [own.view[i * data.chunk_bytes : (i + 1) * data.chunk_bytes] for i in range(batch)]
            else:
                outs = store.buffers(batch)
            # One untimed batch first: the buffers and the store's staging are touched
            # once, as in a running service, not on the clock.
            warm = data.keys[:batch]
            store.get_many(warm, outs[: len(warm)])
            store.stats.reset_latency()
            with clock() as read:
                for start in range(0, data.count, batch):
                    picked = [data.keys[i] for i in order[start : start + batch]]
                    served += sum(store.get_many(picked, outs[: len(picked)]))
            p50, p99 = store.stats.latency_ms("disk.read")  # nvmeof reads count there too
            outs.clear()
    finally:
        if own is not None:
            own.close()
    if served != data.count:
        raise RuntimeError(f"bench: only {served} of {data.count} chunks read back")
    gib = data.count * data.chunk_bytes / 2**30
    write = data.write_gibps if engine == data.write_engine and not bounce else float("nan")
    return CaseResult(data.tier_name, f"{engine}-bounce" if bounce else engine, data.chunk_bytes,
                      queue_depth, gib / read["wall"], write, read["cpu"] / gib, p50, p99,
                      {"batch": batch})


def service_case(data: DiskSet, engine: str, queue_depth: int, workdir: str) -> CaseResult:
    """The get path through the service, as the connector uses it: a client's `get` of
    a window's worth of random chunks at a time, read by the service straight into the
    client's window. CPU is the service's and the client's together. The window gets
    huge pages where the host has them (reserved for the case as root, as fio's are):
    into 4 KiB pages a read splits at the device's segment limit."""
    from kvstore.config.store import load_config
    from kvstore.service.client import StoreClient, stop_service

    window = min(2 * queue_depth * data.chunk_bytes, 1 << 30)
    config = load_config({**data.config(engine, queue_depth),
                          "service": {"socket": os.path.join(workdir, "service", "kv.sock"),
                                      "staging": window}})
    order = random.Random(0).sample(range(data.count), data.count)
    served = 0
    with huge_pages(window + (64 << 20)):
        client = StoreClient(config, data.chunk_bytes)
    try:
        pid = int(client.info()["service_pid"])
        batch = client.memory.slots
        warm = data.keys[:batch]  # fewer chunks than the window holds with a small --total
        client.get(warm, range(len(warm)))  # untimed, as in the other cases
        service_cpu = process_cpu(pid)
        with clock() as read:
            for start in range(0, data.count, batch):
                picked = [data.keys[i] for i in order[start : start + batch]]
                served += sum(client.get(picked, range(len(picked))))
        service_cpu = process_cpu(pid) - service_cpu
        pages = client.memory.window.pages if client.memory.window else "?"
    finally:
        client.close()
        stop_service(config)
    if served != data.count:
        raise RuntimeError(f"bench: only {served} of {data.count} chunks read back through the service")
    gib = data.count * data.chunk_bytes / 2**30
    return CaseResult(data.tier_name, f"{engine}-service", data.chunk_bytes, queue_depth,
                      gib / read["wall"], cpu_s_per_gib_read=(read["cpu"] + service_cpu) / gib,
                      extra={"batch": batch, "window_pages": pages})


def prefetch_case(data: DiskSet, engine: str, queue_depth: int) -> list[CaseResult]:
    """`prefetch` of the whole set as one found run, after a restart (DRAM empty, every
    chunk on disk only) into a DRAM tier that takes them all: read and verified into
    DRAM slots, no copy out. Bytes in flight are allowed 2 x depth chunks, so the
    depth is the case's and not the default cap's. Twice: into DRAM slots never
    touched since the start (`-cold`: page faults included), and into slots written
    once before, as a running service's are."""
    slot = record_bytes(data.chunk_bytes)
    inflight = max(256 << 20, 2 * queue_depth * slot)
    tiers = {**data.tiers, "dram": {"capacity": (data.count + 2) * slot}}
    config = {"tiers": tiers, "io": {"engine": engine, "queue_depth": queue_depth},
              "prefetch_inflight": inflight,
              "dram_clean_ahead": 0}  # no writes behind the warm-up's puts: the case times reads
    return [_prefetch(data, config, f"{engine}-prefetch-cold", queue_depth, warm=False),
            _prefetch(data, config, f"{engine}-prefetch", queue_depth, warm=True)]


def _prefetch(data: DiskSet, config: dict[str, Any], name: str, queue_depth: int,
              warm: bool) -> CaseResult:
    with TieredStore(config, data.chunk_bytes) as store:
        if warm:  # every DRAM slot written and freed once, untimed
            fill = _keys(data.count, "-dram-warm-up")
            store.put_many(fill, _payloads(data.count, data.chunk_bytes))
            store.delete(fill)
        on_disk = store.lookup(data.keys)
        if on_disk.count != data.count or on_disk.resident:
            raise RuntimeError(f"bench: prefetch must start from {data.count} chunks on disk only; "
                               f"found {on_disk.count}, {on_disk.resident} of them in DRAM")
        with clock() as read:
            promoted = store.prefetch(data.keys)
        resident = store.lookup(data.keys).resident
    if promoted != data.count or resident != data.count:
        raise RuntimeError(f"bench: prefetch promoted {promoted} of {data.count} ({resident} in DRAM)")
    gib = data.count * data.chunk_bytes / 2**30
    return CaseResult(data.tier_name, name, data.chunk_bytes, queue_depth, gib / read["wall"],
                      cpu_s_per_gib_read=read["cpu"] / gib,
                      extra={"batch": data.count,
                             "prefetch_inflight_bytes": config["prefetch_inflight"]})


def serial_case(data: DiskSet, count: int) -> CaseResult:
    """One O_DIRECT pread at a time over the same slots: the no-parallelism baseline."""
    geometry = data.geometry
    block = geometry.block
    slots = geometry.size // block
    buffer = AlignedBuffer(block)
    fd = os.open(geometry.file, os.O_RDONLY | os.O_DIRECT)
    latencies = []
    try:
        with clock() as read:
            for slot in random.Random(1).sample(range(slots), min(count, slots)):
                started = time.perf_counter()
                os.preadv(fd, [buffer.view[:block]], geometry.offset + slot * block)
                latencies.append(time.perf_counter() - started)
    finally:
        os.close(fd)
        buffer.close()
    latencies.sort()
    gib = len(latencies) * block / 2**30
    return CaseResult(data.tier_name, "serial", data.chunk_bytes, 1, gib / read["wall"],
                      cpu_s_per_gib_read=read["cpu"] / gib,
                      p50_ms=1000 * latencies[len(latencies) // 2],
                      p99_ms=1000 * latencies[int(0.99 * (len(latencies) - 1))])


def engine_case(data: DiskSet, engine_name: str, queue_depth: int, batch: int) -> CaseResult:
    """The I/O engine alone over the same slots (random order, `batch` whole slots at a
    time into aligned buffers, no verification, no copy): what the engine costs."""
    geometry = data.geometry
    block = geometry.block
    slots = random.Random(2).sample(range(geometry.size // block), geometry.size // block)
    buffer = AlignedBuffer(batch * block)
    np.frombuffer(buffer.view, dtype=np.uint8)[::4096] = 1  # touched, as the get case's are
    memory = [IoBuffer([buffer.view[i * block : (i + 1) * block]]) for i in range(batch)]
    fd = os.open(geometry.file, os.O_RDONLY | os.O_DIRECT)
    engine = make_engine(engine_name, queue_depth)
    try:
        with clock() as read:
            for start in range(0, len(slots), batch):
                picked = slots[start : start + batch]
                engine.run([IoRequest(fd, geometry.offset + slot * block, [memory[i]])
                            for i, slot in enumerate(picked)], timeout_s=60)
    finally:
        engine.close()
        os.close(fd)
        memory.clear()
        buffer.close()
    gib = len(slots) * block / 2**30
    return CaseResult(data.tier_name, f"{engine_name}-raw", data.chunk_bytes, queue_depth,
                      gib / read["wall"],
                      cpu_s_per_gib_read=read["cpu"] / gib, extra={"batch": batch})


def dram_store(chunk_bytes: int, count: int) -> tuple[TieredStore, list[bytes], list[torch.Tensor]]:
    """An empty DRAM-only store with room for `count` chunks, their keys and payloads."""
    store = TieredStore({"tiers": {"dram": {"capacity": (count + 2) * record_bytes(chunk_bytes)}}},
                        chunk_bytes)
    return store, _keys(count), _payloads(count, chunk_bytes)


def dram_case(chunk_bytes: int, total: int, rounds: int = 3) -> CaseResult:
    """DRAM-tier get against a plain torch copy of the same bytes into the same buffers,
    alternated (copy, get, copy, ..., copy); each figure is its best round, since on a
    shared machine a parallel copy (torch's, and the DRAM get's own) now and then
    stalls for a whole round. Its p50/p99 are per chunk, from the start of its
    get_many (of all the chunks at once)."""
    count = max(1, total // chunk_bytes)
    outs = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(count)]
    sources = [torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8) for _ in range(count)]
    gets: list[dict[str, float]] = []
    copies: list[dict[str, float]] = []

    def copy() -> None:
        with clock() as copied:
            for source, out in zip(sources, outs, strict=True):
                out.copy_(source)
        copies.append(copied)

    store, keys, payloads = dram_store(chunk_bytes, count)
    try:
        with clock() as wrote:
            store.put_many(keys, payloads)
        store.get_many(keys, outs)  # warm the destination pages
        store.stats.reset_latency()
        for _ in range(rounds):
            copy()
            with clock() as read:
                served = sum(store.get_many(keys, outs))
            if served != count:
                raise RuntimeError(f"bench: only {served} of {count} DRAM chunks read back")
            gets.append(read)
        copy()
        p50, p99 = store.stats.latency_ms("dram.read")
    finally:
        store.close()
    gib = count * chunk_bytes / 2**30
    read = min(gets, key=lambda t: t["wall"])
    copied = min(copies, key=lambda t: t["wall"])
    return CaseResult("dram", "memcpy", chunk_bytes, 0, gib / read["wall"], gib / wrote["wall"],
                      read["cpu"] / gib, p50, p99,
                      {"batch": count, "rounds": rounds, "torch_copy_gibps": gib / copied["wall"],
                       "torch_copy_cpu_s_per_gib": copied["cpu"] / gib,
                       "fraction_of_copy": copied["wall"] / read["wall"],
                       "get_gibps_rounds": [gib / t["wall"] for t in gets],
                       "torch_copy_gibps_rounds": [gib / t["wall"] for t in copies]})


def hash_cpu_s_per_gib(chunk_bytes: int, nbytes: int = 1 << 30) -> dict[str, float]:
    """CPU seconds per GiB, over memory that is not in the CPU caches, chunk by chunk, of:
    `hash` (xxh3-64: the least a verified disk read can cost here, since the get hashes
    what the device has just written to memory; a hash of hot data is 2-3x cheaper),
    `hash_then_copy` (a staged read verified, then copied to the caller: two passes) and
    `fused` (the same in one pass, format/checksum.py's xxh3_64_copy, which the get uses)."""
    buffer = AlignedBuffer(max(1, nbytes // chunk_bytes) * chunk_bytes)
    target = AlignedBuffer(chunk_bytes)
    def hash_then_copy(view: memoryview) -> None:
        xxh3_64(view)
        copy_bytes(target.view, view)

    steps: dict[str, Callable[[memoryview], object]] = {
        "hash": xxh3_64, "hash_then_copy": hash_then_copy,
        "fused": lambda view: xxh3_64_copy(target.view, view)}
    try:
        np.frombuffer(buffer.view, np.uint8)[:] = 1  # faulted in, and far larger than a cache
        costs = {}
        for name, step in steps.items():
            started = time.process_time()
            for at in range(0, buffer.nbytes, chunk_bytes):
                step(buffer.view[at : at + chunk_bytes])
            costs[name] = (time.process_time() - started) / (buffer.nbytes / 2**30)
        return costs
    finally:
        buffer.close()
        target.close()


def lookup_ms(keys_per_lookup: int = 512, repeats: int = 200) -> float:
    """Median time of `lookup` over a prompt of `keys_per_lookup` chunks, all present."""
    store, keys, payloads = dram_store(4096, keys_per_lookup)
    times = []
    with store:
        store.put_many(keys, payloads)
        for _ in range(repeats):
            started = time.perf_counter()
            found = store.lookup(keys).count
            times.append(time.perf_counter() - started)
            if found != keys_per_lookup:
                raise RuntimeError(f"bench: lookup found {found} of {keys_per_lookup} keys")
    return 1000 * sorted(times)[repeats // 2]


def remove_data(path: str) -> None:
    """Start the next case empty: remove a directory's data file, or zero a block
    device's superblocks (its record headers are already zeroed by the set's delete)."""
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
