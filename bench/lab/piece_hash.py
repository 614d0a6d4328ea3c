"""What the checked copy's piecewise hash costs (kvstore/format/checksum.py): the xxhash
wheel's C library has a plain streaming update (`XXH3_64bits_update`, its baseline SSE2
code) and a SIMD-dispatching one (`XXH3_64bits_update_dispatch`, AVX2 or AVX-512 where
the CPU has them); kvstore uses the second. Each hashes one PIECE (256 KiB, in L2) over
and over, beside a copy of the same piece for a yardstick, the best of a few rounds each,
for docs/benchmarks.md. Pin it to one core for a steady figure:

  taskset -c 0 python -m bench.lab piece_hash [--rounds 5] [--mib 512]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.lab import Result, Unavailable
from kvstore.format.checksum import PIECE, stream_functions

UPDATES = ("XXH3_64bits_update", "XXH3_64bits_update_dispatch")  # plain, dispatched


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=5, help="timings of each, the best kept")
    parser.add_argument("--mib", type=int, default=512, help="bytes hashed (or copied) a round")


def _best_gib_s(call: Callable[[], object], nbytes: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return nbytes / best / (1 << 30)


def _hash_rate(name: str, piece: np.ndarray, repeats: int, rounds: int) -> tuple[float, int]:
    """(GiB/s, digest) of hashing `piece` `repeats` times with the update named `name`."""
    functions = stream_functions(name)
    if functions is None:
        raise Unavailable(f"this xxhash build does not export {name} (or its streaming state)")
    create, reset, update, digest, free = functions
    handle = create()
    if not handle:
        raise MemoryError("XXH3_createState")
    try:
        def hashed() -> int:
            reset(handle)
            for _ in range(repeats):
                update(handle, piece.ctypes.data, PIECE)
            return int(digest(handle))
        return _best_gib_s(hashed, repeats * PIECE, rounds), hashed()
    finally:
        free(handle)


def measure(rounds: int, mib: int) -> dict[str, Any]:
    """GiB/s of each update and of a copy, hashing (copying) one PIECE `mib` MiB's worth a
    round, and whether both updates gave the same digest (else the comparison is void)."""
    piece = np.random.default_rng(0).integers(0, 256, PIECE, dtype=np.uint8)
    target = np.empty_like(piece)
    repeats = max(1, (mib << 20) // PIECE)
    found: dict[str, Any] = {}
    digests = set()
    for name in UPDATES:
        found[name], digest = _hash_rate(name, piece, repeats, rounds)
        digests.add(digest)

    def copied() -> None:
        for _ in range(repeats):
            np.copyto(target, piece)
    found["copy"] = _best_gib_s(copied, repeats * PIECE, rounds)
    found["same_digest"] = len(digests) == 1
    return found


def _flags() -> str:
    """The CPU's widest SIMD the dispatcher may pick (from /proc/cpuinfo)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next(line for line in lines if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return next((simd for simd in ("avx512f", "avx2", "sse2") if simd in flags), "none of sse2/avx2/avx512f")


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    if args.rounds < 1 or args.mib < 1:
        raise Unavailable("--rounds and --mib must be at least 1")
    found = measure(args.rounds, args.mib)
    plain, dispatched = (found[name] for name in UPDATES)
    table = (f"one {PIECE >> 10} KiB piece, hashed over and over (widest SIMD: {_flags()}):\n"
             f"  plain update      {plain:6.1f} GiB/s\n"
             f"  dispatched update {dispatched:6.1f} GiB/s  ({dispatched / plain:.2f}x the plain one)\n"
             f"  a copy of it      {found['copy']:6.1f} GiB/s")
    if not found["same_digest"]:
        table += "\nthe two updates gave different digests: the comparison is void"
    return Result(table, {**found, "simd": _flags()}, ok=found["same_digest"])
