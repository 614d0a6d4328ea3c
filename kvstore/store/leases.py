"""DRAM pins held across requests, for readers that copy out of the shared DRAM tier themselves.

An engine worker that maps the service's DRAM tier (tiers/dram.py) loads a hit with one
copy from the slot into its KV blocks; a disk hit is first read into a DRAM slot (the
promotion a get would make anyway) and loaded from there. For that copy the slot must
hold the chunk from before it starts until after it ends, although the service's part
of the read (the key and length check under the pin) is over before the copy begins:
so the pin outlives the request as a `Lease`, released by the client's next request or,
if the client dies, by the service when its connection ends. The pins are taken by the
store's one read path (store/reads.py), as a get's are. Invariants: a leased slot is
pinned (never evicted, rewritten or reused); every slot of a lease is unpinned exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.store.parts import StoreParts
from kvstore.store.reads import Reads


@dataclass
class Lease:
    """Pinned DRAM slots; `offsets[i]` is where chunk i's payload starts in the tier's
    memory, -1 for a chunk not pinned (absent from DRAM, or not the record asked for)."""

    slots: list[int]
    offsets: list[int]
    released: bool = field(default=False, compare=False)


def pin(parts: StoreParts, reads: Reads, keys: list[bytes], from_disk: bool = True) -> Lease:
    """Pin each of checked `keys` a get would serve from DRAM (key and length checked under
    the pin; its checksums were verified when it entered DRAM), through the store's read
    path (store/reads.py `Reads.pin`): with `from_disk` and promote_on_hit, the disk hits
    among the rest are read into DRAM slots first, verified there, and pinned as they are
    published: one DMA from the disk, one copy out."""
    held = reads.pin(keys, from_disk)
    offsets = [-1] * len(keys)
    if parts.dram is not None:
        for i, slot in held.items():
            offsets[i] = parts.dram.payload_offset(slot)
    return Lease(list(held.values()), offsets)


def release(parts: StoreParts, lease: Lease) -> None:
    """Unpin a lease's slots (once: a second release does nothing)."""
    if lease.released:
        return
    lease.released = True
    if parts.dram is not None:
        for slot in lease.slots:
            parts.dram.table.unpin(slot)
