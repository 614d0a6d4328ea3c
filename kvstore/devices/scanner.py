"""Read every slot's header block of a device, in batches, and say what each holds.

Recovery (no usable checkpoint), revalidation of a device that comes back, and
`kvstore fsck` all need the same walk; one scanner gives them one set of words for
a slot's state (record.HeaderState: empty, torn, valid) and one I/O pattern
(batches of SCAN_BATCH header reads through the I/O engine, each with a deadline).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.format.record import HEADER_BLOCK, HeaderState, RecordHeader, parse_header
from kvstore.io.aligned import AlignedBuffer
from kvstore.io.base import IoEngine, IoRequest

SCAN_BATCH = 1024  # header blocks read per batch


@dataclass(frozen=True, slots=True)
class ScannedSlot:
    slot: int  # slot number within the device
    state: HeaderState | None  # None: the header read failed (an I/O error or the deadline)
    header: RecordHeader | None  # set when state is VALID


def scan_headers(engine: IoEngine, fd: int, data_offset: int, slot_bytes: int, num_slots: int,
                 timeout_s: float | None) -> Iterator[ScannedSlot]:
    """Every slot of a device in order; each batch of reads has its own deadline."""
    buffer = AlignedBuffer(SCAN_BATCH * HEADER_BLOCK)
    views = [buffer.view[i * HEADER_BLOCK : (i + 1) * HEADER_BLOCK] for i in range(SCAN_BATCH)]
    try:
        for first in range(0, num_slots, SCAN_BATCH):
            count = min(SCAN_BATCH, num_slots - first)
            requests = [IoRequest(fd, data_offset + (first + i) * slot_bytes, [views[i]])
                        for i in range(count)]
            results = engine.run(requests, timeout_s)
            for i, result in enumerate(results):
                if result != HEADER_BLOCK:
                    yield ScannedSlot(first + i, None, None)
                    continue
                state, header = parse_header(views[i])
                yield ScannedSlot(first + i, state, header)
    finally:
        views.clear()
        buffer.close()
