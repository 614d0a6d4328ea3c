"""The exclusive advisory lock on a device, and the wait for a dead holder's files.

A process killed in the middle of its I/O does not let go of its files when it is
reaped: the kernel tears its io_uring down afterwards, on a workqueue, once the
requests in flight have completed, and only then drops the ring's file references
(and with the last one, the flock). A restart right after `kill -9` would find the
lock held by a process that no longer exists. So the lock is taken at once where it
is free, refused at once where a live process holds it (a second store on the same
path), and waited for, within a deadline, where every holder the kernel lists in
/proc/locks has exited. A lock held by no holder listed there (a file system whose device
numbers /proc/locks names otherwise) is refused after a few polls, as a live holder's.
"""

from __future__ import annotations

import fcntl
import os
import time

from kvstore.format.errors import DeviceError

DEAD_HOLDER_WAIT_S = 30.0  # how long a dead holder's teardown may take (I/O in flight)
_POLL_S = 0.02
_UNLISTED_POLLS = 5


def lock_exclusive(fd: int, path: str, wait_s: float = DEAD_HOLDER_WAIT_S) -> None:
    """Take the exclusive flock on fd, or close fd and raise DeviceError saying who holds it."""
    deadline = time.monotonic() + wait_s
    unlisted = 0  # polls in a row that found the lock held and no holder listed
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holders = lock_holders(fd)
            unlisted = 0 if holders else unlisted + 1
            live = any(_alive(pid) for pid in holders)
            # None listed once: it may just have let go. Never listed (no /proc/locks, or a
            # file system whose device numbers it names otherwise): a holder we cannot see.
            if live or unlisted > _UNLISTED_POLLS or time.monotonic() >= deadline:
                os.close(fd)
                raise DeviceError(path, _refusal(bool(holders) and not live, wait_s)) from None
            time.sleep(_POLL_S)


def lock_holders(fd: int) -> list[int]:
    """The pids /proc/locks lists as holding a flock on fd's file; empty where it cannot be
    read. Seen from a pid namespace other than the kernel's first, an exited holder is 0."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            lines = locks.read().splitlines()
    except OSError:
        return []
    holders = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
            holders.append(int(fields[4]) if fields[4].isdigit() else 0)
    return holders


def _alive(pid: int) -> bool:
    """Whether pid names a process that can still let go of its files itself: not a zombie (a
    zombie has closed them), not 0 (one that exited, or one in another pid namespace: either
    way not one a refusal could tell the user to stop), and one we may not look at counts as
    alive (/proc mounted with hidepid)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat_file:
            state = stat_file.read().rsplit(")", 1)[1].split()[0]
    except PermissionError:
        return True
    except (OSError, IndexError):
        return False
    return state != "Z"


def _refusal(exited: bool, wait_s: float) -> str:
    if not exited:
        return ("in use by another kvstore process (advisory lock held); each process needs "
                "its own path or file")
    return (f"still locked {wait_s:g} s after its holder exited (the kernel has not finished "
            "its I/O); try again, or check the device for hung requests")
