"""Eviction order of a tier: prefix-aware LRU (`lru`) or recompute-cost-aware (`cost`).

A chunk's KV is useless without the KV of every chunk before it, so evicting a
head while its tail stays wastes the tail's space: both policies evict the tail of a
prefix chain before its head (a victim is a leaf: no tracked key names it as parent).
Both offer the same calls (Eviction): add, remove, touch_chain, victim, is_leaf, load
(take over another order's keys when the policy is switched), iteration in the order kept
and `going`, the order victims would go in (what the DRAM cleaner writes ahead of). SlotTable
(slots.py) calls them under its lock.

PrefixLRU invariants:
- `_order` holds every tracked key, least recently used first.
- `_children[k]` counts tracked keys whose parent is k (k itself may be absent),
  so a key is a leaf, and so evictable, exactly when that count is zero.
- `touch_chain` moves a chain to the recent end tail first, head last, so within
  a chain every chunk is older than its parent and the victim scan, which takes
  the oldest leaf, rarely has to skip a non-leaf.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

from sortedcontainers import SortedList


class Eviction(Protocol):
    def __iter__(self) -> Iterator[bytes]: ...
    def is_leaf(self, key: bytes) -> bool: ...
    def add(self, key: bytes, parent: bytes | None) -> None: ...
    def remove(self, key: bytes) -> None: ...
    def touch_chain(self, keys: Iterable[bytes]) -> None: ...
    def victim(self, skip: Callable[[bytes], bool] = ..., most: int | None = None) -> bytes | None: ...
    def going(self, skip: Callable[[bytes], bool] = ..., most: int | None = None) -> Iterator[bytes]: ...
    def load(self, entries: Sequence[tuple[bytes, bytes | None]]) -> None: ...


def _link(children: dict[bytes, int], parent: bytes | None) -> None:
    """One more tracked child of `parent`."""
    if parent is not None:
        children[parent] = children.get(parent, 0) + 1


def _unlink(children: dict[bytes, int], parent: bytes | None) -> None:
    """One tracked child of `parent` fewer; a parent with none left is a leaf again."""
    if parent is not None:
        count = children[parent] - 1
        if count:
            children[parent] = count
        else:
            del children[parent]


def _going(order: Iterable[bytes], parents: Mapping[bytes, bytes | None], children: Mapping[bytes, int],
           skip: Callable[[bytes], bool]) -> Iterator[bytes]:
    """Keys of `order` (least worth keeping first) in the order victims would be taken one
    by one, nothing else changing: a leaf as the walk meets it, and an inner key the walk
    has passed as soon as its last child has gone (it is then the oldest leaf). A skipped
    key (pinned) never goes, nor do its ancestors. `skip` is asked only of keys that would
    otherwise go next."""
    gone: dict[bytes, int] = {}  # children each key has lost so far
    passed: set[bytes] = set()  # inner keys the walk went by, waiting for their children
    wait = passed.add  # bound once: a walk may pass hundreds of inner keys
    for key in order:
        if key in children and (not gone or children[key] > gone.get(key, 0)):
            wait(key)
            continue
        node: bytes | None = key
        while node is not None and not skip(node):
            yield node
            node = parents[node]
            if node is None:
                break
            gone[node] = gone.get(node, 0) + 1
            if node not in passed or gone[node] < children[node]:
                break
            passed.discard(node)


def _depths(parents: Mapping[bytes, bytes | None]) -> dict[bytes, int]:
    """Each key's depth among these keys (0: its parent is not one of them)."""
    depth: dict[bytes, int] = {}
    for key in parents:
        path: list[bytes] = []
        node: bytes | None = key
        while node is not None and node in parents and node not in depth and node not in path:
            path.append(node)
            node = parents[node]
        base = depth.get(node, -1) if node is not None else -1
        for step in reversed(path):
            base += 1
            depth[step] = base
    return depth


class PrefixLRU:
    def __init__(self) -> None:
        self._order: OrderedDict[bytes, bytes | None] = OrderedDict()  # key -> parent
        self._children: dict[bytes, int] = {}

    def __iter__(self) -> Iterator[bytes]:
        """Tracked keys, least recently used first."""
        return iter(self._order)

    def is_leaf(self, key: bytes) -> bool:
        """No tracked key names `key` as its parent."""
        return key not in self._children

    def add(self, key: bytes, parent: bytes | None) -> None:
        """Track `key` as most recently used; re-adding only touches it."""
        if key in self._order:
            self._order.move_to_end(key)
            return
        self._order[key] = parent
        _link(self._children, parent)

    def remove(self, key: bytes) -> None:
        _unlink(self._children, self._order.pop(key, None))

    def load(self, entries: Sequence[tuple[bytes, bytes | None]]) -> None:
        """Take over (key, parent) pairs, least recently used (or valuable) first."""
        for key, parent in entries:
            self.add(key, parent)

    def touch_chain(self, keys: Iterable[bytes]) -> None:
        """Mark a chain (head first) as just used, keeping tails older than heads."""
        for key in reversed(list(keys)):
            if key in self._order:
                self._order.move_to_end(key)

    def victim(self, skip: Callable[[bytes], bool] = lambda _key: False,
               most: int | None = None) -> bytes | None:
        """The least recently used leaf not skipped (e.g. pinned), or None; with `most`, among
        the `most` least recently used keys only (a walk under the table's lock), and no
        chain's inner key taken for want of a leaf among them. The first of `going`, found
        without its bookkeeping: every reservation asks, under the table's lock."""
        fallback = None
        for key in itertools.islice(self._order, most):
            if key in self._children:  # not a leaf: only a fallback
                if fallback is None and not skip(key):
                    fallback = key
                continue
            if not skip(key):
                return key
        # Every unpinned key looked at has children (they are pinned): evict the oldest
        # anyway, unless the walk stopped at `most` (a leaf may lie past it).
        return fallback if most is None or len(self._order) <= most else None

    def going(self, skip: Callable[[bytes], bool] = lambda _key: False,
              most: int | None = None) -> Iterator[bytes]:
        """Keys in the order `victim` would take them one by one (least recently used leaf
        first), among the `most` least recently used, passing over those `skip` names;
        not `victim`'s last resort, an inner key taken where no leaf may go."""
        return _going(itertools.islice(self._order, most), self._order, self._children, skip)


class CostAware:
    """GreedyDual over recompute cost, prefix-aware.

    A chunk's value is what recomputing it would cost, `cost(key, parent)`
    (TierPolicy.chunk_cost: attention makes a chunk deep in a long prefix dearer than the
    first), weighed by its chance of reuse, which recency stands for: the tier's clock
    rises to the value of each victim taken, and a chunk used is valued clock + cost, so
    one unused for a while loses to newer ones, and of two used alike the cheaper goes
    first (with equal costs this is LRU). Counting uses as well (GDSF) was measured and
    lost: chunks of chains used many times long ago stayed (docs/replay.md). The victim
    is the leaf of least value. Invariants:
    - `_order` holds (value, n, key) exactly once for every tracked key, `_value[key]`
      being that (value, n): sorted, least valuable first (ties: least recently set);
    - a value never falls; a parent's value is at least each tracked child's (raised
      with it), so within a chain the tail goes first and a scan rarely meets a non-leaf;
    - `_children` counts tracked children per key, as PrefixLRU's.
    """

    def __init__(self, cost: Callable[[bytes, bytes | None], float]) -> None:
        self._cost = cost
        self._parent: dict[bytes, bytes | None] = {}
        self._children: dict[bytes, int] = {}
        self._unit: dict[bytes, float] = {}  # key -> its recompute cost
        self._value: dict[bytes, tuple[float, int]] = {}
        self._order = SortedList()
        self._count = itertools.count()
        self.clock = 0.0

    def __iter__(self) -> Iterator[bytes]:
        """Tracked keys, least valuable first."""
        return (key for _, _, key in self._order)

    def is_leaf(self, key: bytes) -> bool:
        return key not in self._children

    def add(self, key: bytes, parent: bytes | None) -> None:
        if key in self._value:
            self.touch_chain([key])
            return
        self._parent[key] = parent
        _link(self._children, parent)
        self._unit[key] = self._cost(key, parent)
        self._set(key, self.clock + self._unit[key])

    def load(self, entries: Sequence[tuple[bytes, bytes | None]]) -> None:
        """Take over another order's (key, parent) pairs, least valuable first, into an
        empty order. Each keeps its rank there: valued cost + a clock `rank` below this
        one's, the old order spread over one unit (a full tier's turnover raises a
        GreedyDual clock by about one chunk's cost), so recency still counts; then every
        parent is raised to its children's values, deepest first, whatever order the pairs
        came in (a tail added before its head would otherwise leave the head cheaper, and
        each victim scan would walk past every head)."""
        values: dict[bytes, float] = {}
        for rank, (key, parent) in enumerate(entries):
            self._parent[key] = parent
            _link(self._children, parent)
            self._unit[key] = self._cost(key, parent)
            values[key] = self.clock - (len(entries) - rank) / len(entries) + self._unit[key]
        depth = _depths(self._parent)
        for key in sorted(values, key=depth.__getitem__, reverse=True):
            parent = self._parent[key]
            if parent is not None and parent in values:
                values[parent] = max(values[parent], values[key])
        for key, value in values.items():  # in the old order: ties keep it
            self._value[key] = (value, next(self._count))
            self._order.add((value, self._value[key][1], key))

    def remove(self, key: bytes) -> None:
        current = self._value.pop(key, None)
        if current is None:
            return
        self._order.remove((*current, key))
        del self._unit[key]
        _unlink(self._children, self._parent.pop(key))

    def touch_chain(self, keys: Iterable[bytes]) -> None:
        """A chain (head first) was used: each tracked chunk's value is renewed, tail
        first, each parent raised to at least its child's."""
        chain = [key for key in keys if key in self._value]
        floor = 0.0
        for i in range(len(chain) - 1, -1, -1):
            key = chain[i]
            floor = max(floor, self.clock + self._unit[key])
            self._set(key, floor, climb=i == 0 or self._parent[chain[i]] != chain[i - 1])

    def victim(self, skip: Callable[[bytes], bool] = lambda _key: False,
               most: int | None = None) -> bytes | None:
        """The least valuable leaf not skipped (e.g. pinned), or None; the clock rises to it.
        With `most`, among the `most` least valuable keys only. The first of `going`, found
        without its bookkeeping, as PrefixLRU's."""
        fallback = None
        for value, _, key in itertools.islice(self._order, most):
            if key in self._children:  # not a leaf: only a fallback
                if fallback is None and not skip(key):
                    fallback = (value, key)
                continue
            if not skip(key):
                self.clock = max(self.clock, value)
                return key
        if fallback is None or (most is not None and len(self._order) > most):
            return None  # no leaf; past a stopped walk one may lie
        self.clock = max(self.clock, fallback[0])
        return fallback[1]

    def going(self, skip: Callable[[bytes], bool] = lambda _key: False,
              most: int | None = None) -> Iterator[bytes]:
        """Keys in the order `victim` would take them one by one (least valuable leaf
        first), among the `most` least valuable, passing over those `skip` names; not
        `victim`'s last resort, an inner key taken where no leaf may go."""
        return _going(itertools.islice(self, most), self._parent, self._children, skip)

    def _set(self, key: bytes, value: float, climb: bool = True) -> None:
        """Raise `key` to this value (a value never falls) and, with `climb`, its tracked
        ancestors with it."""
        node: bytes | None = key
        while node is not None:
            current = self._value.get(node)
            if current is not None:
                if current[0] >= value:
                    break
                self._order.remove((*current, node))
            self._value[node] = (value, next(self._count))
            self._order.add((value, self._value[node][1], node))
            node = self._parent.get(node) if climb else None
            if node is not None and node not in self._value:
                break
