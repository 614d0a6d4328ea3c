"""One round of an engine storage backend's benchmark (SGLang's HiCache, LMCache), the
kvstore service's CPU it used, the disk's own ceiling measured in the same sitting (fio),
and the table both benchmarks print against their baseline.

The ceiling says what a ratio between two backends can be on this disk: fio reading the
same block size one request at a time (a backend that reads one file after another) and
at kvstore's depth. Where the two fio figures are close, the disk does not reward
parallel reads, and no backend can run far ahead of a sequential one. A round is held to
fio's runs whose buffers outgrow the CPU's cache (bench/support/fio.py): its pages land
in memory of their own, as a load's do.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from bench.lab import Result
from bench.support.fio import Geometry, Yardstick, cache_cold, last_level_cache_bytes
from bench.support.processes import process_cpu
from bench.support.vm import huge_pages
from kvstore.config.store import load_config
from kvstore.format.units import parse_size
from kvstore.service.client import attach


@dataclass
class Round:
    backend: str
    hits: str
    gib_s: float
    cpu_s_per_gib: float
    verified: bool


def add_round_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """The flags every backend round takes: where its files go, how many bytes of `what`
    each round loads, and fio's length."""
    parser.add_argument("--dir", help="a directory on the disk to test (O_DIRECT-capable): the run's files "
                                      "go in a temporary directory there (default: the work directory)")
    parser.add_argument("--total", default="512MiB", help=f"bytes of {what} each round loads")
    parser.add_argument("--fio-seconds", type=float, default=3.0,
                        help="each fio run's length (0: no fio)")


def service_cpu(store: dict[str, Any]) -> float:
    """CPU seconds (user + system) the running kvstore service has used so far."""
    client = attach(load_config(store))
    try:
        pid = int(client.info()["service_pid"])
    finally:
        client.close()
    return process_cpu(pid)


@contextmanager
def service_huge_pages(store: dict[str, Any], clients: int) -> Iterator[None]:
    """Huge pages reserved (as root; given back after) for the service's shared DRAM tier
    and its clients' windows, as fio's buffers get theirs: a disk hit read into memory of
    4 KiB pages splits at the device's segment limit (docs/vllm.md). Said when not had."""
    need = int(store["tiers"]["dram"]["capacity"]) + clients * parse_size(store["service"]["staging"])
    with huge_pages(need + (64 << 20)) as why_not:
        if why_not is not None:
            print(f"note: the kvstore service runs without reserved huge pages: {why_not}")
        yield


DEPTHS = (1, 16, 64)  # one read at a time, and up to kvstore's default queue depth (io.queue_depth)


def measure_disk(yardstick: Yardstick, directory: str, block: int, total: int) -> None:
    """fio at each depth (O_DIRECT random reads of `block`), once into huge-page buffers and
    once into malloc'd ones, over a file of `total` bytes that fio lays out beside the
    backends' files; called before and after the rounds, so drift over the sitting shows
    and the best run is the yardstick."""
    path = os.path.join(directory, "fio-yardstick")
    geometry = Geometry("disk", path, 0, max(total, block * DEPTHS[-1]), block)
    for depth in DEPTHS:
        for _ in range(2):  # the yardstick alternates the buffer kind run by run
            yardstick.measure(geometry, depth)


def report_ceiling(yardstick: Yardstick, rounds: Sequence[Round], block: int, baseline: str,
                   cache_bytes: int) -> str:
    """fio's best at each depth, each disk round against fio's best at the depths whose
    buffers outgrow the CPU's cache (`cache_bytes`; a round's pages land in memory of their
    own, not in a few buffers the CPU holds), and the most any backend could run over the
    baseline's disk round on this disk."""
    found = {depth: yardstick.best("disk", block, depth) for depth in DEPTHS}
    lines = [f"fio: {note}" for note in yardstick.notes]
    best = {depth: run for depth, run in found.items() if run is not None}
    if len(best) < len(found):
        return "\n".join(lines)
    cold = {d: run for d, run in best.items() if cache_cold(block, d, cache_bytes)}
    figures = ", ".join(f"depth {d} {run.read_gibps:.2f} GiB/s{'' if d in cold else ' (cache-warm)'}"
                        for d, run in best.items())
    lines.append(f"fio randread, O_DIRECT, {block >> 10} KiB blocks, best of {len(yardstick.runs)} runs: "
                 f"{figures}")
    if len(cold) < len(best):
        lines.append(f"  (cache-warm: fio's buffers, depth x block, within twice the CPU's "
                     f"{cache_bytes >> 20} MiB cache: " + ("not the yardstick of a load)" if cold else
                     "no run outgrew it, so the yardstick below reads high for a load)"))
    narrowed = 0 < len(cold) < len(best)  # some runs left out as cache-warm
    depth, top = max((cold if narrowed else best).items(), key=lambda pair: pair[1].read_gibps)
    ceiling = top.read_gibps
    for r in rounds:
        if r.hits == "disk":
            lines.append(f"  {r.backend} disk hits: {r.gib_s / ceiling:.2f} of fio's best "
                         f"{'cache-cold ' if narrowed else ''}(depth {depth})")
    base = next((r.gib_s for r in rounds if r.backend == baseline and r.hits == "disk"), None)
    if base:
        lines.append(f"  the disk's ceiling over {baseline}'s disk hits: {ceiling / base:.2f}x")
    return "\n".join(lines)


def report(rounds: Sequence[Round], base: Callable[[Round], float], versus: str) -> str:
    """Each round with its speed as a multiple of `base(round)` (the baseline measured in
    the same run)."""
    width = max(len(r.backend) for r in rounds) + 2
    lines = [f"{'backend':<{width}} {'hits':<5} {'GiB/s':>7} {'CPU s/GiB':>10} {versus:>9}  verified"]
    for r in rounds:
        lines.append(f"{r.backend:<{width}} {r.hits:<5} {r.gib_s:7.2f} {r.cpu_s_per_gib:10.3f} "
                     f"{r.gib_s / base(r):9.2f}  {r.verified}")
    return "\n".join(lines)


def result(rounds: list[Round], yardstick: Yardstick, header: str, table: str, baseline: str | None,
           block: int) -> Result:
    """The experiment's Result: `header`, the rounds' `table` and, where fio ran (`baseline`
    named), the disk's ceiling; as JSON the rounds and fio's runs. Its value is the rounds."""
    lines = [header, table]
    if baseline:
        lines.append(report_ceiling(yardstick, rounds, block, baseline, last_level_cache_bytes()))
    return Result("\n".join(lines), {"rounds": [asdict(r) for r in rounds], "fio": yardstick.rows()},
                  value=rounds)
