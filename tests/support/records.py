"""A disk tier's records as they lie in its data file: read their headers, find a
prompt's last chunk, flip a payload byte (the bytes a reader must then refuse), turn the
tier into one an older kvstore left."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

import xxhash

from kvstore.devices.device import DATA_FILE
from kvstore.devices.layout import SB_COPIES, parse_superblock
from kvstore.format.record import BLOCK, HEADER_BLOCK, HEADER_LEN, HeaderState, RecordHeader, parse_header

SUPERBLOCK_BODY = 80  # the superblock's checksummed bytes (docs/architecture.md)


def _valid_records(f) -> Iterator[tuple[int, RecordHeader]]:
    """(offset, header) of each valid record in an open disk-tier data file, in slot order."""
    f.seek(0)
    _, superblock = parse_superblock(f.read(4096))
    assert superblock is not None
    for slot in range(superblock.num_slots):
        offset = superblock.data_offset + slot * superblock.slot_bytes
        f.seek(offset)
        state, header = parse_header(f.read(HEADER_BLOCK))
        if state is HeaderState.VALID and header is not None:
            yield offset, header


def disk_records(directory: str) -> list[RecordHeader]:
    """The headers of the valid records in a disk tier's data file, in slot order."""
    with open(os.path.join(directory, DATA_FILE), "rb") as f:
        return [header for _, header in _valid_records(f)]


def newest_chain_end(directory: str) -> bytes:
    """The key of the newest record (highest sequence number) that no record names as its
    parent, in a disk tier's data file: a last chunk of the prompt stored last."""
    headers = disk_records(directory)
    parents = {header.parent for header in headers}
    return max((h for h in headers if h.key not in parents), key=lambda h: h.seq).key


def corrupt_record(directory: str, payload_byte: int | None = None, key: bytes | None = None) -> None:
    """Flip one payload byte of the first valid record in a disk tier's data file (with
    `payload_byte`: of the first whose payload holds that byte where the flip goes; with
    `key`: of the record of that chunk key)."""
    with open(os.path.join(directory, DATA_FILE), "r+b") as f:
        for offset, header in list(_valid_records(f)):
            f.seek(offset + HEADER_BLOCK + 1000)
            byte = f.read(1)
            if payload_byte in (None, byte[0]) and key in (None, header.key):
                f.seek(offset + HEADER_BLOCK + 1000)
                f.write(bytes([byte[0] ^ 0xFF]))
                return
    raise AssertionError("no record found to corrupt")


def as_older_format(directory: str, superblock_version: int = 2, record_version: int = 1) -> int:
    """Rewrite a disk tier's data file as an older kvstore left it: each superblock copy and
    each valid record header with the older version number and a checksum that verifies
    (the bytes are otherwise this version's). Returns the records rewritten."""
    with open(os.path.join(directory, DATA_FILE), "r+b") as f:
        records = list(_valid_records(f))
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
