"""The device lock: refused at once to a live holder, waited for where its holder exited.

A process killed mid-I/O keeps its files (and their flock) until the kernel has torn its
io_uring down. The exited holder is made here as the kernel leaves it: a child takes the
flock on an open file it shares with this process and exits, so the lock lives on with
no live holder until this process lets the file go (as the ring's teardown does).
"""

import os
import subprocess
import sys
import threading
import time

import pytest

from kvstore.devices.lock import lock_exclusive, lock_holders
from kvstore.format.errors import DeviceError

TAKE = "import fcntl, sys; fcntl.flock({fd}, fcntl.LOCK_EX); sys.stdout.write('held\\n'); sys.stdout.flush()"


def _open(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


def _held_by_exited_child(path: str) -> int:
    """A file descriptor whose flock a child took before it exited."""
    shared = _open(path)
    child = subprocess.run([sys.executable, "-c", TAKE.format(fd=shared)], pass_fds=[shared], check=True,
                           capture_output=True, text=True)
    assert child.stdout == "held\n"
    assert len(lock_holders(shared)) == 1
    return shared


def test_a_lock_whose_holder_exited_is_taken_once_its_files_are_let_go(tmp_path):
    path = str(tmp_path / "data")
    shared = _held_by_exited_child(path)
    fd = _open(path)
    release = threading.Timer(0.5, os.close, [shared])
    started = time.monotonic()  # before the timer starts: the wait is measured from no later
    release.start()
    lock_exclusive(fd, path, wait_s=20)
    assert time.monotonic() - started >= 0.5  # it waited for the release
    release.join()
    os.close(fd)


def test_a_lock_whose_holder_exited_and_is_never_let_go_is_refused_at_the_deadline(tmp_path):
    path = str(tmp_path / "data")
    shared = _held_by_exited_child(path)
    fd = _open(path)
    with pytest.raises(DeviceError, match=r"still locked 0\.3 s after its holder exited"):
        lock_exclusive(fd, path, wait_s=0.3)
    with pytest.raises(OSError):
        os.fstat(fd)  # the refused descriptor was closed
    os.close(shared)


def test_a_live_holder_is_refused_at_once_without_waiting(tmp_path):
    path = str(tmp_path / "data")
    shared = _open(path)
    holder = subprocess.Popen([sys.executable, "-c", TAKE.format(fd=shared) + "; sys.stdin.read()"],
                              pass_fds=[shared], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert lock_holders(shared) == [holder.pid]
        fd = _open(path)
        started = time.monotonic()
        with pytest.raises(DeviceError, match="in use by another kvstore process"):
            lock_exclusive(fd, path, wait_s=60)
        assert time.monotonic() - started < 30  # refused, not waited out
    finally:
        holder.stdin.close()
        holder.wait(10)
        os.close(shared)


def test_a_lock_whose_holder_is_never_listed_is_refused_after_a_few_looks(tmp_path, monkeypatch):
    """A file system whose device numbers /proc/locks names otherwise (or no /proc/locks):
    the holder is never seen, so nothing says it exited; refused as a live holder's, not
    waited out. The unreadable listing is the fault stood in for."""
    path = str(tmp_path / "data")
    shared = _held_by_exited_child(path)
    monkeypatch.setattr("kvstore.devices.lock.lock_holders", lambda fd: [])
    fd = _open(path)
    started = time.monotonic()
    with pytest.raises(DeviceError, match="in use by another kvstore process"):
        lock_exclusive(fd, path, wait_s=60)
    assert time.monotonic() - started < 30  # refused, not waited out
    os.close(shared)
