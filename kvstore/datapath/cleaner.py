"""The DRAM cleaner: a background thread that writes the coldest DRAM chunks down to disk
before they are evicted, so that a put's victim (the least recently used chunk, as
without the cleaner) is already on disk and is dropped, and the put writes no other chunk
to disk on its caller's thread.

CacheLib's and foyer's flushers work the same way: writes to the device are the cleaner's,
and an insert takes a clean region. The cleaner keeps the next `depth` slots to be reused
(its window) clean: free slots count first, then the chunks in the order the eviction
policy would take them as victims (a chain's leaf before its head, however old the head:
SlotTable.pin_coldest over Eviction.going). `depth` is what puts may fill at once
(`put_inflight`, `clean_depth`), up to MOST_CHUNKS, so puts under the bound find clean
victims while the cleaner keeps up with the disk (a burst of more than MOST_CHUNKS small
chunks may outrun the window). Where it falls behind (the disk slower than the saves), a
put still writes no other chunk down: it takes the coldest slot whose chunk is on disk
among the next 2 x `depth` to go (placement.py), and with none its chunks go straight to
disk (`put.straight_to_disk`): the caller waits for its own bytes only, and the put bound
(`put_inflight`, past it `put.rejected`) caps what waits at once. `dram.cleaned` counts
what the cleaner wrote; with no cleaner (`dram_clean_ahead: 0`, or a store without
background threads) a put writes its victim down itself (DEMOTE, `dram.demoted`). Invariants:
- a chunk it writes stays in DRAM, published and readable, pinned only while its write
  is in flight (a pinned chunk is passed over by eviction, as any reader's; the write's
  own pin holds the slot past a missed deadline: io/base.py);
- it writes only what a victim's fate would write (Flusher.dirty: not on disk, admitted,
  so the write budget and admission apply as to any eviction); while it keeps up, the
  chunk evicted is the policy's pick, cleaner or not (the pick is already on disk);
- it wakes on each DRAM publish (a listener that only sets an event) and when a
  reservation finds no slot it may take (`wake`), and sleeps while the window is clean; a
  pass whose writes all failed waits `retry_s` (no longer than a tripped device's
  cooldown: StoreParts), wakes or not, then tries again.
"""
from __future__ import annotations

import logging
import threading

from kvstore.config.store import StoreConfig
from kvstore.datapath.flusher import Flusher
from kvstore.tiers.dram import DramTier
from kvstore.tiers.slots import Change, Entry
from kvstore.tiers.stats import Stats

log = logging.getLogger(__name__)


# The most chunks the window holds, whatever their size: each pass walks the window (and
# at most as many more, passed over) under the DRAM table's lock, 0.2-0.4 us a chunk of it
# here (0.2-0.4 ms at 1,024, the more for chains of several chunks; 1 ms and more at
# 4,096, with 256 KiB chunks under the 1 GiB default), and every get and put waits for
# that lock.
MOST_CHUNKS = 1024


def clean_depth(config: StoreConfig, chunk_bytes: int, dram_slots: int) -> int:
    """The slots the cleaner keeps clean: `dram_clean_ahead`'s, or by default what puts may
    fill at once (`put_inflight`), at most a quarter of the tier, so that most of DRAM is
    written only as it leaves; never more than MOST_CHUNKS. 0: no cleaner."""
    if config.dram_clean_ahead is not None:
        asked = min(config.dram_clean_ahead // chunk_bytes, dram_slots)
        if asked > MOST_CHUNKS:
            log.info("dram_clean_ahead: %d chunks asked, the cleaner keeps %d clean (its walk holds the "
                     "DRAM lock)", asked, MOST_CHUNKS)
        return min(asked, MOST_CHUNKS)
    return min(config.put_inflight // chunk_bytes, dram_slots // 4, MOST_CHUNKS)


class DramCleaner:
    def __init__(self, dram: DramTier, flusher: Flusher, stats: Stats, depth: int, retry_s: float) -> None:
        self.dram = dram
        self.flusher = flusher
        self.stats = stats
        self.depth = depth
        self.retry_s = retry_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-dram-cleaner", daemon=True)
        dram.table.subscribe(self._on_event)
        self._thread.start()

    def _clean(self) -> bool | None:
        """One pass: write down up to a batch of the window's dirty chunks. None: the window
        is clean; False: none of them got anywhere (their writes failed); else True."""
        entries = self.dram.table.pin_coldest(self.depth, self.flusher.dirty, self.flusher.batch)
        if not entries:
            return None
        try:
            landed = self.flusher.write_down(entries)
        finally:
            for entry in entries:
                self.dram.table.unpin(entry.slot)
        self.stats.add("dram.cleaned", sum(landed))
        return any(landed) or any(entry.key not in self.dram.table for entry in entries)  # deleted

    def close(self, timeout_s: float) -> bool:
        """Stop the thread once its write in flight has ended (each I/O has its deadline:
        `timeout_s` is the longest one write takes), so nothing is written after the disk
        tier closes, even at a crash close. False: it had not ended by then."""
        self.dram.table.unsubscribe(self._on_event)
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def wake(self) -> None:
        """A reservation found no slot it could take without a write: clean now (with no
        publish after it, nothing else would wake the cleaner)."""
        self._wake.set()

    def _on_event(self, change: Change, _entry: Entry) -> None:
        if change is Change.STORED:
            self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            try:
                while not self._stop.is_set() and (progress := self._clean()) is not None:
                    if not progress:  # the disk took nothing: again after a pause, not at once
                        self._stop.wait(self.retry_s)
            except Exception:  # a failed pass costs a clean slot, never the thread
                log.exception("DRAM cleaner pass failed")
                self._stop.wait(self.retry_s)

