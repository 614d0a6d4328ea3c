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

A disk hit leased for a reader that verifies it as it copies it (`verify=False`: one pass
over its bytes, not a hash in the service and a copy in the engine) lands in a DRAM slot
unpublished and unverified (`Lease.unchecked`, `checks[i]`: the checksum its payload must
have); at the release its reader names those it verified (`good`: published in DRAM,
promoted as a verified read would have been) and those that failed (`bad`: dropped from
DRAM and from the disk's index and counted, as a record that does not verify always is);
any other goes back unpublished (its record stays on disk, to be read and verified
again): a reader that failed half-way, or left, publishes nothing it did not check. Only
the service's own user's engines may lease so (the service acts on their word).

A lease taken before anyone knows whether it will be read (a scheduler's lookup leases
what its workers may load) counts its chunks as gets only when its release says its load
was carried out (`gets_due`); one given back unread counts them as `lease.unread`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kvstore.datapath.reader import Unchecked
from kvstore.format.record import MissReason
from kvstore.store.edge import check_keys
from kvstore.store.parts import StoreParts
from kvstore.store.reads import Reads, count_gets


@dataclass
class Lease:
    """Pinned DRAM slots; `offsets[i]` is where chunk i's payload starts in the tier's
    memory, -1 for a chunk not pinned (absent from DRAM, or not the record asked for);
    `checks[i]` the checksum chunk i's payload must have where nobody verified it yet
    (None: verified), and `unchecked` how to settle those."""

    slots: list[int]
    offsets: list[int]
    keys: list[bytes] = field(default_factory=list)
    checks: list[int | None] = field(default_factory=list)
    unchecked: dict[int, Unchecked] = field(default_factory=dict)
    released: bool = field(default=False, compare=False)
    gets_due: int = 0  # chunks served and not counted as gets yet: counted if released read

    @property
    def pinned(self) -> int:
        """DRAM slots it holds, verified or not."""
        return len(self.slots) + len(self.unchecked)


class SharedDram:
    """The store's face to engines that map its DRAM tier and copy chunks out of it
    themselves (the service hands it to its clients): the tier's descriptor, and leases on
    its slots. Reached as `TieredStore.shared_dram`."""

    def __init__(self, parts: StoreParts, reads: Reads) -> None:
        self._parts = parts
        self._reads = reads

    def share(self) -> tuple[int, int, str] | None:
        """(a new read-only descriptor of the DRAM tier, for a client that copies leased
        chunks out of it: the caller closes it; its bytes; its page kind), or None when the
        tier is not shared."""
        dram = self._parts.dram
        return dram.share() if dram is not None else None

    def lease(self, keys: Sequence[bytes], from_disk: bool = True, verify: bool = True,
              as_get: bool = True) -> Lease:
        """Pin each of `keys` a get would serve from DRAM (key and length checked under
        the pin; its checksums were verified when it entered DRAM), through the store's read
        path (store/reads.py `Reads.pin`), until `release`: with `from_disk` and
        promote_on_hit, the disk hits among the rest are read into DRAM slots first,
        verified there, and pinned as they are published: one DMA from the disk, one copy
        out (without `from_disk`, only what DRAM holds now: no I/O). Without `verify` the
        disk hits' payloads are left for the reader to verify as it copies them
        (Lease.checks); without `as_get` its chunks count as gets only once released `read`."""
        keys = check_keys(keys)
        unchecked: dict[int, Unchecked] = {}
        held = self._reads.pin(keys, from_disk, None if verify else unchecked, as_get)
        offsets = [-1] * len(keys)
        if self._parts.dram is not None:
            for i, slot in held.items():
                offsets[i] = self._parts.dram.payload_offset(slot)
        checks: list[int | None] = [None] * len(keys)
        for i, entry in unchecked.items():
            checks[i] = entry.header.payload_checksum
        verified = [slot for i, slot in held.items() if i not in unchecked]
        return Lease(verified, offsets, keys, checks, unchecked, gets_due=0 if as_get else len(held))

    def _still_stored(self, key: bytes, disk_slot: int) -> bool:
        """Whether a chunk a lease read from disk slot `disk_slot` is still stored there
        and not being deleted."""
        disk = self._parts.disk
        return (not self._parts.in_flight.being_deleted(key) and disk is not None
                and disk.table.find(key) == disk_slot)

    def release(self, lease: Lease, good: Collection[bytes] = (), bad: Collection[bytes] = (),
                read: bool = False) -> None:
        """Unpin a lease's slots (once: a second release does nothing). Of its unchecked ones,
        those in `good` (their reader verified them) are published, unless deleted since
        (no longer on disk where they were read, or being deleted: copies_in_flight.py);
        those in `bad` (their reader found another checksum) released and their disk
        records dropped and counted; any other released unpublished. Its gets not counted
        yet are counted if `read`."""
        if lease.released:
            return
        lease.released = True
        parts = self._parts
        if lease.gets_due and read:
            count_gets(parts, lease.gets_due)
        elif lease.gets_due:
            parts.stats.add("lease.unread", lease.gets_due)
        if parts.dram is not None:
            for slot in lease.slots:
                parts.dram.table.unpin(slot)
        for i, entry in lease.unchecked.items():
            key, header = lease.keys[i], entry.header
            if key in good and key not in bad:
                with entry.reservation.table.lock:  # as a delete marks and takes out (Writes.delete)
                    if self._still_stored(key, entry.disk_slot):
                        parent = None if header.parent == bytes(16) else header.parent
                        entry.reservation.publish(key, parent, header.seq)
                        continue
            entry.reservation.release()
            if key in bad:
                parts.stats.miss("disk", MissReason.BAD_CHECKSUM,
                                 f"slot {entry.disk_slot}, found by its reader")
                if parts.disk is not None:
                    with parts.disk.table.pinned([key]) as pins:
                        pins.drop(key, entry.disk_slot)  # unless the key has moved to another slot
