"""A stateful property test of the slot table and the prefix-aware LRU: random
reservations (evicting, demoting, skipping victims), publishes, releases, retirements,
pins, unpins, unpublishes and take-overs, with every invariant of slots.py and
eviction.py checked after each step."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.tiers.slots import Fate, Reservation, SlotTable

KEYS = [bytes([i]) * 16 for i in range(24)]


class SlotTableMachine(RuleBasedStateMachine):
    @initialize(groups=st.lists(st.integers(1, 4), min_size=1, max_size=3))
    def make(self, groups: list[int]) -> None:
        self.table = SlotTable(groups)
        self.open: list[Reservation] = []  # unsettled reservations
        self.pins: list[int] = []  # pins this test holds (late I/O among them)

    # -- rules ------------------------------------------------------------------------

    @rule(group=st.integers(0, 2), fates=st.dictionaries(st.sampled_from(KEYS),
                                                         st.sampled_from(list(Fate))))
    def reserve(self, group: int, fates: dict[bytes, Fate]) -> None:
        table = self.table
        before = {key: table.slots[slot].pins for key, slot in table.index.items()}
        leaves_free = [key for key in table.eviction if table.eviction.is_leaf(key) and before[key] == 0
                       and fates.get(key, Fate.EVICT) is not Fate.SKIP]
        free_before = sum(len(f) for g, f in enumerate(table.groups.free) if g not in table.groups.disabled)
        reservation = table.reserve(group % len(table.groups.sizes),
                                    fate=lambda key: fates.get(key, Fate.EVICT))
        if reservation is None:
            assert free_before == 0
            return
        victim = reservation.victim or reservation.evicted
        if victim is not None:
            assert free_before == 0
            assert before[victim] == 0, "a pinned chunk was chosen as a victim"
            assert fates.get(victim, Fate.EVICT) is not Fate.SKIP
            if leaves_free:
                assert victim in leaves_free, "a chunk with children went while a leaf could"
        self.open.append(reservation)

    @rule(data=st.data(), key=st.sampled_from(KEYS), parent=st.none() | st.sampled_from(KEYS))
    def publish(self, data: st.DataObject, key: bytes, parent: bytes | None) -> None:
        if not self.open:
            return
        reservation = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
        if reservation.victim is not None and not reservation.take_over():
            return  # a reader still holds the victim: released instead
        reservation.publish(key, parent if parent != key else None, seq=1)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.open:
            self.open.pop(data.draw(st.integers(0, len(self.open) - 1))).release()

    @rule(data=st.data())
    def release_under_a_late_read(self, data: st.DataObject) -> None:
        """A read into the slot missed its deadline: its own pin (DramTier.slot_memory)
        outlives the reservation, and the slot is free only once it lands (`unpin`)."""
        if self.open:
            reservation = self.open.pop(data.draw(st.integers(0, len(self.open) - 1)))
            self.table.pin(reservation.slot)
            self.pins.append(reservation.slot)
            reservation.release()

    @rule(key=st.sampled_from(KEYS))
    def pin(self, key: bytes) -> None:
        with self.table.pinned([key]) as pins:
            for _, slot in pins.hits:
                self.table.pin(slot)  # one more than the context's own, kept after it
                self.pins.append(slot)

    @rule(depth=st.integers(0, 8), wanted=st.frozensets(st.sampled_from(KEYS)), most=st.integers(1, 4))
    def pin_coldest(self, depth: int, wanted: frozenset[bytes], most: int) -> None:
        """The DRAM cleaner's pick: wanted records among the next `depth` to go, the
        victims the table would take one by one (the oldest unpinned leaf each time) among
        the next 2 x `depth` in its order."""
        table = self.table
        free = sum(len(f) for g, f in enumerate(table.groups.free) if g not in table.groups.disabled)
        looked = list(table.eviction)[: 2 * depth]
        window: list[bytes] = []
        while len(window) < depth - free:
            going = next((key for key in looked if key not in window
                          and table.slots[table.index[key]].pins == 0
                          and all(table.slots[slot].parent != key or child in window
                                  for child, slot in table.index.items())), None)
            if going is None:
                break
            window.append(going)
        picked = table.pin_coldest(depth, wanted.__contains__, most)
        assert [entry.key for entry in picked] == [key for key in window if key in wanted][:most]
        for entry in picked:
            assert table.index[entry.key] == entry.slot
            self.pins.append(entry.slot)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        self.table.unpin(self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1))))

    @rule(key=st.sampled_from(KEYS))
    def unpublish(self, key: bytes) -> None:
        self.table.unpublish(key)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=6))
    def touch(self, keys: list[bytes]) -> None:
        self.table.touch_chain(keys)

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def each_slot_is_in_exactly_one_state(self) -> None:
        table = self.table
        free = [slot for group in table.groups.free for slot in group]
        assert len(free) == len(set(free)), "a slot is twice on the free lists"
        reserved = {r.slot for r in self.open}
        published = set(table.index.values())
        for slot, info in enumerate(table.slots):
            assert info.pins >= 0
            states = [slot in free, slot in published, slot in reserved and slot not in published,
                      not info.published and info.pins > 0 and slot not in reserved]
            assert sum(states) == 1 or (slot in published and slot in reserved), (slot, states)
            if slot in free:
                assert info.pins == 0 and not info.published

    @invariant()
    def the_index_is_exactly_the_published_slots(self) -> None:
        table = self.table
        for key, slot in table.index.items():
            assert table.slots[slot].published and table.slots[slot].key == key
        assert sum(info.published for info in table.slots) == len(table.index)
        assert set(table.eviction) == set(table.index)

    @invariant()
    def capacity_is_never_exceeded(self) -> None:
        table = self.table
        in_use = {slot for slot, info in enumerate(table.slots) if info.published or info.pins}
        free = {slot for group in table.groups.free for slot in group}
        assert not in_use & free and len(in_use | free) == table.capacity

    @invariant()
    def pins_are_counted(self) -> None:
        table = self.table
        expected = [0] * table.capacity
        for slot in self.pins:
            expected[slot] += 1
        for reservation in self.open:
            expected[reservation.slot] += 1
        assert [info.pins for info in table.slots] == expected

    def teardown(self) -> None:
        for reservation in self.open:
            reservation.release()


TestSlotTable = SlotTableMachine.TestCase
TestSlotTable.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
