"""The service's own process, found by the lock it holds, for its owner's stop by signal.

A running service holds an flock on SOCKET.lock for its whole life (server.py), so the
process holding it is the service, whether or not it still accepts a connection (a hung
one's listen backlog fills up). `kvstore stop` signals it when the service takes no
client for the stop request (every slot held, or no answer to the hello).

Invariants: only a lock file of this user's counts (a regular file, not a link, owned by
this uid), and only a process of this user's that has that very file open and holds its
flock: a socket or a link another user planted at the socket path never makes the owner
signal one of its other processes. The process is held by a pidfd taken before it is
checked, so a pid reused meanwhile is never signalled, and its end is waited for on the
same pidfd, not on the socket (a process killed outright leaves its socket behind).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
from pathlib import Path

from kvstore.service.client_connection import ServiceUnavailable

LOCKS = Path("/proc/locks")


class ServiceProcess:
    """A running service's process, held by a pidfd (close it, or use it as a context)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd

    @classmethod
    def find(cls, socket_path: str) -> ServiceProcess | None:
        """The process of this user's that holds the service's lock at `socket_path`;
        None where none does (no service runs there, or not one of this user's)."""
        lock = socket_path + ".lock"
        try:
            found = os.lstat(lock)
            held = LOCKS.read_text()
        except OSError:
            return None
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
            return None
        for pid in _flock_holders(held, found.st_ino):
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:  # gone already
                continue
            if _holds_open(pid, found):
                return cls(pid, pidfd)
            os.close(pidfd)
        return None

    def terminate(self, timeout_s: float) -> None:
        """SIGTERM (the service drains, checkpoints and exits, as on a stop request), then
        wait for the process to end; ServiceUnavailable naming the pid if it has not within
        `timeout_s` (a service hung in its own lock cannot drain)."""
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            signal.pidfd_send_signal(self._pidfd, signal.SIGTERM)
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)  # readable once the process has ended
        if not poller.poll(int(timeout_s * 1000)):
            raise ServiceUnavailable(f"kvstore service (pid {self.pid}) did not exit within {timeout_s:g} s "
                                     f"of SIGTERM; `kill -KILL {self.pid}` ends it (the next service takes "
                                     "its socket and tiers over)")

    def close(self) -> None:
        os.close(self._pidfd)

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flock_holders(locks: str, inode: int) -> list[int]:
    """Pids /proc/locks shows holding an flock on a file of inode `inode` (of any device:
    the caller checks the file itself). Its lines read `1: FLOCK  ADVISORY  WRITE PID
    MAJ:MIN:INODE 0 EOF`; a waiter's line has `->` after the number, and is skipped."""
    holders = []
    for line in locks.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        with contextlib.suppress(ValueError):
            if int(fields[5].rsplit(":", 1)[1]) == inode:
                holders.append(int(fields[4]))
    return holders


def _holds_open(pid: int, lock: os.stat_result) -> bool:
    """Whether process `pid` runs as this user and has the lock file itself open."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            return False
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                opened = os.stat(f"/proc/{pid}/fd/{fd}")
                if (opened.st_dev, opened.st_ino) == (lock.st_dev, lock.st_ino):
                    return True
    except OSError:  # gone, or not ours to read
        return False
    return False
