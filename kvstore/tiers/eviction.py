"""Prefix-aware LRU: the tail of a prefix chain is evicted before its head.

A chunk's KV is useless without the KV of every chunk before it, so evicting a
head while its tail stays wastes the tail's space. Invariants:
- `_order` holds every tracked key, least recently used first.
- `_children[k]` counts tracked keys whose parent is k (k itself may be absent),
  so a key is a leaf, and so evictable, exactly when that count is zero.
- `touch_chain` moves a chain to the recent end tail first, head last, so within
  a chain every chunk is older than its parent and the victim scan, which takes
  the oldest leaf, rarely has to skip a non-leaf.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator


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
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1

    def remove(self, key: bytes) -> None:
        parent = self._order.pop(key, None)
        if parent is not None:
            count = self._children[parent] - 1
            if count:
                self._children[parent] = count
            else:
                del self._children[parent]

    def touch_chain(self, keys: Iterable[bytes]) -> None:
        """Mark a chain (head first) as just used, keeping tails older than heads."""
        for key in reversed(list(keys)):
            if key in self._order:
                self._order.move_to_end(key)

    def victim(self, skip: Callable[[bytes], bool] = lambda _key: False) -> bytes | None:
        """The least recently used leaf not skipped (e.g. pinned), or None."""
        fallback = None
        for key in self._order:
            if key in self._children:  # not a leaf: only a fallback
                if fallback is None and not skip(key):
                    fallback = key
                continue
            if not skip(key):
                return key
        # Every unpinned key has children (they are pinned): evict the oldest anyway.
        return fallback
