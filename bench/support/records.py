"""A disk tier's records as they lie in its data file: each valid record found by its
header, and one payload byte flipped (the bytes a reader must then refuse), for the tests
and for the benchmarks that show what a tier does with a damaged chunk."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import BinaryIO

from kvstore.devices.device import DATA_FILE
from kvstore.devices.layout import parse_superblock
from kvstore.format.record import HEADER_BLOCK, HeaderState, RecordHeader, parse_header


def valid_records(f: BinaryIO) -> Iterator[tuple[int, RecordHeader]]:
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


def corrupt_record(directory: str, payload_byte: int | None = None, key: bytes | None = None) -> None:
    """Flip one payload byte of the first valid record in a disk tier's data file (with
    `payload_byte`: of the first whose payload holds that byte where the flip goes; with
    `key`: of the record of that chunk key)."""
    with open(os.path.join(directory, DATA_FILE), "r+b") as f:
        for offset, header in list(valid_records(f)):
            f.seek(offset + HEADER_BLOCK + 1000)
            byte = f.read(1)
            if payload_byte in (None, byte[0]) and key in (None, header.key):
                f.seek(offset + HEADER_BLOCK + 1000)
                f.write(bytes([byte[0] ^ 0xFF]))
                return
    raise AssertionError("no record found to corrupt")
