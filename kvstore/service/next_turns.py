"""The service's side of next-turn prediction: requests ending and arriving feed the
predictor (kvstore/tiers/next_turn.py); a timer thread promotes each chain into DRAM
when its prediction falls due.

`next_turn: warm` promotes a finished request's chunks at once (the predictor with no
learning and a zero gap); `off` does nothing. A promotion goes through the service's
one prefetch queue (lookups.py), so it is bounded like any other and never blocks a
request. Invariants: the predictor is touched under this object's lock only; the
thread never outlives `close`, and nothing ends it before: a hint's `in_s` outside
[0, MAX_AHEAD_S] (inf, NaN) is refused before it reaches the predictor, the timer never
sleeps longer than MAX_SLEEP_S, and a failing round is logged and the loop goes on.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.tiers.next_turn import NextTurnPredictor

log = logging.getLogger(__name__)
Promote = Callable[[tuple[bytes, ...], int | None], None]  # a chain, in the turn of its user
MAX_AHEAD_S = 86400.0  # a hint further ahead is refused (protocol.MAX_EXPECT_S)
MAX_SLEEP_S = 3600.0  # the timer wakes at least this often (a longer wait cannot overflow)


class NextTurns:
    def __init__(self, mode: str, lead_s: float, promote: Promote,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.mode = mode
        self._predictor = NextTurnPredictor(lead_s=lead_s, trusted=os.geteuid())  # co-tenants: a share
        self._promote = promote
        self._clock = clock
        self._lock = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kvstore-next-turn", daemon=True)
        if mode != "off":
            self._thread.start()

    def arrived(self, ranks: Sequence[Sequence[bytes]]) -> None:
        if self.mode == "predict":
            with self._lock:
                for keys in ranks:
                    self._predictor.arrived(list(keys), self._clock())
                self._lock.notify()

    def finished(self, ranks: Sequence[Sequence[bytes]], uid: int | None = None) -> None:
        """A request of a client of `uid` ended (its predictions count against its share)."""
        if self.mode == "off":
            return
        if self.mode == "warm":
            for keys in ranks:
                self._promote(tuple(keys), uid)
            return
        with self._lock:
            for keys in ranks:
                self._predictor.finished(list(keys), self._clock(), uid)
            self._lock.notify()

    def expect(self, ranks: Sequence[Sequence[bytes]], in_s: float, uid: int | None = None) -> None:
        """A hint: these chains are wanted in `in_s` seconds (fetched lead_s before); a
        ValueError if `in_s` is not a finite number of seconds in [0, MAX_AHEAD_S]."""
        if not (math.isfinite(in_s) and 0 <= in_s <= MAX_AHEAD_S):
            raise ValueError(f"a hint's in_s must be between 0 and {MAX_AHEAD_S:g} s")
        with self._lock:
            for keys in ranks:
                self._predictor.expect(list(keys), self._clock() + in_s, uid)
            self._lock.notify()

    def _loop(self) -> None:
        while True:
            try:
                with self._lock:
                    if self._closed:
                        return
                    due = self._predictor.due(self._clock())
                    if not due:
                        wake = self._predictor.next_due()
                        self._lock.wait(MAX_SLEEP_S if wake is None else
                                        min(MAX_SLEEP_S, max(0.0, wake - self._clock())))
                        continue
                for keys, owner in due:
                    self._promote(keys, owner)
            except Exception:  # one bad round must not stop predictions for every engine
                log.exception("next-turn promotion failed; going on")
                time.sleep(0.1)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
