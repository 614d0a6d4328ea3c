"""Where disk-tier bytes live: a preallocated file in a directory, or a block device.

Each is opened with O_DIRECT (no page cache: the DRAM tier is our cache) and
locked with an exclusive advisory flock, so a second process that opens the same
path fails with a clear error instead of sharing, and corrupting, its slot map.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
from dataclasses import dataclass

from kvstore.device_health import Probe
from kvstore.errors import DeviceError
from kvstore.units import format_size

DATA_FILE = "kvstore.data"
_BLKSSZGET = 0x1268  # ioctl: logical block size of a block device


@dataclass(frozen=True)
class DevicePlan:
    """A device the disk tier should open: a local path, or a resolved NVMe-oF namespace."""

    path: str | None  # None: not present now (an NVMe-oF namespace not connected yet)
    capacity: int
    kind: str = "disk"  # "disk" or "nvmeof": how lookups and info name its chunks
    label: str = ""  # how operators know it (defaults to the path)
    # Whether it is usable now, and where: a namespace can come back under another name.
    probe: Probe | None = None


@dataclass
class Device:
    path: str  # the data file or the block device
    fd: int
    size: int  # bytes kvstore may use on it
    is_block: bool
    logical_block: int

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # also drops the flock
            self.fd = -1


def open_device(path: str, capacity: int, file_name: str = DATA_FILE) -> Device:
    """Open `path` (a directory or a block device) for `capacity` bytes of slots."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise DeviceError(path, "does not exist (and neither does its parent directory)") from None
        _make_dir(path)
        mode = os.stat(path).st_mode
    if stat.S_ISBLK(mode):
        return _open_block(path, capacity)
    if stat.S_ISDIR(mode):
        return _open_file(os.path.join(path, file_name), capacity)
    raise DeviceError(path, "must be a directory or a block device")


def _make_dir(path: str) -> None:
    try:
        os.mkdir(path)
    except OSError as exc:
        raise DeviceError(path, f"cannot create directory: {exc.strerror}") from exc


def _lock(fd: int, path: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DeviceError(path, "in use by another kvstore process (advisory lock held); "
                                "each process needs its own path or file") from None


def _open_file(path: str, capacity: int) -> Device:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise DeviceError(path, f"cannot open for O_DIRECT read/write: {exc.strerror}") from exc
    _lock(fd, path)
    current = os.fstat(fd).st_size
    if current < capacity:
        try:
            os.posix_fallocate(fd, 0, capacity)
        except OSError as exc:
            os.close(fd)
            free = os.statvfs(os.path.dirname(path))
            raise DeviceError(path, f"cannot reserve capacity {format_size(capacity)} "
                                    f"({exc.strerror}); {format_size(free.f_bavail * free.f_frsize)}"
                                    " free") from exc
    return Device(path=path, fd=fd, size=capacity, is_block=False, logical_block=4096)


def _open_block(path: str, capacity: int) -> Device:
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        raise DeviceError(path, f"cannot open block device: {exc.strerror}") from exc
    _lock(fd, path)
    device_size = os.lseek(fd, 0, os.SEEK_END)
    logical = struct.unpack("i", fcntl.ioctl(fd, _BLKSSZGET, b"\0" * 4))[0]
    if capacity > device_size:
        os.close(fd)
        raise DeviceError(path, f"capacity {format_size(capacity)} exceeds the device size "
                                f"{format_size(device_size)}")
    if 4096 % logical:
        os.close(fd)
        raise DeviceError(path, f"logical block size {logical} does not divide 4096")
    return Device(path=path, fd=fd, size=capacity, is_block=True, logical_block=logical)
