"""Read every slot's header block of a device, in batches, and say what each holds.

Recovery (no usable checkpoint), revalidation of a device that comes back, and
`kvstore fsck` all need the same walk; one scanner gives them one set of words for
a slot's state (record.HeaderState: empty, torn, valid) and one I/O pattern
(batches of SCAN_BATCH header reads through the I/O engine, each with a deadline).
Each batch reads into header blocks of a pool (io/staging.py): one a read that missed
its deadline still holds is not read into again before that read lands.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.format.record import HEADER_BLOCK, HeaderState, RecordHeader, parse_header
from kvstore.io.base import IoEngine, IoRequest
from kvstore.io.staging import StagingPool

SCAN_BATCH = 1024  # header blocks read per batch


@dataclass(frozen=True, slots=True)
class ScannedSlot:
    slot: int  # slot number within the device
    state: HeaderState | None  # None: the header read failed (an I/O error or the deadline)
    header: RecordHeader | None  # set when state is VALID


def scan_headers(engine: IoEngine, fd: int, data_offset: int, slot_bytes: int, num_slots: int,
                 timeout_s: float | None) -> Iterator[ScannedSlot]:
    """Every slot of a device in order; each batch of reads has its own deadline."""
    pool = StagingPool(HEADER_BLOCK, min(SCAN_BATCH, max(1, num_slots)))
    try:
        for first in range(0, num_slots, SCAN_BATCH):
            blocks = [pool.acquire() for _ in range(min(SCAN_BATCH, num_slots - first))]
            try:
                requests = [IoRequest(fd, data_offset + (first + i) * slot_bytes, [block])
                            for i, block in enumerate(blocks)]
                for i, result in enumerate(engine.run(requests, timeout_s)):
                    if result != HEADER_BLOCK:
                        yield ScannedSlot(first + i, None, None)
                        continue
                    state, header = parse_header(blocks[i].views[0])
                    yield ScannedSlot(first + i, state, header)
            finally:
                for block in blocks:
                    block.close()
    finally:
        pool.close()
