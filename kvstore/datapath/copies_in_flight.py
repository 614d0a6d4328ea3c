"""The DRAM chunks whose copies are on their way to disk, so that a delete can wait for them.

A delete takes a chunk out of DRAM, then off the disk. A copy of it being written down
at that moment (by the cleaner, a put's victim, write-through) would be published on
disk after the delete looked there. The writer lists its chunks here before it looks at
DRAM and until it has published them, or taken off the disk again those deleted meanwhile
(datapath/flusher.py); a delete waits until its chunk is not listed (`settle`). Invariant:
a key is listed as many times as copies of it are under way, and `settle` returns once it
is not listed, or at its deadline.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


class CopiesInFlight:
    def __init__(self) -> None:
        self._keys: Counter[bytes] = Counter()
        self._changed = threading.Condition()

    @contextmanager
    def writing(self, keys: Sequence[bytes]) -> Iterator[None]:
        """List `keys` for the body: their copies are being written down."""
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
