"""`kvstore fsck`: verify every record of a disk-tier path without changing it.

valid   header and payload verify
corrupt header verifies, payload does not (bit rot, a foreign write)
torn    header present but does not verify (a write cut short), or unreadable
empty   never written, or invalidated on purpose
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections import Counter

from kvstore.devices.device import DATA_FILE
from kvstore.devices.layout import Superblock, read_superblocks
from kvstore.devices.scanner import scan_headers
from kvstore.format.errors import DeviceError
from kvstore.format.record import HEADER_BLOCK, HeaderState, check_record
from kvstore.io.aligned import AlignedBuffer
from kvstore.io.threads import ThreadsEngine

_TIMEOUT_S = 60.0


def resolve_data_path(path: str) -> str:
    """A directory means its data file; a file or block device is taken as is."""
    if not os.path.exists(path):
        raise DeviceError(path, "does not exist")
    if stat.S_ISDIR(os.stat(path).st_mode):
        data = os.path.join(path, DATA_FILE)
        if not os.path.exists(data):
            raise DeviceError(path, f"holds no {DATA_FILE}: not a kvstore disk-tier directory")
        return data
    return path


def fsck(path: str) -> dict[str, int]:
    data = resolve_data_path(path)
    fd = os.open(data, os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW)
    engine = ThreadsEngine(8)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DeviceError(data, "in use by a running kvstore; stop it first") from None
        return _check_slots(engine, fd, _superblock(engine, fd, data))
    finally:
        engine.close()
        os.close(fd)


def _superblock(engine: ThreadsEngine, fd: int, path: str) -> Superblock:
    """The first copy that parses, read by the one superblock reader a running store uses."""
    found = next((sb for _, sb in read_superblocks(engine, fd, path, _TIMEOUT_S) if sb is not None), None)
    if found is None:
        raise DeviceError(path, "no valid kvstore superblock (not formatted, another format, or damaged)")
    return found


def _check_slots(engine: ThreadsEngine, fd: int, sb: Superblock) -> dict[str, int]:
    counts: Counter[str] = Counter()
    buffer = AlignedBuffer(sb.slot_bytes)
    view = buffer.view[: sb.slot_bytes]
    try:
        for scanned in scan_headers(engine, fd, sb.data_offset, sb.slot_bytes, sb.num_slots, _TIMEOUT_S):
            if scanned.state is None:
                counts["torn"] += 1
            elif scanned.state is not HeaderState.VALID:
                counts[scanned.state.value] += 1
            else:
                offset = sb.data_offset + scanned.slot * sb.slot_bytes
                read = os.preadv(fd, [view], offset)
                _, reason = check_record(view[:HEADER_BLOCK], view[HEADER_BLOCK:read], None)
                counts["valid" if reason is None and read == sb.slot_bytes else "corrupt"] += 1
    finally:
        view.release()
        buffer.close()
    return {name: counts[name] for name in ("valid", "corrupt", "torn", "empty")}
