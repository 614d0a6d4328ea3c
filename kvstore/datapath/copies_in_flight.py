"""The chunks whose copies are on their way between tiers, and those being deleted, so
that a delete is not undone by a copy under way.

A delete takes a chunk out of DRAM, then off the disk. A copy of it being written down
at that moment (by the cleaner, a put's victim, write-through) would be published on
disk after the delete looked there. The writer lists its chunks here before it looks at
DRAM and until it has published them, or taken off the disk again those deleted meanwhile
(datapath/flusher.py). A copy the other way (a disk hit promoted into DRAM) is listed from
before it finds the chunk on disk until it has published it, and is not published in DRAM
while its chunk is being deleted (`deleting`; the check and the publish under the DRAM
table's lock, which the delete takes to mark the chunk and take it out of DRAM). A delete
waits until its chunk is not listed (`settle`), before and after it takes it off the disk.
Invariant: a key is listed as many times as copies of it are under way, and `settle`
returns once it is not listed, or at its deadline.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


class CopiesInFlight:
    def __init__(self) -> None:
        self._keys: Counter[bytes] = Counter()
        self._deleting: Counter[bytes] = Counter()  # keys a delete is taking out of every tier
        self._changed = threading.Condition()

    @contextmanager
    def copying(self, keys: Sequence[bytes]) -> Iterator[None]:
        """List `keys` for the body: their copies are on their way between tiers."""
        with self._changed:
            self._keys.update(keys)
        try:
            yield
        finally:
            with self._changed:
                self._keys.subtract(keys)
                for key in keys:
                    if not self._keys[key]:
                        del self._keys[key]
                self._changed.notify_all()

    def settle(self, key: bytes, timeout_s: float) -> bool:
        """Wait until no copy of `key` is under way; False if one still was after `timeout_s`."""
        with self._changed:
            return self._changed.wait_for(lambda: key not in self._keys, timeout_s)

    def deleting(self, key: bytes) -> None:
        """A delete of `key` starts (under the DRAM table's lock): no copy publishes it in
        DRAM until `deleted`."""
        with self._changed:
            self._deleting[key] += 1

    def deleted(self, key: bytes) -> None:
        """That delete is over."""
        with self._changed:
            self._deleting[key] -= 1
            if not self._deleting[key]:
                del self._deleting[key]

    def being_deleted(self, key: bytes) -> bool:
        """Whether a delete of `key` is under way (a copy into DRAM is then not published)."""
        with self._changed:
            return key in self._deleting
