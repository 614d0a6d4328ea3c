"""The DRAM leases clients hold: pins a client takes to copy chunks out of the mapped DRAM
tier itself (Pin), and the runs its lookups lease for its engine's workers (Residency
with `lease_from`).

Invariants: a lease is held by one client under a number only that client can give back
(Unpin, or a later lookup's release), and no other connection of the service's life was
given; whatever way a client leaves, every lease it holds
goes back (`release_all`). A client's own pins together cover at most its window's slots.
Its lookups' leases count against its user's budget, `service.scheduler_leases` for all
that user's connections together, taken before the pin so that no two lookups overrun it,
and given back with the lease; a lookup leases DRAM only (no disk read on a lookup).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import Counter
from collections.abc import Collection

from kvstore.format.errors import KVStoreError
from kvstore.store.leases import Lease
from kvstore.store.tiered import TieredStore


class HeldLeases:
    """One client's leases by number, and which of them its lookups took. Numbers are
    unique over every connection of the service's life: a client that reconnects and still
    gives back a number of its old connection's names no lease of its new one."""

    _numbers = itertools.count(1)  # every client's (next() on it is atomic)

    def __init__(self, uid: int) -> None:
        self.uid = uid
        self._leases: dict[int, tuple[Lease, bool]] = {}  # number -> (lease, a lookup's)

    def add(self, lease: Lease, lookup: bool) -> int:
        number = next(HeldLeases._numbers)
        self._leases[number] = (lease, lookup)
        return number

    def pop(self, number: int) -> tuple[Lease, bool] | None:
        return self._leases.pop(number, None)

    def pinned(self) -> int:
        """Chunks this client's leases pin."""
        return sum(lease.pinned for lease, _ in self._leases.values())

    def numbers(self) -> list[int]:
        return list(self._leases)


class LeaseDesk:
    """Hands out and takes back every client's leases, within each user's lookup budget."""

    def __init__(self, lookup_budget_bytes: int) -> None:
        self._budget_bytes = lookup_budget_bytes
        self._leased: Counter[int] = Counter()  # chunks each uid's lookups hold leased
        self._lock = threading.Lock()

    def lease_run(self, store: TieredStore, held: HeldLeases, ranks: list[list[bytes]], first: int,
                  resident: int) -> list[object]:
        """[number, offsets per rank] of chunks `first` to `resident` (the DRAM run) of every
        rank, as many as the user's budget has room for; [0, []] where none is leased."""
        if first >= resident:
            return [0, []]
        budget = self._budget_bytes // store.chunk_bytes
        with self._lock:
            count = min(resident - first, max(0, budget - self._leased[held.uid]) // len(ranks))
            self._leased[held.uid] += count * len(ranks)  # taken before the pin: no two overrun it
        if not count:
            store.stats.add("lease.over_budget")
            return [0, []]
        chunks = [key for rank in ranks for key in rank[first : first + count]]
        try:  # gets counted when the release says its load was carried out
            lease = store.shared_dram.lease(chunks, from_disk=False, as_get=False)
        except BaseException:  # no lease: its share of the budget goes back (else lost for good)
            with self._lock:
                self._leased[held.uid] -= count * len(ranks)
            raise
        number = held.add(lease, lookup=True)
        return [number, [lease.offsets[r * count : (r + 1) * count] for r in range(len(ranks))]]

    @staticmethod
    def pin(store: TieredStore, held: HeldLeases, keys: list[bytes], verify: bool,
            slots: int) -> list[object]:
        """Pin the DRAM hits among `keys` (disk hits promoted first) for the client to copy
        out of the tier itself; without `verify` their payloads are left for the client to
        check as it copies them, where the client is the service's own user's (its word
        decides what is published in DRAM for everyone; any other's are verified here)."""
        held_now = held.pinned()
        if held_now + len(keys) > slots:
            raise KVStoreError(f"pinning {len(keys)} chunks on top of the {held_now} this client holds "
                               f"is more than its window's {slots}: unpin first")
        lease = store.shared_dram.lease(keys, verify=verify or held.uid != os.geteuid())
        return [held.add(lease, lookup=False), lease.offsets, lease.checks]

    def release(self, store: TieredStore | None, held: HeldLeases, number: int,
                good: Collection[bytes] = (), bad: Collection[bytes] = (), read: bool = False) -> None:
        """Give a lease back; of its unverified chunks, `good` passed the client's check and
        `bad` failed it (any other, as when the client left, goes back unpublished). A
        lookup's lease counts its chunks as gets where `read` (its load was carried out);
        one a client left holding is not known to be read, and counts none."""
        found = held.pop(number)
        if found is None:
            return
        lease, lookup = found
        if lookup:
            with self._lock:
                self._leased[held.uid] -= len(lease.offsets)
        if store is not None:
            store.shared_dram.release(lease, good, bad, read)

    def release_all(self, store: TieredStore | None, held: HeldLeases) -> None:
        """Every lease of a client that left."""
        for number in held.numbers():
            self.release(store, held, number)
