import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.sim.replay import Replayer
from bench.support.trace import block_keys, read_trace
from kvstore.tiers.eviction import CostAware, Eviction, PrefixLRU
from kvstore.tiers.policy import TierPolicy
from kvstore.tiers.slots import SlotTable


def chain(name: str, length: int) -> list[bytes]:
    return [f"{name}{i}".encode() for i in range(length)]


def add_chain(lru: Eviction, keys: list[bytes]) -> None:
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
    groups = [table.groups.of(table.reserve(table.next_group()).slot)[0] for _ in range(6)]
    assert groups == [0, 1, 0, 1, 0, 1]


def _drain(eviction: Eviction) -> list[bytes]:
    order = []
    while (victim := eviction.victim()) is not None:
        order.append(victim)
        eviction.remove(victim)
    return order


def test_cost_evicts_a_chain_tail_first_even_though_the_tail_costs_most():
    policy = TierPolicy(eviction="cost", chunk_tokens=512)
    keys = chain("a", 4)
    policy.seen(keys)
    cost = policy.make_eviction()
    add_chain(cost, keys)
    assert policy.chunk_cost(keys[3]) > policy.chunk_cost(keys[0])  # attention grows with depth
    assert _drain(cost) == list(reversed(keys))


def test_cost_evicts_a_shallow_chunk_before_a_deeper_one_used_as_often():
    """A (3 chunks) then B (1) are stored: LRU takes A's tail, the oldest leaf; cost takes
    B's only chunk, which is cheaper to recompute than A's third."""
    a, b = chain("a", 3), chain("b", 1)
    victims = {}
    for name in ("lru", "cost"):
        policy = TierPolicy(eviction=name, chunk_tokens=512)
        eviction = policy.make_eviction()
        for keys in (a, b):
            policy.seen(keys)
            add_chain(eviction, keys)
        victims[name] = eviction.victim()
    assert victims == {"lru": a[2], "cost": b[0]}


def test_a_dear_chunk_outlives_a_cheap_one_only_until_the_clock_passes_it():
    eviction = CostAware(lambda key, parent: 3.0 if key == b"dear" else 1.0)
    eviction.add(b"dear", None)  # value 3
    eviction.add(b"cheap", None)  # value 1: newer, but cheaper
    assert eviction.victim() == b"cheap"
    for n in range(2):  # each victim raises the clock to its value; new chunks enter above it
        victim = eviction.victim()
        eviction.remove(victim)
        assert victim == (b"cheap", b"new0")[n] and eviction.clock == n + 1
        eviction.add(b"new%d" % n, None)
    assert eviction.victim() == b"dear"  # unused since: new1 (clock 2 + 1) ties it, and is newer


def test_a_deep_chunk_outlives_a_shallow_one_in_a_replay_under_cost(tmp_path):
    """DRAM of 4 chunks, no disk. R1 stores A (3 chunks), R2 B (1), R3 C (1) needs a slot;
    R4 asks for A again: under LRU its third chunk is gone (2 hits), under cost B went (3)."""
    rows = [([1, 2, 3], 3 * 512 + 1), ([4], 513), ([5], 513), ([1, 2, 3], 3 * 512 + 1)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": n, "output_length": 1,
                                         "hash_ids": ids}) + "\n" for i, (ids, n) in enumerate(rows)))
    results = {}
    for name in ("lru", "cost"):
        replayer = Replayer([("dram", 4 * 512)], kv_bytes_per_token=1, block_tokens=512,
                            policy=TierPolicy(eviction=name, chunk_tokens=512))
        requests = list(read_trace(trace, 512))
        hits = [replayer.serve(request) for request in requests[:3]]
        assert (block_keys([4])[0] in replayer.tiers[0]) == (name == "lru")  # B, after C came
        hits.append(replayer.serve(requests[3]))
        results[name] = (hits[-1], replayer.result())
    assert results["lru"][0] == [0, 0] and results["cost"][0] == [0, 0, 0]
    assert results["cost"][1]["recompute_cost"] < results["lru"][1]["recompute_cost"]
    assert results["cost"][1]["eviction"] == "cost"


def test_switching_eviction_keeps_every_published_chunk():
    table = SlotTable([4])
    keys = chain("a", 3)
    for parent, key in zip([None, *keys[:-1]], keys, strict=True):
        reservation = table.reserve()
        assert reservation is not None
        reservation.publish(key, parent, 0)
    table.set_eviction(TierPolicy(eviction="cost").make_eviction())
    assert set(table.eviction) == set(keys) == set(table.index)
    assert table.eviction.victim() == keys[2]  # still tail first


def test_switching_to_cost_keeps_parents_above_children_and_recency():
    """Chains seen first (depths and costs differ), stored under LRU, then the table
    switches to cost: every parent is worth at least each child, the first key in cost
    order is a leaf (a victim scan takes it at once), and the least recently used chain's
    tail goes first, as under LRU."""
    policy = TierPolicy(eviction="cost", chunk_tokens=4096)  # remembers depths
    table = SlotTable([60])  # LRU until the switch
    chains = [chain(f"c{n}-", 6) for n in range(10)]
    for keys in chains:
        policy.seen(keys)
        for parent, key in zip([None, *keys[:-1]], keys, strict=True):
            reservation = table.reserve()
            assert reservation is not None
            reservation.publish(key, parent, 0)
        table.touch_chain(keys)
    table.touch_chain(chains[0])  # now the most recent: the oldest is chains[1]
    assert isinstance(table.eviction, PrefixLRU)
    table.set_eviction(policy.make_eviction())
    eviction = table.eviction
    assert isinstance(eviction, CostAware)
    assert set(eviction) == set(table.index)
    for keys in chains:
        values = [eviction._value[key][0] for key in keys]
        assert values == sorted(values, reverse=True)  # parent >= child
        assert policy.chunk_cost(keys[-1]) > policy.chunk_cost(keys[0])
    first = next(iter(eviction))
    assert eviction.is_leaf(first) and first == chains[1][-1]
    scanned = []
    assert eviction.victim(skip=lambda key: scanned.append(key) or False) == first
    assert scanned == [first]  # no head or middle chunk walked past


@pytest.mark.parametrize("make", [PrefixLRU, lambda: CostAware(lambda key, parent: 1.0)], ids=["lru", "cost"])
def test_a_bounded_walk_takes_a_leaf_within_it_and_never_a_chains_inner_key_for_want_of_one(make):
    """`most` (a put's walk beside the DRAM cleaner): the first leaf among the next `most`
    to go; where there is none, nothing, not the middle of a chain while a leaf lies past
    the walk (the unbounded walk falls back to an inner key only when none is a leaf)."""
    eviction = make()
    add_chain(eviction, chain("a", 3))  # oldest: a0 <- a1 <- a2 (a2 the leaf, next to go after a1)
    add_chain(eviction, chain("b", 1))
    order = list(eviction)
    inner = [key for key in order if not eviction.is_leaf(key)]
    leaves = [key for key in order if eviction.is_leaf(key)]
    first_leaf = order.index(leaves[0])
    assert eviction.victim(most=first_leaf + 1) == leaves[0]
    pinned = {leaves[0]}
    skip = pinned.__contains__
    assert eviction.victim(skip, most=len(inner)) is None  # the pinned leaf and an inner key looked at
    assert eviction.victim(skip) == leaves[1]  # unbounded: the next leaf
    every_leaf = set(leaves).__contains__
    assert eviction.victim(every_leaf) == inner[0]  # no leaf at all: the oldest inner key
    assert eviction.victim(every_leaf, most=len(inner)) is None  # unless the walk stopped early


@st.composite
def _forest(draw: st.DrawFn) -> tuple[list[tuple[bytes, bytes | None]], list[list[bytes]], set[bytes],
                                      set[bytes], int | None]:
    """Keys added with a parent among the earlier ones (or none), chains (root first)
    touched after, keys removed after that (a parent may then be absent from the tier),
    keys pinned, and a bound on the walk."""
    count = draw(st.integers(1, 14))
    keys = [bytes([i]) for i in range(count)]
    parents = [None] + [draw(st.none() | st.sampled_from(keys[:i])) for i in range(1, count)]
    pairs = list(zip(keys, parents, strict=True))

    def path(key: bytes) -> list[bytes]:
        up = dict(pairs)
        chain_ = [key]
        while (parent := up[chain_[-1]]) is not None:
            chain_.append(parent)
        return chain_[::-1]

    touches = [path(key) for key in draw(st.lists(st.sampled_from(keys), max_size=6))]
    removed = draw(st.sets(st.sampled_from(keys), max_size=4))
    return pairs, touches, removed, draw(st.sets(st.sampled_from(keys))), draw(st.none() | st.integers(0, 16))


@pytest.mark.parametrize("make", [PrefixLRU, lambda: CostAware(lambda key, parent: 1.0 + key[0] % 3)],
                         ids=["lru", "cost"])
@given(forest=_forest())
def test_going_is_the_order_victims_are_taken_in_one_by_one(make, forest):
    """What the DRAM cleaner writes ahead of (`going`) is what eviction would take next, in
    that order, pins respected: a chain extended later leaves its old inner keys early in
    the order, and they go only after their children."""
    pairs, touches, removed, pinned, most = forest
    orders = make(), make()
    for eviction in orders:
        for key, parent in pairs:
            eviction.add(key, parent)
        for keys in touches:
            eviction.touch_chain(keys)
        for key in removed:
            eviction.remove(key)
    looked = set(itertools.islice(orders[1], most))  # a bounded walk: the victims among these
    going = list(orders[0].going(pinned.__contains__, most))
    taken = []
    while ((victim := orders[1].victim(lambda key: key in pinned or key not in looked)) is not None
           and orders[1].is_leaf(victim)):
        taken.append(victim)
        orders[1].remove(victim)
    assert going == taken


def test_the_cleaner_writes_ahead_of_the_next_victims_not_a_chains_old_inner_keys():
    """A chain extended later (a next turn whose prompt was not touched) keeps its head and
    middle early in the LRU order; they go after every other chunk, so the cleaner's window
    of the next 3 to go holds the 3 oldest leaves, as reserve() then takes them."""
    table = SlotTable([8])
    keys = [b"a0", b"a1", b"x1", b"x2", b"x3", b"x4", b"x5", b"a2"]
    parents = {b"a1": b"a0", b"a2": b"a1"}
    for key in keys:
        table.reserve().publish(key, parents.get(key), 1)
    picked = table.pin_coldest(3, lambda key: True, most=8)
    assert [entry.key for entry in picked] == [b"x1", b"x2", b"x3"]
    for entry in picked:
        table.unpin(entry.slot)
    assert [table.reserve().evicted for _ in range(3)] == [b"x1", b"x2", b"x3"]
