"""What a save costs its caller once the DRAM tier is full (issue 49, datapath/cleaner.py):
`put_many` of a wave of chunks into a DRAM tier whose coldest chunks the cleaner wrote down
ahead, against the same puts with no cleaner (`dram_clean_ahead: 0`: each put writes its
victims down itself first), and against puts into free DRAM slots with no cleaner (the
floor: a copy). The DRAM slab is in huge pages where this user can reserve them (root).

Each mode opens its own store (a DRAM tier of `--dram-chunks` slots, a disk tier in the
work directory), fills DRAM (untimed), then makes `--saves` saves of `--wave` chunks, each
followed by `--gap-s` of nothing (the engine computing before its next save). The caller's
time and CPU per put are what an engine's save waits for and spends. `demoted`: victims
puts wrote down themselves (no cleaner); `cleaned`: chunks the cleaner wrote; `straight`:
put chunks that found no clean DRAM slot (the cleaner behind) and went to disk directly.

  python -m bench.lab save_path [--chunk-mib 32] [--dram-chunks 16] [--wave 4] [--saves 12]
                                [--gap-s 0.25]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.lab import Result
from bench.support.vm import huge_pages
from kvstore.format.keys import KVNamespace, chunk_keys
from kvstore.format.record import record_bytes
from kvstore.store.tiered import TieredStore

WORKDIR_PARENT = "/var/tmp"  # O_DIRECT: not a tmpfs
MODES = ("free DRAM (floor)", "cleaner", "no cleaner")


def _store(mode: str, args: argparse.Namespace, disk: Path, total: int) -> TieredStore:
    chunk = args.chunk_mib << 20
    slots = total + 2 if mode == MODES[0] else args.dram_chunks
    config: dict[str, Any] = {
        "tiers": {"dram": {"capacity": slots * record_bytes(chunk)},
                  "disk": [{"path": str(disk), "capacity": (total + 8) * record_bytes(chunk)}]},
        "io": {"queue_depth": 8}}
    if mode != MODES[1]:
        config["dram_clean_ahead"] = 0  # the floor too: nothing written behind its puts
    return TieredStore(config, chunk)


def _run(mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    total = args.dram_chunks + args.saves * args.wave
    keys = chunk_keys(np.arange(total * 16) % 50000, KVNamespace(f"save-path-{mode}", "uint8", "flat", 16))
    payload = np.random.default_rng(0).integers(0, 256, args.chunk_mib << 20, dtype=np.uint8)
    disk = workdir / mode.split()[0]
    disk.mkdir()
    walls, cpus = [], []
    slab = (total + 2) * record_bytes(args.chunk_mib << 20)
    with huge_pages(slab) as why_not, _store(mode, args, disk, total) as store:
        for key in keys[: args.dram_chunks]:
            store.put_many([key], [payload])
        time.sleep(args.gap_s * 4)  # as long as an engine's first prompt computes
        for start in range(args.dram_chunks, total, args.wave):
            wave = keys[start : start + args.wave]
            wall, cpu = time.perf_counter(), time.thread_time()
            stored = store.put_many(wave, [payload] * len(wave))
            cpus.append(time.thread_time() - cpu)
            walls.append(time.perf_counter() - wall)
            if not all(stored):
                raise RuntimeError(f"save_path ({mode}): {stored.count(False)} chunks not stored")
            time.sleep(args.gap_s)
        counters = store.stats.snapshot()
    gib = args.wave * args.chunk_mib / 1024
    return {"mode": mode, "put_p50_ms": statistics.median(walls) * 1e3, "put_max_ms": max(walls) * 1e3,
            "put_gib_s": gib / statistics.median(walls), "caller_cpu_s_per_gib": sum(cpus) / gib / len(cpus),
            "demoted": counters.get("dram.demoted", 0), "cleaned": counters.get("dram.cleaned", 0),
            "straight_to_disk": counters.get("put.straight_to_disk", 0),
            "disk_gib_written": counters.get("disk.bytes_written", 0) / 2**30,
            "huge_pages": why_not or "reserved"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunk-mib", type=int, default=32, help="chunk size (Llama-3-8B's 256 tokens: 32)")
    parser.add_argument("--dram-chunks", type=int, default=16)
    parser.add_argument("--wave", type=int, default=4, help="chunks per save")
    parser.add_argument("--saves", type=int, default=12)
    parser.add_argument("--gap-s", type=float, default=0.25, help="time between saves")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the three modes, alternated")


def experiment(args: argparse.Namespace, workdir: Path) -> Result:
    runs = []
    for round_ in range(args.rounds):
        for mode in MODES:
            (workdir / str(round_)).mkdir(exist_ok=True)
            runs.append(_run(mode, args, workdir / str(round_)))
    best = {mode: min((r for r in runs if r["mode"] == mode), key=lambda r: r["put_p50_ms"])
            for mode in MODES}
    floor = best[MODES[0]]["put_p50_ms"]
    lines = [f"{args.saves} saves of {args.wave} x {args.chunk_mib} MiB, {args.gap_s} s apart, into "
             f"{args.dram_chunks} DRAM slots; best of {args.rounds} rounds per mode; huge pages: "
             f"{runs[0]['huge_pages']}",
             f"{'mode':<18} {'put p50 ms':>10} {'max ms':>8} {'GiB/s':>6} {'caller CPU s/GiB':>16} "
             f"{'x floor':>7} {'demoted':>7} {'cleaned':>7} {'straight':>8} {'disk GiB':>8}"]
    for mode in MODES:
        r = best[mode]
        lines.append(f"{mode:<18} {r['put_p50_ms']:>10.1f} {r['put_max_ms']:>8.1f} {r['put_gib_s']:>6.2f} "
                     f"{r['caller_cpu_s_per_gib']:>16.3f} {r['put_p50_ms'] / floor:>7.2f} {r['demoted']:>7} "
                     f"{r['cleaned']:>7} {r['straight_to_disk']:>8} {r['disk_gib_written']:>8.2f}")
    return Result("\n".join(lines), {"args": vars(args), "runs": runs, "best": best})
