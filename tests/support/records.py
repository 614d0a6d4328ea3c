"""A disk tier's records as they lie in its data file: read their headers, find a
prompt's last chunk, flip a payload byte (the bytes a reader must then refuse)."""

from __future__ import annotations

import os
from collections.abc import Iterator

from kvstore.devices.device import DATA_FILE
from kvstore.devices.layout import parse_superblock
from kvstore.format.record import HEADER_BLOCK, HeaderState, RecordHeader, parse_header


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
