import pytest

from kvstore.tiers.eviction import PrefixLRU
from kvstore.tiers.slots import SlotTable


def chain(name: str, length: int) -> list[bytes]:
    return [f"{name}{i}".encode() for i in range(length)]


def add_chain(lru: PrefixLRU, keys: list[bytes]) -> None:
    for parent, key in zip([None, *keys[:-1]], keys, strict=True):
        lru.add(key, parent)
    lru.touch_chain(keys)


def test_tail_goes_before_head_even_when_head_is_older():
    lru = PrefixLRU()
    keys = chain("a", 4)
    add_chain(lru, keys)
    order = []
    while (victim := lru.victim()) is not None:
        order.append(victim)
        lru.remove(victim)
    assert order == list(reversed(keys))


def test_least_recently_used_chain_goes_first():
    lru = PrefixLRU()
    old, new = chain("old", 3), chain("new", 3)
    add_chain(lru, old)
    add_chain(lru, new)
    assert lru.victim() == old[-1]
    lru.touch_chain(old)
    assert lru.victim() == new[-1]


def test_shared_prefix_outlives_both_branches():
    lru = PrefixLRU()
    trunk = chain("t", 2)
    add_chain(lru, trunk)
    lru.add(b"x", trunk[-1])
    lru.add(b"y", trunk[-1])
    evicted = []
    while (victim := lru.victim()) is not None:
        evicted.append(victim)
        lru.remove(victim)
    assert evicted.index(trunk[-1]) > max(evicted.index(b"x"), evicted.index(b"y"))


def test_pinned_slots_are_never_reused_and_reserve_fails_when_all_are_pinned():
    table = SlotTable([2])
    first = table.reserve()
    first.publish(b"a", None, 1)
    second = table.reserve()
    second.publish(b"b", b"a", 2)
    table.pin(table.find(b"b"))
    third = table.reserve()  # b is pinned, so a (its parent) is the fallback victim
    assert third.evicted == b"a" and third.slot == first.slot
    assert table.reserve() is None  # slot of a reserved, b pinned


def test_a_reservation_left_unsettled_goes_back_to_the_free_list():
    table = SlotTable([1])
    with pytest.raises(RuntimeError), table.reserve():
        raise RuntimeError("the write failed")
    reservation = table.reserve()
    assert reservation is not None and reservation.slot == 0


def test_striping_spreads_reservations_over_groups():
    table = SlotTable([4, 4])
    groups = [table.group_of(table.reserve(table.next_group()).slot)[0] for _ in range(6)]
    assert groups == [0, 1, 0, 1, 0, 1]
