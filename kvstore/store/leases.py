"""DRAM pins held across requests, for readers that copy out of the shared DRAM tier themselves.

An engine worker that maps the service's DRAM tier (tiers/dram.py) loads a hit with one
copy from the slot into its KV blocks; a disk hit is first read into a DRAM slot (the
promotion a get would make anyway) and loaded from there. For that copy the slot must
hold the chunk from before it starts until after it ends, although the service's part
of the read (the key and length check under the pin) is over before the copy begins:
so the pin outlives the request as a `Lease`, released by the client's next request or,
if the client dies, by the service when its connection ends. Invariants: a leased slot is pinned (never
evicted, rewritten or reused); every slot of a lease is unpinned exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.format.record import MissReason
from kvstore.store.edge import check_keys
from kvstore.store.tiered import TieredStore


@dataclass
class Lease:
    """Pinned DRAM slots; `offsets[i]` is where chunk i's payload starts in the tier's
    memory, -1 for a chunk not pinned (absent from DRAM, or not the record asked for)."""

    slots: list[int]
    offsets: list[int]
    released: bool = field(default=False, compare=False)


def pin(store: TieredStore, keys: Sequence[bytes]) -> Lease:
    """Pin each of `keys` found in DRAM whose slot holds that very record (key and length;
    its checksums were verified when it entered DRAM), as a get would serve it. With
    promote_on_hit, the disk hits among the rest are read into DRAM slots first, verified
    there, and pinned as they are published: one DMA from the disk, one copy out."""
    keys = check_keys(keys)
    offsets = [-1] * len(keys)
    parts = store.parts
    dram = parts.dram
    if dram is None:
        return Lease([], offsets)
    parts.touch(keys)  # first: promoting this prompt's chunks never evicts its own
    slots = []
    with dram.table.pinned(keys) as pins:
        for i, slot in pins.hits:
            if dram.payload(slot, keys[i], store.chunk_bytes) is None:
                store.stats.miss("host", MissReason.WRONG_KEY, f"slot {slot}")
                pins.drop(keys[i], slot)
                continue
            pins.keep(slot)  # the pin passes to the lease
            slots.append(slot)
            offsets[i] = dram.payload_offset(slot)
    in_dram = [key for key, offset in zip(keys, offsets, strict=True) if offset >= 0]
    held: dict[int, int] = {}
    if parts.reader is not None and parts.disk is not None and parts.policy.promote_on_hit:
        missing = [i for i, offset in enumerate(offsets) if offset < 0]
        with parts.disk.table.pinned(keys, missing) as disk_pins:
            parts.reader.read(keys, disk_pins, None, True, [False] * len(keys), held=held)
        for i, slot in held.items():
            slots.append(slot)
            offsets[i] = dram.payload_offset(slot)
        parts.touch(keys)  # again: promoted chunks join their chain tail-older-than-head
    served = [key for key, offset in zip(keys, offsets, strict=True) if offset >= 0]
    parts.policy.seen(served)
    parts.ledger.read(in_dram)
    for name, amount in (("get.chunks", len(served)), ("get.hits", len(served)),
                         ("host.hits", len(in_dram)), ("host.leased", len(served)),
                         ("host.bytes_read", len(in_dram) * store.chunk_bytes)):
        store.stats.add(name, amount)
    return Lease(slots, offsets)


def release(store: TieredStore, lease: Lease) -> None:
    """Unpin a lease's slots (once: a second release does nothing)."""
    if lease.released:
        return
    lease.released = True
    dram = store.parts.dram
    if dram is not None:
        for slot in lease.slots:
            dram.table.unpin(slot)
