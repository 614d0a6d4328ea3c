"""`kvstore fsck`: verify every record of a disk-tier path without changing it.

valid   header and payload verify
corrupt header verifies, payload does not (bit rot, a foreign write)
torn    header present but does not verify (a write cut short)
empty   never written, or invalidated on purpose
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections import Counter

from kvstore.aligned import AlignedBuffer
from kvstore.devices import DATA_FILE
from kvstore.disk_layout import Superblock
from kvstore.errors import DeviceError
from kvstore.record import BLOCK, HEADER_BLOCK, HeaderState, check_record, parse_header


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
    fd = os.open(data, os.O_RDONLY | os.O_DIRECT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DeviceError(data, "in use by a running kvstore; stop it first") from None
        block = AlignedBuffer(BLOCK)
        os.preadv(fd, [block.view[:BLOCK]], 0)
        superblock = Superblock.unpack(bytes(block.view[:BLOCK]), data)
        block.close()
        if superblock is None:
            raise DeviceError(data, "not formatted (no kvstore superblock)")
        return _check_slots(fd, superblock)
    finally:
        os.close(fd)


def _check_slots(fd: int, superblock: Superblock) -> dict[str, int]:
    counts: Counter[str] = Counter()
    buffer = AlignedBuffer(superblock.slot_bytes)
    view = buffer.view[: superblock.slot_bytes]
    for slot in range(superblock.num_slots):
        offset = superblock.data_offset + slot * superblock.slot_bytes
        if os.preadv(fd, [view[:HEADER_BLOCK]], offset) != HEADER_BLOCK:
            counts["torn"] += 1
            continue
        state, _ = parse_header(view)
        if state is not HeaderState.VALID:
            counts[state.value] += 1
            continue
        os.preadv(fd, [view[HEADER_BLOCK:]], offset + HEADER_BLOCK)
        _, reason = check_record(view[:HEADER_BLOCK], view[HEADER_BLOCK:], None)
        counts["valid" if reason is None else "corrupt"] += 1
    del view
    buffer.close()
    return {name: counts[name] for name in ("valid", "corrupt", "torn", "empty")}
