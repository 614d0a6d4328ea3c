"""The disk tier: record slots striped over devices, read and written with O_DIRECT.

Write order makes a valid header imply a complete payload: for a slot that may hold
an earlier record, its old header is zeroed first; then the payload is written; the
header goes last. A crash at any point leaves either an empty slot, the old record
intact, or a header-less new payload: never a valid header over wrong bytes. Reads
still verify the payload checksum (bit rot, foreign writers). Memory goes to the engine
as IoBuffers (io/base.py): a write timed out still holds its record image, and the
zeroed header block stays mapped past `close` while a write of it is out.

What lives elsewhere: which device holds which slot (device_set.py), whether a
device serves (availability.py), rebuilding the index at start (recover.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from kvstore.devices.device import DevicePlan
from kvstore.devices.device_set import DeviceSet
from kvstore.devices.health import OFFLINE
from kvstore.format.record import HEADER_BLOCK, invalidate_header, round_up
from kvstore.io.aligned import AlignedBuffer
from kvstore.io.base import IoBuffer, IoEngine, IoRequest
from kvstore.tiers.availability import DeviceAvailability
from kvstore.tiers.recover import checkpoint
from kvstore.tiers.slots import DiskSlotTable
from kvstore.tiers.stats import Stats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DiskWrite:
    """One record to write: `image` is header block + payload, aligned."""

    slot: int
    image: IoBuffer
    payload_len: int


class DiskTier:
    name = "disk"

    def __init__(self, plans: Sequence[DevicePlan], slot_bytes: int, chunk_bytes: int,
                 engine: IoEngine, *, stats: Stats, timeout_s: float,
                 breaker_threshold: int = 3) -> None:
        self.slot_bytes = slot_bytes
        self.chunk_bytes = chunk_bytes
        self.engine = engine
        self.stats = stats
        self.timeout_s = timeout_s
        self.devices = DeviceSet(plans, engine, slot_bytes, chunk_bytes, timeout_s)
        self.table = DiskSlotTable(self.devices.group_sizes())
        self.availability = DeviceAvailability(self, breaker_threshold)
        zero_header = AlignedBuffer(HEADER_BLOCK)
        invalidate_header(zero_header.view)
        self._zero_header = IoBuffer([zero_header.view], lambda _: zero_header.close())
        for group, layout in enumerate(self.devices.layouts):
            if layout is None:  # served once it appears (devices/watch.py)
                self.availability.take_out(group, OFFLINE, "not present at start-up")

    def locate(self, slot: int) -> tuple[int, int]:
        """(fd, byte offset) of a slot."""
        return self.devices.locate(*self.table.groups.of(slot))

    def kind_of(self, slot: int) -> str:
        return self.devices.plans[self.table.groups.of(slot)[0]].kind

    def describe(self, slot: int) -> str:
        """Where a slot lives, for log lines an operator can act on."""
        group, local = self.table.groups.of(slot)
        return f"slot {local} of {self.devices.devices[group].path}"

    def read(self, slots: Sequence[int], memory: Sequence[Sequence[IoBuffer]], timeout_s: float,
             on_complete: Callable[[int, int], None] | None = None) -> list[int]:
        """Read whole slots, each into its aligned memory (header block first); results
        as the engine gives them, fed to each device's breaker."""
        requests = [IoRequest(*self.locate(slot), buffers)
                    for slot, buffers in zip(slots, memory, strict=True)]
        results = self.engine.run(requests, timeout_s, on_complete)
        self.availability.account(slots, results, [r.nbytes for r in requests])
        return results

    def write(self, writes: Sequence[DiskWrite], timeout_s: float) -> list[bool]:
        """Write records into reserved slots in the crash-safe order; True per success. A
        write that timed out may still land: its slot is held until it has (`_held`)."""
        ok = [True] * len(writes)
        phases: list[list[tuple[int, IoRequest]]] = [[], [], []]
        with ExitStack() as holds:
            for i, write in enumerate(writes):
                fd, offset = self.locate(write.slot)
                held = holds.enter_context(self._held(write.slot))
                if self.table.mark_written(write.slot):
                    phases[0].append((i, IoRequest(fd, offset, [self._zero_header, held], write=True)))
                image = write.image.views[0]
                payload = image[HEADER_BLOCK : HEADER_BLOCK + round_up(write.payload_len)]
                phases[1].append((i, IoRequest(fd, offset + HEADER_BLOCK, [write.image, held], True,
                                               [payload])))
                phases[2].append((i, IoRequest(fd, offset, [write.image, held], True,
                                               [image[:HEADER_BLOCK]])))
            for phase in phases:
                pending = [(i, req) for i, req in phase if ok[i]]
                results = self.engine.run([req for _, req in pending], timeout_s)
                self.availability.account([writes[i].slot for i, _ in pending], results,
                                          [r.nbytes for _, r in pending])
                for (i, req), result in zip(pending, results, strict=True):
                    if result != req.nbytes:
                        ok[i] = False
        return ok

    def checkpoint(self) -> None:
        """A clean shutdown's index of each device in service (recover.checkpoint)."""
        checkpoint(self, self.availability.health)

    def zero_headers(self, slots: Sequence[int], timeout_s: float, pinned: bool = False) -> list[bool]:
        """Zero slots' headers so a restart does not bring their records back. Slots the
        caller holds `pinned` stay held until their zeroing lands, as a write's do (`_held`:
        one that timed out may land later); others are out of service or not serving yet."""
        with ExitStack() as holds:
            requests = [IoRequest(*self.locate(slot), [self._zero_header, *(
                [holds.enter_context(self._held(slot))] if pinned else [])], write=True) for slot in slots]
            return [result == HEADER_BLOCK for result in self.engine.run(requests, timeout_s)]

    @contextmanager
    def _held(self, slot: int) -> Iterator[IoBuffer]:
        """A hold on a disk slot the caller holds pinned (reserved, or published), lent to
        each request that writes it: the slot is not freed (nor reserved again) until this
        body ends and every one of those requests has landed, so a write that timed out and
        lands later never lands on another record (memory is protected so too: io/base.py)."""
        self.table.pin(slot)
        hold = IoBuffer([], lambda _: self.table.unpin(slot))
        try:
            yield hold
        finally:
            hold.close()

    def remove(self, key: bytes) -> bool | None:
        """Take a record off the disk: its header zeroed, so a restart does not bring it back,
        then out of the index. None: not here; False: its header could not be zeroed, so it
        stays, still served (what is indexed is what a restart would find; counted and logged).
        A device out of service now is told to zero its copy when it comes back."""
        self.availability.forget([key])
        with self.table.pinned([key]) as pins:
            if not pins.hits:
                self.availability.forget([key])  # again: its device may have left meanwhile
            for _, slot in pins.hits:
                if self.zero_headers([slot], self.timeout_s, pinned=True)[0]:
                    pins.drop(key, slot)
                    return True
                self.stats.add("disk.delete_failed")
                log.warning("could not zero the header of %s; the record stays", self.describe(slot))
                return False
        return None

    def used_bytes(self) -> int:
        return len(self.table) * self.slot_bytes

    def capacity_bytes(self) -> int:
        return self.table.capacity * self.slot_bytes

    def info(self) -> dict[str, Any]:
        """This tier as `kvstore info` prints it, each device with its health."""
        devices = self.devices.devices
        return {"name": "disk", "chunks": len(self.table), "capacity_bytes": self.capacity_bytes(),
                "used_bytes": self.used_bytes(), "paths": [d.path for d in devices],
                "devices": [{"path": d.path, **h.describe()}
                            for d, h in zip(devices, self.availability.health, strict=True)]}

    def close(self) -> None:
        self._zero_header.close()
        self.devices.close()
