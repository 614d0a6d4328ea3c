"""The DRAM cleaner: a background thread that writes the coldest DRAM chunks down to disk
before they are evicted, so that a put finds a clean victim (one already on disk, or one
the disk does not admit) and never writes other chunks to disk on its caller's thread.

CacheLib's and foyer's flushers work the same way: writes to the device are the cleaner's,
and an insert takes a clean region. The cleaner keeps the next `depth` slots to be reused
clean: free slots count first, then the eviction policy's order. `depth` is what puts may
fill at once (`put_inflight`), so puts under the bound find clean slots while the cleaner
keeps up with the disk. Where it falls behind (the disk slower than the saves), a put
writes its victim down itself as before (DEMOTE, `dram.demoted`); `dram.cleaned` counts
what the cleaner wrote. Invariants:
- a chunk it writes stays in DRAM, published and readable, pinned only while its write
  is in flight (the write's own pin holds the slot past a missed deadline: io/base.py);
- it writes only what a victim's fate would write (Flusher.dirty: not on disk, admitted,
  so the write budget and admission apply as to any eviction);
- it wakes on each DRAM publish (a listener that only sets an event) and sleeps while the
  window is clean; a pass whose writes all failed waits `retry_s` before the next.
"""

from __future__ import annotations

import logging
import threading

from kvstore.datapath.flusher import Flusher
from kvstore.tiers.dram import DramTier
from kvstore.tiers.slots import Entry, Fate
from kvstore.tiers.stats import Stats

log = logging.getLogger(__name__)


class DramCleaner:
    def __init__(self, dram: DramTier, flusher: Flusher, stats: Stats, depth: int, retry_s: float,
                 start: bool = True) -> None:
        self.dram = dram
        self.flusher = flusher
        self.stats = stats
        self.depth = depth
        self.retry_s = retry_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-dram-cleaner", daemon=True)
        dram.table.subscribe(self._on_event)
        if start:
            self._thread.start()

    def window_fate(self) -> CleanWithin:
        """The fate a put's reservation asks of each victim: one of the clean chunks within
        the cleaner's window, never a write."""
        return CleanWithin(self.flusher, self.depth)

    def clean(self) -> int | None:
        """One pass: write down up to a batch of the window's dirty chunks. None: the window
        is clean; else how many landed."""
        entries = self.dram.table.pin_coldest(self.depth, self.flusher.dirty, self.flusher.batch)
        if not entries:
            return None
        try:
            landed = sum(self.flusher.write_down(entries))
        finally:
            for entry in entries:
                self.dram.table.unpin(entry.slot)
        self.stats.add("dram.cleaned", landed)
        return landed

    def close(self, timeout_s: float) -> None:
        """Stop the thread; a write in flight lands first (its deadline is `timeout_s`), so
        nothing is written after the disk tier closes, even at a crash close."""
        self.dram.table.unsubscribe(self._on_event)
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _on_event(self, published: bool, _entry: Entry) -> None:
        if published:
            self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            try:
                while not self._stop.is_set() and (landed := self.clean()) is not None:
                    if landed == 0:  # the disk took nothing: not again at once
                        self._stop.wait(self.retry_s)
                        break
            except Exception:  # a failed pass costs a clean slot, never the thread
                log.exception("DRAM cleaner pass failed")
                self._stop.wait(self.retry_s)


class CleanWithin:
    """A put's victim fate: a clean chunk among the first `depth` asked (the cleaner's
    window), passing over dirty ones; past the window every chunk is passed over, so the
    put falls back to writing a victim down itself rather than evict far from the tail."""

    def __init__(self, flusher: Flusher, depth: int) -> None:
        self.flusher = flusher
        self.left = depth

    def __call__(self, key: bytes) -> Fate:
        self.left -= 1
        if self.left < 0:
            return Fate.SKIP
        return self.flusher.clean_fate(key)
