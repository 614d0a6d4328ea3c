"""A backend benchmark's ceiling (bench/lab/backend_rounds.py): a load is held to the fio
runs whose buffers outgrow the CPU's cache, and where none does, the table says so."""

from __future__ import annotations

from bench.lab.backend_rounds import Round, report_ceiling
from bench.support.fio import HUGE, MALLOC, FioRun, Yardstick, cache_cold


def test_a_load_is_held_to_fio_runs_whose_buffers_outgrow_the_cpu_cache():
    """fio at depth 1 rereads one buffer the CPU holds; a load's pages land in memory of
    their own: its yardstick is the best run of buffers past twice the cache."""
    mib = 1 << 20
    yardstick = Yardstick(seconds=1)
    yardstick.runs += [FioRun("disk", 2 * mib, depth, iomem, gib_s, 0.01) for depth, iomem, gib_s in
                       ((1, HUGE, 3.0), (16, HUGE, 2.6), (64, HUGE, 2.4), (64, MALLOC, 1.9))]
    rounds = [Round("kvstore", "disk", 2.16, 0.2, True), Round("file", "disk", 0.6, 0.5, True)]
    printed = report_ceiling(yardstick, rounds, 2 * mib, "file", cache_bytes=32 * mib)
    assert "depth 1 3.00 GiB/s (cache-warm)" in printed and "depth 64 2.40 GiB/s\n" in printed
    assert "kvstore disk hits: 0.90 of fio's best cache-cold (depth 64)" in printed
    assert "ceiling over file's disk hits: 4.00x" in printed
    # No cache the kernel names: every run counts, the best of them is the yardstick.
    assert "kvstore disk hits: 0.72 of fio's best (depth 1)" in report_ceiling(
        yardstick, rounds, 2 * mib, "file", cache_bytes=0)


def test_where_no_run_outgrows_the_cache_the_table_says_its_yardstick_reads_high():
    kib = 1 << 10
    yardstick = Yardstick(seconds=1)
    yardstick.runs += [FioRun("disk", 256 * kib, depth, HUGE, gib_s, 0.01) for depth, gib_s in
                       ((1, 3.0), (16, 2.6), (64, 2.4))]  # 16 MiB of buffers at most
    printed = report_ceiling(yardstick, [Round("kvstore", "disk", 2.4, 0.2, True)], 256 * kib, "file",
                             cache_bytes=32 << 20)
    assert "no run outgrew it, so the yardstick below reads high" in printed
    assert "kvstore disk hits: 0.80 of fio's best (depth 1)" in printed
    assert cache_cold(2 << 20, 64, 32 << 20) and not cache_cold(2 << 20, 16, 32 << 20)
