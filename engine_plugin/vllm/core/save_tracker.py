"""Saves in flight, and the holds they put on requests that would miss them.

A save is in flight from the step that plans it until every tensor-parallel worker
reports it done (stored, or given up). A request whose next chunk after the stored
run is in flight is held ("ask again later") until it lands, at most
`wait_for_saves_s` from the first ask, and once at most: a follow-up sent the moment
its predecessor's reply arrives still finds that turn's chunks (prompt and answer).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass
class _Saving:
    keys: tuple[bytes, ...]  # rank 0's keys of the save's chunks
    reports: int = 0  # workers (tensor-parallel ranks) that reported it done


class SaveTracker:
    """Counters (into `counters`): save_wait.requests held for in-flight saves, the time
    they were held (save_wait.ms), those that stopped waiting at the deadline
    (save_wait.expired)."""

    def __init__(self, num_ranks: int, wait_for_saves_s: float, counters: Counter[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.num_ranks = num_ranks
        self.wait_for_saves_s = wait_for_saves_s
        self.counters = counters
        self._clock = clock
        self._saves: dict[int, _Saving] = {}  # in flight, by save_id
        self._in_flight: Counter[bytes] = Counter()  # rank 0 key -> saves of it in flight
        self._last_save_id = 0
        self._held_since: dict[str, float] = {}  # requests held for in-flight saves
        self._released: set[str] = set()  # requests whose hold has ended

    def started(self, keys: Sequence[bytes]) -> int:
        """A save of these (rank 0) keys is planned: its save_id."""
        self._last_save_id += 1
        self._saves[self._last_save_id] = _Saving(tuple(keys))
        self._in_flight.update(keys)
        return self._last_save_id

    def done(self, save_ids: Iterable[int]) -> None:
        """Workers report saves done (one report per rank); a save leaves the in-flight
        set once every rank has reported it."""
        for save_id in save_ids:
            saving = self._saves.get(save_id)
            if saving is None:
                continue
            saving.reports += 1
            if saving.reports >= self.num_ranks:
                del self._saves[save_id]
                for key in saving.keys:
                    self._in_flight[key] -= 1
                    if self._in_flight[key] <= 0:
                        del self._in_flight[key]

    def held(self, req_id: str, keys: Sequence[bytes], stored: int) -> bool:
        """True while the chunk after the stored run is being saved by this engine, for
        at most wait_for_saves_s from the first ask; a request is held once at most."""
        if self.wait_for_saves_s <= 0 or req_id in self._released:
            return False
        now = self._clock()
        in_flight = stored < len(keys) and self._in_flight.get(keys[stored], 0) > 0
        held_since = self._held_since.get(req_id)
        if in_flight and (held_since is None or now - held_since < self.wait_for_saves_s):
            self._held_since.setdefault(req_id, now)
            return True
        if held_since is not None:  # the hold ends: the saves landed, or the deadline passed
            del self._held_since[req_id]
            self._released.add(req_id)
            self.counters["save_wait.requests"] += 1
            self.counters["save_wait.ms"] += round((now - held_since) * 1000)
            self.counters["save_wait.expired"] += int(in_flight)
        return False

    def forget(self, req_id: str) -> None:
        self._held_since.pop(req_id, None)
        self._released.discard(req_id)
