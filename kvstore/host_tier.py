"""The DRAM tier: one aligned slab carved into record-sized slots.

A slot holds the exact record image that goes to disk (header block + payload),
so demotion is one write straight from the slab and promotion one read into it,
with no re-encoding. The slab is private anonymous memory (transparent huge pages
asked for, so a disk read into a slot stays one request). It is not registered with
CUDA: engines copy to the device from their own windows, never from the slab.
"""

from __future__ import annotations

from kvstore.aligned import AlignedBuffer, copy_bytes
from kvstore.errors import ConfigError
from kvstore.record import (
    HEADER_BLOCK,
    KEY_OFFSET,
    RecordHeader,
    pack_header,
    read_payload_len,
)
from kvstore.slots import SlotTable
from kvstore.units import format_size


class HostTier:
    name = "host"

    def __init__(self, capacity: int, slot_bytes: int) -> None:
        num_slots = capacity // slot_bytes
        if num_slots == 0:
            raise ConfigError("tiers.host.capacity", format_size(capacity),
                              f"smaller than one record slot ({format_size(slot_bytes)})")
        self.slot_bytes = slot_bytes
        try:
            self.slab = AlignedBuffer(num_slots * slot_bytes)
        except OSError as exc:
            raise ConfigError("tiers.host.capacity", format_size(capacity),
                              f"cannot allocate it: {exc.strerror or exc}") from exc
        self.table = SlotTable([num_slots])

    def slot_view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return self.slab.view[start : start + self.slot_bytes]

    def write(self, slot: int, header: RecordHeader, payload: memoryview) -> None:
        """Fill a reserved slot with a record (caller holds no lock: this is a copy)."""
        view = self.slot_view(slot)
        pack_header(header, view)
        copy_bytes(view[HEADER_BLOCK : HEADER_BLOCK + len(payload)], payload)

    def read(self, slot: int, key: bytes, out: memoryview) -> bool:
        """Copy a pinned slot's payload to `out`; False if the slot holds something else.

        Only the key and length are checked: the header and payload checksums were
        computed from, or verified against, these very bytes when they entered the
        slab, and a DRAM get must stay close to memcpy speed for small chunks.
        """
        view = self.slot_view(slot)
        if view[KEY_OFFSET : KEY_OFFSET + len(key)] != key or read_payload_len(view) != len(out):
            return False
        copy_bytes(out, view[HEADER_BLOCK : HEADER_BLOCK + len(out)])
        return True

    def close(self) -> None:
        self.slab.close()
