"""The bench's yardsticks: huge pages for fio are given back on every path, the best
fio is the fastest run of its own geometry, the CPU's cache size is read from sysfs, and
a missing peer says why."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading

import pytest

from bench.commands.peer_lmcache import peer_case
from bench.support import fio, vm
from bench.support.fio import HUGE, MALLOC, FioRun, Yardstick


def test_huge_pages_are_given_back_when_the_body_fails():
    if os.geteuid() != 0 or vm.huge_page_bytes() == 0:
        pytest.skip("needs root and huge pages")
    with vm.host_lock:  # no other run's reservation between the two reads
        before = vm.NR_HUGEPAGES.read_text()
        with pytest.raises(RuntimeError), vm.huge_pages(4 << 20) as why_not:
            assert why_not is None or "gave" in why_not
            assert int(vm.NR_HUGEPAGES.read_text()) > int(before)
            raise RuntimeError("the fio run failed")
        assert vm.NR_HUGEPAGES.read_text() == before


def test_a_reservation_waits_for_the_one_in_progress():
    """Two runs at once would each write back the setting the other had raised."""
    if os.geteuid() != 0 or vm.huge_page_bytes() == 0:
        pytest.skip("needs root and huge pages")
    entered = threading.Event()

    def second() -> None:
        with vm.huge_pages(4 << 20):
            entered.set()

    with vm.huge_pages(4 << 20):
        thread = threading.Thread(target=second, daemon=True)
        thread.start()
        assert not entered.wait(0.5)
    assert entered.wait(30)
    thread.join(30)


def test_huge_pages_say_why_not_without_root(monkeypatch):
    # As root, no other run's reservation between the two reads.
    held = vm.host_lock if os.geteuid() == 0 else contextlib.nullcontext()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with held:
        before = vm.NR_HUGEPAGES.read_text() if vm.NR_HUGEPAGES.exists() else None
        with vm.huge_pages(4 << 20) as why_not:
            assert why_not in ("not root: cannot set vm.nr_hugepages", "this kernel has no huge pages")
        assert (vm.NR_HUGEPAGES.read_text() if before is not None else None) == before


def test_best_fio_is_the_fastest_run_at_the_same_geometry():
    yardstick = Yardstick(seconds=1)
    yardstick.runs += [FioRun("disk", 4096, 16, MALLOC, 1.0, 0.05), FioRun("disk", 4096, 16, HUGE, 1.8, 0.01),
                       FioRun("disk", 4096, 16, HUGE, 1.6, 0.01), FioRun("disk", 4096, 1, HUGE, 3.0, 0.01),
                       FioRun("nvmeof x1", 4096, 16, HUGE, 9.0, 0.01)]
    assert yardstick.best("disk", 4096, 16).read_gibps == 1.8
    assert yardstick.best("disk", 4096, 16, MALLOC).read_gibps == 1.0
    assert yardstick.best("disk", 8192, 16) is None


@pytest.mark.skipif(importlib.util.find_spec("lmcache") is not None, reason="lmcache is installed here")
def test_a_missing_peer_says_why_and_how_to_install_it(tmp_path):
    why = peer_case(str(tmp_path), 4096, 4, 4, 16)
    assert isinstance(why, str) and "scripts/setup_lmcache.sh" in why
    assert os.listdir(tmp_path) == []  # its directory is removed


def test_the_cache_size_is_read_from_sysfs(tmp_path, monkeypatch):
    for index, size in enumerate(("48K", "1024K", "32768K", "bogus")):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    monkeypatch.setattr(fio, "CPU_CACHES", tmp_path)
    assert fio.last_level_cache_bytes() == 32 << 20
    monkeypatch.setattr(fio, "CPU_CACHES", tmp_path / "none")
    assert fio.last_level_cache_bytes() == 0
