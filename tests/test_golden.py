"""On-disk bytes pinned down: a record header and a superblock packed from fixed inputs
must equal the bytes checked in under tests/golden/. A change to either format (or to
the offsets the DRAM fast path reads without parsing) shows up here, not in a user's
tier that no longer opens."""

from __future__ import annotations

from pathlib import Path

from kvstore.devices.layout import CheckpointMark, Superblock, parse_superblock
from kvstore.format.record import (
    HEADER_BLOCK,
    HEADER_LEN,
    KEY_OFFSET,
    HeaderState,
    RecordHeader,
    TensorSpec,
    pack_header,
    parse_header,
    payload_checksum,
    read_payload_len,
)

GOLDEN = Path(__file__).parent / "golden"
PAYLOAD = bytes(range(256)) * 16
HEADER = RecordHeader(key=bytes(range(16)), namespace=bytes(range(16, 32)), parent=bytes(range(32, 48)),
                      seq=7, payload_len=len(PAYLOAD), payload_checksum=payload_checksum(PAYLOAD),
                      tensor=TensorSpec("float16", (2, 8, 128)))
SUPERBLOCK = Superblock(slot_bytes=69632, num_slots=10, data_offset=12288, chunk_bytes=65536,
                        checkpoint=CheckpointMark(clean=True, entries=3, checksum=0x1234),
                        device_id=bytes(range(16)))


def _golden(name: str) -> bytes:
    return bytes.fromhex((GOLDEN / name).read_text().strip())


def test_a_record_header_packs_to_the_checked_in_bytes():
    block = memoryview(bytearray(HEADER_BLOCK))
    pack_header(HEADER, block)
    assert bytes(block[:HEADER_LEN]) == _golden("record_header.hex")
    assert not any(block[HEADER_LEN:])
    assert parse_header(block) == (HeaderState.VALID, HEADER)


def test_the_dram_fast_path_offsets_match_the_format():
    golden = _golden("record_header.hex")
    assert golden[KEY_OFFSET : KEY_OFFSET + 16] == HEADER.key
    assert read_payload_len(memoryview(golden)) == len(PAYLOAD)


def test_a_superblock_packs_to_the_checked_in_bytes():
    packed = SUPERBLOCK.pack()
    golden = _golden("superblock.hex")
    assert packed[: len(golden)] == golden and not any(packed[len(golden) :])
    assert parse_superblock(packed)[1] == SUPERBLOCK
