"""Where disk-tier bytes live: a preallocated file in a directory, or a block device.

Each is opened with O_DIRECT (no page cache: the DRAM tier is our cache) and
locked with an exclusive advisory flock (devices/lock.py), so a second process that
opens the same path fails with a clear error instead of sharing, and corrupting, its
slot map.

Cached KV reveals the prompts it came from, and a record someone else can write is
a record someone else chose. So a tier directory must be ours and writable by no
one else; the data file is created 0600 without following links (O_EXCL |
O_NOFOLLOW), and an existing one must be a regular file of ours that no one else
can read or write. Block devices are opened exclusively (O_EXCL: not if mounted).

Another host's device (a peer's, on the shared array) is opened read-only and never
locked (`open_read_only`): its owner holds the exclusive flock (and O_EXCL on a block
device), which a read-only open neither needs nor disturbs.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
from dataclasses import dataclass

from kvstore.devices.health import Probe
from kvstore.devices.lock import lock_exclusive
from kvstore.format.errors import DeviceError
from kvstore.format.units import format_size

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


def path_problem(path: str) -> str | None:
    """Why `path` cannot be a disk-tier path for this user, or None. Checked at start-up
    (naming the config field) and again when the device is opened."""
    try:
        st = os.stat(path)
    except NotADirectoryError:
        return "does not exist, and its parent is not a directory"
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            return "does not exist, and its parent is not a directory"
        if not os.access(parent, os.W_OK):
            return "does not exist, and its parent is not writable"
        return None
    if stat.S_ISBLK(st.st_mode):
        return None if os.access(path, os.R_OK | os.W_OK) else "block device not readable and writable"
    if not stat.S_ISDIR(st.st_mode):
        return "must be a directory or a block device"
    return _private_dir_problem(st) or (None if os.access(path, os.W_OK) else "not writable by this user")


def _private_dir_problem(st: os.stat_result) -> str | None:
    if st.st_uid != os.geteuid():
        return (f"owned by uid {st.st_uid}, not this user ({os.geteuid()}): its owner could read "
                "the cached KV or swap the data file")
    if st.st_mode & 0o022:
        return (f"mode {stat.S_IMODE(st.st_mode):04o} lets others write in it (chmod go-w): they "
                "could swap the data file")
    return None


def open_device(path: str, capacity: int) -> Device:
    """Open `path` (a directory or a block device) for `capacity` bytes of slots."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise DeviceError(path, "does not exist (and its parent is not a directory)") from None
        try:
            os.mkdir(path, 0o700)
        except OSError as exc:
            raise DeviceError(path, f"cannot create directory: {exc.strerror}") from exc
        st = os.stat(path)
    if stat.S_ISBLK(st.st_mode):
        return _open_block(path, capacity)
    if not stat.S_ISDIR(st.st_mode):
        raise DeviceError(path, "must be a directory or a block device")
    problem = _private_dir_problem(st)
    if problem:
        raise DeviceError(path, problem)
    return _open_file(os.path.join(path, DATA_FILE), capacity)


def open_read_only(path: str) -> Device:
    """Open another host's device (a directory's data file, or a block device) to read its
    records: O_RDONLY | O_DIRECT, never through a link, never locked, never created."""
    if os.path.isdir(path):
        path = os.path.join(path, DATA_FILE)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise DeviceError(path, f"cannot open read-only: {exc.strerror}") from exc
    mode = os.fstat(fd).st_mode
    if not (stat.S_ISREG(mode) or stat.S_ISBLK(mode)):
        os.close(fd)
        raise DeviceError(path, "is not a regular file or a block device")
    return Device(path=path, fd=fd, size=os.lseek(fd, 0, os.SEEK_END), is_block=stat.S_ISBLK(mode),
                  logical_block=4096)


def _open_file(path: str, capacity: int) -> Device:
    flags = os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            fd = os.open(path, flags)
    except OSError as exc:
        why = "is a symbolic link (refused)" if exc.errno == errno.ELOOP else \
            f"cannot open for O_DIRECT read/write: {exc.strerror}"
        raise DeviceError(path, why) from exc
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = (f"owned by uid {st.st_uid}, not this user ({os.geteuid()}): its owner could "
                   "read the cached KV and rewrite records")
    elif st.st_mode & 0o077:
        problem = (f"mode {stat.S_IMODE(st.st_mode):04o} lets others read or write it (chmod 600 "
                   "it): cached KV reveals prompts")
    if problem:
        os.close(fd)
        raise DeviceError(path, problem)
    lock_exclusive(fd, path)
    if st.st_size < capacity:
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
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC | os.O_EXCL)
    except OSError as exc:
        why = "in use (mounted, or held open exclusively by another program)" \
            if exc.errno == errno.EBUSY else f"cannot open block device: {exc.strerror}"
        raise DeviceError(path, why) from exc
    lock_exclusive(fd, path)
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
