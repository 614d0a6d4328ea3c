"""vLLM's own tiered offloading with kvstore as its secondary tier, side by side with vLLM's
own `fs` tier, on the same requests and the same disk.

    python -m bench.lab vllm_tier [--dir DIR] [--total 512MiB] [--row 2MiB] [--chunks-per-request 32]
                                  [--requests-at-once 4] [--full-disk 192MiB] [--fio-seconds 3]

Both tiers run under vLLM's real TieringOffloadingManager (bench/support/vllm_offload.py):
one CPU tier of rows of `--row` bytes (a row is one chunk; 2 MiB is a block of 16 tokens
of a Llama-3-8B-like model in fp16, so a request of 32 is a 512-token prompt), the tier
below it made by vLLM's own factory, and the same requests: `--total` bytes of chunks
stored as requests of `--chunks-per-request`, then, with the CPU tier emptied, looked up
again, `--requests-at-once` arriving in each step, as vLLM's scheduler does: lookups
until every chunk is a HIT in the CPU tier or a MISS, each request's promotions one job.
A promotion is one chunk moved from the secondary tier into the CPU tier; each loaded
row is checked against what was stored.

- kvstore warm: from the service's DRAM tier (the requests' chunks were just stored).
- kvstore disk: after the service restarted (its DRAM tier empty: every chunk read from
  disk with O_DIRECT and verified; huge pages reserved for the service, as root).
- fs disk: vLLM's fs tier after the engine restarted (its files read with O_DIRECT by
  its 16 read threads; it has no DRAM tier of its own but vLLM's CPU tier).

CPU s/GiB counts this process (the tier's threads) and, for kvstore, its service. Then
what each does when things go wrong: one byte of one stored chunk flipped on disk, and a
disk that fills (`--full-disk`: each tier on an ext4 filesystem of that size on a loop
device, as root, given one and a half times as many chunks as fit; kvstore's disk tier
is sized to three quarters of it). fio reads the same disk before and after the rounds:
the disk's ceiling.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from bench.lab import Result
from bench.lab.backend_rounds import (
    Round,
    add_round_arguments,
    measure_disk,
    result,
    service_cpu,
    service_huge_pages,
)
from bench.lab.runner import run
from bench.support.fio import Yardstick
from bench.support.loopdev import filesystem_unavailable, small_filesystem
from bench.support.records import corrupt_record
from bench.support.vllm_offload import (
    OffloadRig,
    fs_tier,
    kvstore_tier,
    offload_key,
    offloading_spec,
    payload,
)
from kvstore.config.store import load_config
from kvstore.format.units import parse_size
from kvstore.service.client import stop_service

Requests = list[list[str]]  # each request's chunk names
BASELINE = "vLLM fs"
WORKDIR_PARENT = "."  # the default work directory: here, on a disk that takes O_DIRECT (tmpfs does not)


def _digest(row: np.ndarray) -> bytes:
    return xxhash.xxh3_64_digest(row.data)


def runs(verdicts: Sequence[str]) -> str:
    """Verdicts in order, each run of one counted: "equal 1, miss 7"."""
    parts: list[list[Any]] = []
    for verdict in verdicts:
        if parts and parts[-1][0] == verdict:
            parts[-1][1] += 1
        else:
            parts.append([verdict, 1])
    return ", ".join(f"{verdict} {count}" for verdict, count in parts)


class Bench:
    """The run's geometry: rows, requests, and the checks."""

    def __init__(self, args: argparse.Namespace, directory: str, sockets: str) -> None:
        self.directory = directory
        self.sockets = sockets  # a short path: a socket's must fit in 107 bytes
        self.row = parse_size(args.row)
        self.per_request = args.chunks_per_request
        self.at_once = args.requests_at_once
        chunks = max(self.per_request, parse_size(args.total) // self.row)
        self.requests = self.named(chunks // self.per_request, "r")
        self.expected = {name: xxhash.xxh3_64_digest(payload(name, self.row))
                         for names in self.requests for name in names}
        self.spent = 0.0  # seconds the last `found` spent in the steps it timed

    def named(self, count: int, prefix: str) -> Requests:
        return [[f"{prefix}{r}-{i}" for i in range(self.per_request)] for r in range(count)]

    def rig(self, tier: dict[str, Any]) -> OffloadRig:
        """An engine's manager over `tier`, its CPU tier twice one step's promotions."""
        return OffloadRig(offloading_spec([tier], self.row, 2 * self.at_once * self.per_request))

    def kvstore(self, directory: str, dram: int, disk: int, name: str) -> dict[str, Any]:
        """A service of its own (socket `name`) with its disk tier in `directory`."""
        return {"tiers": {"dram": {"capacity": dram}, "disk": [{"path": os.path.join(directory, "kvstore"),
                                                                "capacity": disk}]},
                "service": {"socket": os.path.join(self.sockets, name, "kvstore.sock"),
                            "staging": 2 * self.at_once * self.per_request * self.row}}

    def store(self, rig: OffloadRig, requests: Requests) -> None:
        for r, names in enumerate(requests):
            rig.store([offload_key(n) for n in names], [payload(n, self.row) for n in names], f"store-{r}")

    def found(self, rig: OffloadRig, requests: Requests) -> list[list[bytes | None]]:
        """Each request's chunks loaded (their rows' digests; None: a miss), the requests
        arriving `at_once` a step; only the steps until they settle are timed (`self.spent`)."""
        rig.empty_cpu_tier()
        loaded, self.spent = [], 0.0
        for start in range(0, len(requests), self.at_once):
            wave = [[offload_key(n) for n in names] for names in requests[start : start + self.at_once]]
            contexts = [rig.context(f"load-{start + j}-{time.monotonic_ns()}", keys)
                        for j, keys in enumerate(wave)]
            began = time.perf_counter()
            found = rig.promote(wave, contexts)
            self.spent += time.perf_counter() - began
            loaded += [rig.read(keys, hits, context, _digest)
                       for keys, hits, context in zip(wave, found, contexts, strict=True)]
            rig.finish(contexts)
        return loaded

    def timed(self, tier: str, hits: str, rig: OffloadRig, service: Callable[[], float] | None) -> Round:
        """One round: every request loaded; GiB/s over the steps the promotions took."""
        cpu0, service0 = time.process_time(), service() if service else 0.0
        loaded = self.found(rig, self.requests)
        cpu = time.process_time() - cpu0 + ((service() - service0) if service else 0.0)
        gib = sum(len(names) for names in self.requests) * self.row / (1 << 30)
        ok = all(got == self.expected[n] for names, row in zip(self.requests, loaded, strict=True)
                 for n, got in zip(names, row, strict=True))
        return Round(tier, hits, gib / self.spent, cpu / gib, ok)

    def verdicts(self, rig: OffloadRig, names: list[str]) -> list[str]:
        """One request's chunks: their own bytes ("equal"), a miss, or other bytes ("WRONG")."""
        (row,) = self.found(rig, [names])
        return ["miss" if got is None else "equal" if got == self.expected.get(n) else "WRONG"
                for n, got in zip(names, row, strict=True)]


def kvstore_rounds(bench: Bench) -> tuple[list[Round], str]:
    """Warm, then after a restart; then a flipped byte: the tier's answer to it."""
    total = sum(len(names) for names in bench.requests) * bench.row
    store = bench.kvstore(bench.directory, int(total * 1.25) + (64 << 20), int(total * 1.5), "rounds")
    with service_huge_pages(store, clients=2):
        rig = bench.rig(kvstore_tier(store))
        try:
            bench.store(rig, bench.requests)
            cpu = lambda: service_cpu(store)  # noqa: E731
            rounds = [bench.timed("kvstore", "warm", rig, cpu)]
            rig.close()
            stop_service(load_config(store))  # DRAM written down; the next service reads disk
            rig = bench.rig(kvstore_tier(store))
            rounds.append(bench.timed("kvstore", "disk", rig, cpu))
            names = bench.requests[0]
            flipped = rig.tier.keys.of(offload_key(names[1]))  # type: ignore[attr-defined]
            rig.close()
            stop_service(load_config(store))
            corrupt_record(store["tiers"]["disk"][0]["path"], key=flipped)
            rig = bench.rig(kvstore_tier(store))
            after = bench.verdicts(rig, names)
        finally:
            rig.close()
            stop_service(load_config(store))
    return rounds, runs(after)


def fs_rounds(bench: Bench) -> tuple[list[Round], str]:
    """After the engine restarted (its files stay), then a flipped byte in one file."""
    root = os.path.join(bench.directory, "vllm-fs")
    rig = bench.rig(fs_tier(root))
    bench.store(rig, bench.requests)
    rig.close()
    rig = bench.rig(fs_tier(root))
    try:
        rounds = [bench.timed(BASELINE, "disk", rig, None)]
        names = bench.requests[0]
        path = rig.tier.file_mapper.get_file_name(offload_key(names[1]))  # type: ignore[attr-defined]
        with open(path, "r+b") as f:  # the byte a kvstore record's flip hits: 1000 into the payload
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 0xFF]))
            os.fsync(f.fileno())
        after = bench.verdicts(rig, names)
    finally:
        rig.close()
    return rounds, runs(after)


def full_disk(bench: Bench, size: int, kvstore: bool) -> str:
    """Each tier alone on a filesystem of `size`, given 1.5x the chunks that fit: how many
    of the first and of the last request it then finds, and how full the disk is."""
    with tempfile.TemporaryDirectory(dir=bench.directory) as where, small_filesystem(where, size) as mount:
        requests = bench.named(max(2, int(1.5 * size / bench.row) // bench.per_request), "full")
        bench.expected.update({n: xxhash.xxh3_64_digest(payload(n, bench.row)) for r in requests for n in r})
        store = bench.kvstore(mount, 8 * bench.row, size * 3 // 4, "full-disk")
        rig = bench.rig(kvstore_tier(store) if kvstore else fs_tier(os.path.join(mount, "vllm-fs")))
        try:
            bench.store(rig, requests)
            first, last = (bench.verdicts(rig, names) for names in (requests[0], requests[-1]))
        finally:
            rig.close()
            if kvstore:
                stop_service(load_config(store))
        disk = os.statvfs(mount)
        used = 1 - disk.f_bfree / disk.f_blocks
    return (f"first request {first.count('equal')}/{len(first)}, last {last.count('equal')}/{len(last)}"
            f"{'' if 'WRONG' not in first + last else ', WRONG bytes'}; filesystem {used:.0%} full")


def table(rounds: Sequence[Round], row: int) -> str:
    """Each round: promotions (chunks) per second, GiB/s, CPU per GiB, and its speed over
    the best baseline round of the same run."""
    base = max(r.gib_s for r in rounds if r.backend == BASELINE)
    lines = [f"{'tier':<9} {'hits':<5} {'promotions/s':>12} {'GiB/s':>7} {'CPU s/GiB':>10} {'x fs':>6}"
             "  verified"]
    for r in rounds:
        lines.append(f"{r.backend:<9} {r.hits:<5} {r.gib_s * (1 << 30) / row:12.0f} {r.gib_s:7.2f} "
                     f"{r.cpu_s_per_gib:10.3f} {r.gib_s / base:6.2f}  {r.verified}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_round_arguments(parser, "chunks")
    parser.add_argument("--row", default="2MiB", help="bytes of one CPU-tier row: one chunk")
    parser.add_argument("--chunks-per-request", type=int, default=32, help="chunks in each request")
    parser.add_argument("--requests-at-once", type=int, default=4, help="requests arriving in one step")
    parser.add_argument("--full-disk", default="192MiB",
                        help="the small filesystem each tier fills (as root; 0: not run)")


def main(argv: list[str] | None = None) -> list[Round]:
    """This experiment as `python -m bench.lab vllm_tier` runs it; its rounds (the tests check them)."""
    return run("vllm_tier", argv).value


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    yardstick = Yardstick(args.fio_seconds)
    with tempfile.TemporaryDirectory(dir=args.dir or workdir, prefix="vllm-tier-") as directory, \
            tempfile.TemporaryDirectory(prefix="kvstore-tier-") as sockets:
        bench = Bench(args, directory, sockets)
        total = sum(len(names) for names in bench.requests) * bench.row
        if args.fio_seconds > 0:
            measure_disk(yardstick, directory, bench.row, total)
        fs, fs_flip = fs_rounds(bench)
        ours, our_flip = kvstore_rounds(bench)
        if args.fio_seconds > 0:
            measure_disk(yardstick, directory, bench.row, total)
        faults = [("a flipped byte (request 0, chunk 1)", our_flip, fs_flip)]
        size = parse_size(args.full_disk) if args.full_disk not in ("0", "") else 0
        why_not = filesystem_unavailable()
        if size and why_not is None:
            faults.append((f"a full disk ({size >> 20} MiB)", full_disk(bench, size, True),
                           full_disk(bench, size, False)))
        elif size:
            faults.append(("a full disk", f"not run: {why_not}", f"not run: {why_not}"))
    rounds = ours + fs
    lines = [table(rounds, bench.row), "", "what each tier then does:"]
    lines += [f"  {what}\n    kvstore: {ours_}\n    {BASELINE}: {theirs}" for what, ours_, theirs in faults]
    header = (f"{len(bench.requests)} requests of {bench.per_request} chunks of {bench.row >> 20} MiB "
              f"({total / (1 << 30):.2f} GiB), {bench.at_once} arriving in each step")
    found = result(rounds, yardstick, header, "\n".join(lines), BASELINE if args.fio_seconds > 0 else None,
                   bench.row)
    found.document["faults"] = [{"case": what, "kvstore": ours_, "fs": theirs}
                                for what, ours_, theirs in faults]
    return found
