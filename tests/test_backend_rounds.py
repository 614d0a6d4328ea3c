"""A backend benchmark's ceiling (bench/lab/backend_rounds.py): a load is held to the fio
runs whose buffers outgrow the CPU's cache, and a block too small for the usual depths to
do so gets a depth that does."""

from __future__ import annotations

from bench.lab.backend_rounds import DEPTHS, Round, disk_depths, report_ceiling
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


def test_a_small_block_gets_a_depth_whose_buffers_outgrow_the_cache():
    mib = 1 << 20
    assert disk_depths(2 * mib, 32 * mib) == DEPTHS  # 64 x 2 MiB is past 2 x 32 MiB
    assert disk_depths(256 << 10, 32 * mib) == (*DEPTHS, 256)
    assert disk_depths(4096, 32 * mib)[-1] == 4096  # no further than io.queue_depth goes
    assert cache_cold(2 * mib, 64, 32 * mib) and not cache_cold(2 * mib, 16, 32 * mib)
