"""A disk tier's records as they lie in its data file: read their headers, find a
prompt's last chunk, flip a payload byte (bench/support/records.py, the benchmarks' too:
the bytes a reader must then refuse), turn the tier into one an older kvstore left."""

from __future__ import annotations

import os
import struct

import xxhash

from bench.support.records import corrupt_record, valid_records
from kvstore.devices.device import DATA_FILE
from kvstore.devices.layout import SB_COPIES
from kvstore.format.record import BLOCK, HEADER_LEN, RecordHeader

__all__ = ["as_older_format", "corrupt_record", "disk_records", "newest_chain_end"]

SUPERBLOCK_BODY = 80  # the superblock's checksummed bytes (docs/architecture.md)


def disk_records(directory: str) -> list[RecordHeader]:
    """The headers of the valid records in a disk tier's data file, in slot order."""
    with open(os.path.join(directory, DATA_FILE), "rb") as f:
        return [header for _, header in valid_records(f)]


def newest_chain_end(directory: str) -> bytes:
    """The key of the newest record (highest sequence number) that no record names as its
    parent, in a disk tier's data file: a last chunk of the prompt stored last."""
    headers = disk_records(directory)
    parents = {header.parent for header in headers}
    return max((h for h in headers if h.key not in parents), key=lambda h: h.seq).key


def chain_position(directory: str, key: bytes) -> int:
    """How many records precede `key`'s in its chain in a disk tier's data file (its
    parent, that one's, and so on while they are there)."""
    by_key = {header.key: header for header in disk_records(directory)}
    count, parent = 0, by_key[key].parent
    while parent in by_key:
        count, parent = count + 1, by_key[parent].parent
    return count


def as_older_format(directory: str, superblock_version: int = 2, record_version: int = 1) -> int:
    """Rewrite a disk tier's data file as an older kvstore left it: each superblock copy and
    each valid record header with the older version number and a checksum that verifies
    (the bytes are otherwise this version's). Returns the records rewritten."""
    with open(os.path.join(directory, DATA_FILE), "r+b") as f:
        records = list(valid_records(f))
        for offset, _ in records:
            _set_version(f, offset, HEADER_LEN - 8, record_version)
        for copy in range(SB_COPIES):
            _set_version(f, copy * BLOCK, SUPERBLOCK_BODY, superblock_version)
    return len(records)


def _set_version(f, offset: int, body: int, version: int) -> None:
    """The u16 version at offset 4 of a checksummed block, and the xxh3-64 after its body."""
    f.seek(offset)
    block = bytearray(f.read(body))
    struct.pack_into("<H", block, 4, version)
    f.seek(offset)
    f.write(bytes(block) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(block))))
