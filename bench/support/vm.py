"""The kernel memory settings `kvstore bench` touches, as root only, each put back.

fio reads a multi-MiB block into one huge-page buffer as one request; into scattered
4 KiB pages the block layer splits it at the device's segment limit, and fio then
measures the splitting, not the disk. So fio gets huge pages for its run, reserved
through vm.nr_hugepages and returned on every path out (Ctrl-C and SIGTERM too). The
setting is one per host: two runs at once would each write back what the other had
added, so a reservation holds a host-wide lock for its whole body.
Dropping the page cache between cases keeps one case's cached pages from shaping
the next one's memory.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from filelock import FileLock

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
MEMINFO = Path("/proc/meminfo")
# In /run, where only root writes (not /run/lock, which every user may write): only root
# reaches a reservation, and no other user can plant a link there or hold the lock.
LOCK = Path("/run/kvstore-huge-pages.lock")
# Thread-local and reentrant: a caller can read the setting before and after a
# reservation of its own with no other run's in between.
host_lock = FileLock(LOCK, mode=0o600)


def huge_page_bytes() -> int:
    """The default huge page size (Hugepagesize in /proc/meminfo), 0 where there is none."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("Hugepagesize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _free_huge_pages() -> int:
    for line in MEMINFO.read_text().splitlines():
        if line.startswith("HugePages_Free:"):
            return int(line.split()[1])
    return 0


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def huge_pages(nbytes: int) -> Iterator[str | None]:
    """Reserve enough huge pages for `nbytes` on top of what is reserved now, for the
    body only. Yields None when they are there, else why not (the body then runs
    without them). The old vm.nr_hugepages is written back whatever happens."""
    page = huge_page_bytes()
    if page == 0:
        yield "this kernel has no huge pages"
        return
    if os.geteuid() != 0:
        yield "not root: cannot set vm.nr_hugepages"
        return
    with host_lock:
        yield from _reserve(nbytes, page)


def _reserve(nbytes: int, page: int) -> Iterator[str | None]:
    try:
        old = int(NR_HUGEPAGES.read_text())
    except OSError as exc:
        yield f"cannot read {NR_HUGEPAGES}: {exc.strerror}"
        return
    needed = -(-nbytes // page)
    # SIGTERM becomes SystemExit so the `finally` below restores the setting.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_exit) if main else None
    try:
        NR_HUGEPAGES.write_text(str(old + needed))
        free = _free_huge_pages()
        yield None if free >= needed else (
            f"the kernel gave {free} of {needed} huge pages (memory fragmented?)")
    finally:
        NR_HUGEPAGES.write_text(str(old))
        if main:
            signal.signal(signal.SIGTERM, previous)


def drop_page_cache() -> bool:
    """Write back dirty pages and drop the clean ones (root); False where not allowed."""
    os.sync()
    try:
        DROP_CACHES.write_text("3")
    except OSError:
        return False
    return True
