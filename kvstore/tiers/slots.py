"""Slot bookkeeping of one tier: free, reserved and published slots, pins, the index.

A tier is an array of fixed-size slots, split into groups (one group per disk
device; the DRAM tier has one group). The table has its own lock; every method
takes it, so callers never touch the state directly. Invariants:
- A slot is in exactly one state: free (in its group's free list), reserved (being
  written, invisible to lookups, owned by one Reservation), or published (in
  `index`, tracked by the eviction policy).
- `pins` counts holders of a slot: readers and writers in flight, and the one
  Reservation of a reserved slot. A published slot is never rewritten: it leaves
  the index first (`unpublish`) and returns to the free list only once its last
  pin goes, so a get never sees a half-written record and a read never races a reuse.
- A slot a late I/O may still move bytes into or out of keeps that I/O's pin until it
  lands (DramTier.slot_memory, io/base.py): never freed or rewritten before.
- Pins and reservations are context managers: an exception between taking and
  giving back costs nothing (the slot is unpinned or freed on the way out).
- Listeners (`subscribe`) are told of each publish and unpublish after the fact, outside
  the lock, in the table's order (TableLock).
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvstore.tiers.eviction import Eviction, PrefixLRU


class Fate(enum.Enum):
    """What a reservation may do with a victim (the leaf the eviction policy picks)."""

    EVICT = "evict"  # drop it now and take its slot
    DEMOTE = "demote"  # take its slot once the caller has written it elsewhere (take_over)
    SKIP = "skip"  # leave it; look for another


@dataclass(slots=True)
class SlotInfo:
    key: bytes | None = None
    parent: bytes | None = None
    seq: int = 0
    pins: int = 0
    published: bool = False
    # The slot may hold a valid header on its device from an earlier record, so a
    # new write must zero that header before writing the payload (crash order).
    ever_written: bool = False


@dataclass(frozen=True, slots=True)
class Entry:
    """A published record as the table knows it."""

    key: bytes
    slot: int
    parent: bytes | None
    seq: int


class Reservation:
    """A reserved slot, pinned once, settled exactly once: `publish` or `release`.
    Leaving a `with` block unsettled releases it.

    With `victim` set (a DEMOTE), the slot still holds that published record: the
    caller writes it elsewhere, then `take_over` makes the slot its own."""

    def __init__(self, table: SlotTable, slot: int, evicted: bytes | None,
                 victim: bytes | None = None) -> None:
        self.table = table
        self.slot = slot
        self.evicted = evicted  # the key evicted to make room, if any
        self.victim = victim  # the key to write elsewhere before the slot is ours
        self.settled = False
        self.handed_over = False  # another owner settles it (leaving a `with` does not)

    def take_over(self) -> bool:
        """The victim is safe elsewhere: unpublish it and own the slot. False (the
        reservation is then released, the victim kept) if a reader still holds it."""
        assert self.victim is not None
        with self.table.lock:
            if self.table.slots[self.slot].pins > 1 or self.table.index.get(self.victim) != self.slot:
                self.release()
                return False
            self.table._unpublish(self.victim, Change.EVICTED)
            self.evicted, self.victim = self.victim, None
            return True

    def publish(self, key: bytes, parent: bytes | None, seq: int, keep_pin: bool = False) -> None:
        """Make the written record visible; an older slot of the same key is retired.
        With `keep_pin` the reservation's pin passes to the caller (a lease), so the
        record cannot be evicted between becoming visible and being read."""
        with self.table.lock:
            self._settle()
            self.table._publish(self.slot, key, parent, seq)
            if not keep_pin:
                self.table._unpin(self.slot)

    def release(self) -> None:
        """Nothing (valid) was written: the slot goes back to the free list."""
        with self.table.lock:
            self._settle()
            self.table._unpin(self.slot)

    def _settle(self) -> None:
        if self.settled:
            raise RuntimeError(f"reservation of slot {self.slot} settled twice")
        self.settled = True

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.settled and not self.handed_over:
            self.release()

    def hand_over(self) -> Reservation:
        """Leaving the `with` block no longer releases it: the caller passes it, still
        pinned and unpublished, to an owner that settles it later (a lease whose reader
        verifies the record as it copies it: store/leases.py)."""
        self.handed_over = True
        return self


class Pins:
    """Slots pinned for reading (`hits`: (index into the keys asked for, slot)).
    Leaving the `with` block unpins them all; `drop(i)` also unpublishes a record
    that did not verify, unless its key has moved to another slot meanwhile."""

    def __init__(self, table: SlotTable, hits: list[tuple[int, int]]) -> None:
        self.table = table
        self.hits = hits
        self._dropped: list[tuple[bytes, int]] = []
        self._kept: set[int] = set()

    def drop(self, key: bytes, slot: int) -> None:
        self._dropped.append((key, slot))

    def keep(self, slot: int) -> None:
        """Do not unpin this slot on exit: its pin passes to someone else (a lease)."""
        self._kept.add(slot)

    def __enter__(self) -> Pins:
        return self

    def __exit__(self, *exc: object) -> None:
        with self.table.lock:
            for key, slot in self._dropped:
                if self.table.index.get(key) == slot:
                    self.table._unpublish(key, Change.REMOVED)
            for _, slot in self.hits:
                if slot not in self._kept:
                    self.table._unpin(slot)


class SlotGroups:
    """A tier's slots split into groups (one per disk device; DRAM has one): where each
    group's run of slot numbers starts, each group's free list, the groups out of service,
    and the round-robin cursor that stripes consecutive chunks over the devices.

    Invariants: slot numbers are consecutive, one run per group; a free slot is in its
    own group's list exactly once; nothing is taken from a disabled group. No lock of its
    own: the SlotTable holding it guards it with the table's lock."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = list(sizes)
        self.start = [sum(sizes[:i]) for i in range(len(sizes))]
        self.free: list[list[int]] = [list(reversed(self.span(g))) for g in range(len(sizes))]
        self.disabled: set[int] = set()  # out of service: nothing is reserved there
        self._cursor = 0

    def of(self, slot: int) -> tuple[int, int]:
        """(group, slot number within the group)."""
        for group in range(len(self.start) - 1, -1, -1):
            if slot >= self.start[group]:
                return group, slot - self.start[group]
        raise IndexError(slot)

    def span(self, group: int) -> range:
        return range(self.start[group], self.start[group] + self.sizes[group])

    def next_in_service(self) -> int:
        """The next group round robin, passing over disabled ones (0 when all are)."""
        for _ in range(len(self.sizes)):
            group, self._cursor = self._cursor, (self._cursor + 1) % len(self.sizes)
            if group not in self.disabled:
                return group
        return 0  # all disabled: take_free finds nothing

    def take_free(self, preferred: int) -> int | None:
        """A free slot of a group in service, `preferred` first."""
        for group in [preferred, *(g for g in range(len(self.free)) if g != preferred)]:
            if self.free[group] and group not in self.disabled:
                return self.free[group].pop()
        return None


class Change(enum.Enum):
    """What happened to a record, as a table tells its listeners: a cache that learns from
    what leaves (disk admission) tells an eviction from a removal."""

    STORED = "stored"  # published: visible from now on
    EVICTED = "evicted"  # made room for another record (reserve, or its write down handed the slot over)
    REMOVED = "removed"  # deleted, dropped as bad, replaced by a newer copy, or its device taken out


Listener = Callable[[Change, Entry], None]


class TableLock:
    """A slot table's re-entrant lock, and its listeners: the events a holder makes are
    queued under the lock and delivered when the outermost hold is let go, outside it.

    Invariants: each listener is told every event once, in the order the table made them
    (one queue, drained under one delivery lock); a table call that made events returns
    only once they are delivered (by its own thread, or by one already delivering, which
    it waits for); no listener runs under the table's lock, so one may call the table
    again (its events follow, in order). What a listener sees of the table may be newer
    than its event: a listener that mirrors state checks the table before acting. A
    listener must not raise, nor wait on a lock whose holder may be inside this table.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0  # holds by the owning thread
        self._made = False  # this outermost hold queued events
        self._listeners: tuple[Listener, ...] = ()
        self._events: deque[tuple[Change, Entry]] = deque()
        self._delivery = threading.Lock()
        self._delivering: int | None = None  # the thread delivering now

    def __enter__(self) -> None:
        self._lock.acquire()
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        made = self._depth == 0 and self._made
        if made:
            self._made = False
        self._lock.release()
        if made and self._delivering != threading.get_ident():  # else: that loop delivers it
            self._deliver()

    def tell(self, change: Change, key: bytes, slot: int, info: SlotInfo) -> None:
        """Queue an event (the lock held); delivered as the outermost hold ends."""
        if self._listeners:
            self._events.append((change, Entry(key, slot, info.parent, info.seq)))
            self._made = True

    def subscribe(self, listener: Listener, first: bool = False) -> None:
        """Tell `listener` of every event from now on; `first`: before those subscribed already."""
        with self:
            self._listeners = (listener, *self._listeners) if first else (*self._listeners, listener)

    def unsubscribe(self, listener: Listener) -> None:
        """Stop telling `listener`; once this returns it is not called again."""
        with self:
            self._listeners = tuple(known for known in self._listeners if known != listener)
        if self._delivering != threading.get_ident():
            with self._delivery:  # a delivery under way ends first
                pass

    def _deliver(self) -> None:
        with self._delivery:
            self._delivering = threading.get_ident()
            try:
                while self._events:
                    change, entry = self._events.popleft()
                    for listener in self._listeners:
                        listener(change, entry)
            finally:
                self._delivering = None


class SlotTable:
    def __init__(self, group_sizes: Sequence[int]) -> None:
        self.lock = TableLock()
        self.groups = SlotGroups(group_sizes)
        self.slots = [SlotInfo() for _ in range(sum(group_sizes))]
        self.index: dict[bytes, int] = {}
        self.eviction: Eviction = PrefixLRU()

    # -- queries ---------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return len(self.slots)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def find(self, key: bytes) -> int | None:
        return self.index.get(key)

    def entry(self, slot: int) -> Entry | None:
        with self.lock:
            info = self.slots[slot]
            if not info.published or info.key is None:
                return None
            return Entry(info.key, slot, info.parent, info.seq)

    def entries(self) -> list[Entry]:
        """Every published record (a snapshot)."""
        with self.lock:
            return [Entry(key, slot, self.slots[slot].parent, self.slots[slot].seq)
                    for key, slot in self.index.items()]

    def subscribe(self, listener: Listener, first: bool = False) -> None:
        """Tell `listener(published?, record)` of each publish and unpublish from now on,
        outside the lock, in the table's order (TableLock)."""
        self.lock.subscribe(listener, first)

    def unsubscribe(self, listener: Listener) -> None:
        self.lock.unsubscribe(listener)

    def touch_chain(self, keys: Iterable[bytes]) -> None:
        with self.lock:
            self.eviction.touch_chain(keys)

    def set_eviction(self, eviction: Eviction) -> None:
        """Switch the eviction policy (config, or a policy switched at runtime): every
        published chunk stays, handed to the new policy in the old one's order (load)."""
        with self.lock:
            eviction.load([(key, self.slots[self.index[key]].parent) for key in self.eviction])
            self.eviction = eviction

    # -- reads -----------------------------------------------------------------------

    @contextmanager
    def pinned(self, keys: Sequence[bytes], indices: Iterable[int] | None = None) -> Iterator[Pins]:
        """Pin the slots of the present keys among keys[i] for i in `indices` (all by default)."""
        with self.lock:
            hits = []
            for i in range(len(keys)) if indices is None else indices:
                slot = self.index.get(keys[i])
                if slot is not None:
                    self.slots[slot].pins += 1
                    hits.append((i, slot))
        with Pins(self, hits) as pins:
            yield pins

    def pin(self, slot: int) -> None:
        """One more holder of a slot the caller knows to be pinned or published."""
        with self.lock:
            self.slots[slot].pins += 1

    def unpin(self, slot: int) -> None:
        with self.lock:
            self._unpin(slot)

    def pin_coldest(self, depth: int, wanted: Callable[[bytes], bool], most: int) -> list[Entry]:
        """Pin and return up to `most` records that `wanted` picks (asked under the lock)
        among the next `depth` to go: free slots count first, then records in the order the
        eviction policy would take them as victims (leaves first; a pinned one cannot go,
        nor can its ancestors, so they do not count). At most 2 x `depth` records are
        looked at, so a tail of pinned ones never makes the walk the whole table's under
        the lock."""
        with self.lock:
            left = depth - sum(len(self.groups.free[g]) for g in range(len(self.groups.free))
                               if g not in self.groups.disabled)
            picked: list[Entry] = []
            for key in self.eviction.going(lambda key: self.slots[self.index[key]].pins > 0, 2 * depth):
                if left <= 0 or len(picked) >= most:
                    break
                left -= 1
                if wanted(key):
                    slot = self.index[key]
                    info = self.slots[slot]
                    picked.append(Entry(key, slot, info.parent, info.seq))
            for entry in picked:  # only once `wanted` can no longer raise
                self.slots[entry.slot].pins += 1
            return picked

    # -- writes ----------------------------------------------------------------------

    def next_group(self) -> int:
        """Round-robin group for striping consecutive chunks over devices in service."""
        with self.lock:
            return self.groups.next_in_service()

    def reserve(self, preferred_group: int = 0, fate: Callable[[bytes], Fate] | None = None,
                most: int | None = None) -> Reservation | None:
        """A slot to write into, pinned by the returned Reservation; with the table
        full, the leaf the eviction policy picks that `fate` lets go (default: any) makes
        room, looked for among the `most` next to go (default: all). None when no victim
        may go (all pinned, or skipped).

        `fate(key)` runs under this table's lock: EVICT drops the victim now; DEMOTE
        hands its slot over with the victim still in it (Reservation.take_over).
        """
        with self.lock:
            free = self.groups.take_free(preferred_group)
            if free is not None:
                self.slots[free].pins = 1
                return Reservation(self, free, None)
            fates: dict[bytes, Fate] = {}

            def skip(key: bytes) -> bool:
                if self.slots[self.index[key]].pins > 0:
                    return True
                if key not in fates:
                    fates[key] = Fate.EVICT if fate is None else fate(key)
                return fates[key] is Fate.SKIP

            victim = self.eviction.victim(skip=skip, most=most)
            if victim is None:
                return None
            slot = self.index[victim]
            if fates[victim] is Fate.DEMOTE:
                self.slots[slot].pins += 1
                return Reservation(self, slot, None, victim=victim)
            self._unpublish(victim, Change.EVICTED)  # unpinned, so this appends it to its free list
            self.groups.free[self.groups.of(slot)[0]].pop()
            self.slots[slot].pins = 1
            return Reservation(self, slot, victim)

    def unpublish(self, key: bytes) -> int | None:
        """Hide `key`; its slot is freed now or when its last pin goes."""
        with self.lock:
            return self._unpublish(key, Change.REMOVED)

    # -- internals (lock held) -----------------------------------------------------------

    def _publish(self, slot: int, key: bytes, parent: bytes | None, seq: int) -> None:
        if key in self.index:
            self._unpublish(key, Change.REMOVED)
        info = self.slots[slot]
        info.key, info.parent, info.seq = key, parent, seq
        info.published = info.ever_written = True
        self.index[key] = slot
        self.eviction.add(key, parent)
        self.lock.tell(Change.STORED, key, slot, info)

    def _unpublish(self, key: bytes, change: Change) -> int | None:
        slot = self.index.pop(key, None)
        if slot is None:
            return None
        self.eviction.remove(key)
        info = self.slots[slot]
        info.published = False
        self.lock.tell(change, key, slot, info)
        if info.pins == 0:
            self._free(slot)
        return slot

    def _unpin(self, slot: int) -> None:
        info = self.slots[slot]
        if info.pins <= 0:
            raise RuntimeError(f"slot {slot} unpinned more often than pinned")
        info.pins -= 1
        if info.pins == 0 and not info.published:
            self._free(slot)

    def _free(self, slot: int) -> None:
        info = self.slots[slot]
        info.key = info.parent = None
        self.groups.free[self.groups.of(slot)[0]].append(slot)


class DiskSlotTable(SlotTable):
    """The disk tier's table: slots that may hold a record from before this start, and
    groups (devices) that leave service and come back (`service`)."""

    def __init__(self, group_sizes: Sequence[int]) -> None:
        super().__init__(group_sizes)
        self.service = GroupService(self)

    def mark_written(self, slot: int) -> bool:
        """Note that a write is about to reach the slot; True if an older record's
        header may still be there (so the writer must zero it first)."""
        with self.lock:
            info = self.slots[slot]
            before, info.ever_written = info.ever_written, True
            return before

    def restore(self, entries: Iterable[Entry], written_groups: Iterable[int] = ()) -> None:
        """Recovery: publish records found on the devices and take their slots off the
        free lists (the caller resolves duplicate keys first). Every slot of
        `written_groups` (devices that existed before) may hold an old header."""
        with self.lock:
            in_use = set()
            for entry in entries:
                self._publish(entry.slot, entry.key, entry.parent, entry.seq)
                in_use.add(entry.slot)
            free = self.groups.free
            for group in range(len(free)):
                free[group] = [s for s in free[group] if s not in in_use]
            for group in written_groups:
                for slot in self.groups.span(group):
                    self.slots[slot].ever_written = True


class GroupService:
    """A disk table's groups (devices) leaving service and coming back after
    revalidation (tiers/availability.py drives it). Each call takes the table's lock.
    Invariants: a group out of service has nothing published and gets no reservation;
    a slot still pinned by I/O from before the loss is not freed until that pin goes,
    and rejoins the free list only once it is neither published nor held."""

    def __init__(self, table: DiskSlotTable) -> None:
        self.table = table

    def take_out(self, group: int) -> tuple[int, list[int]]:
        """Nothing more is reserved in `group` and its records leave the index now.
        Returns (records unpublished, slots reserved for a write in flight there)."""
        table = self.table
        with table.lock:
            table.groups.disabled.add(group)
            lost, in_flight = 0, []
            for slot in table.groups.span(group):
                info = table.slots[slot]
                if info.published and info.key is not None:
                    table._unpublish(info.key, Change.REMOVED)
                    lost += 1
                elif info.pins:
                    in_flight.append(slot)
            return lost, in_flight

    def held(self, group: int) -> bool:
        """Whether any slot of `group` is still pinned (an I/O from before a loss)."""
        with self.table.lock:
            return any(self.table.slots[s].pins for s in self.table.groups.span(group))

    def bring_back(self, group: int, entries: Iterable[Entry]) -> None:
        """Publish the records revalidation verified and serve `group` again: its free
        list is every slot neither published nor held."""
        table = self.table
        with table.lock:
            table.restore([e for e in entries if e.key not in table.index], [group])
            table.groups.free[group] = [s for s in reversed(table.groups.span(group))
                                        if not table.slots[s].published and not table.slots[s].pins]
            table.groups.disabled.discard(group)
