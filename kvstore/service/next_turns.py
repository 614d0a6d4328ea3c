"""The service's side of next-turn prediction: requests ending and arriving feed the
predictor (kvstore/tiers/next_turn.py); a timer thread promotes each chain into DRAM
when its prediction falls due.

`next_turn: warm` promotes a finished request's chunks at once (the predictor with no
learning and a zero gap); `off` does nothing. A promotion goes through the service's
one prefetch queue (handlers.py), so it is bounded like any other and never blocks a
request. Invariants: the predictor is touched under this object's lock only; the
thread never outlives `close`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvstore.tiers.next_turn import NextTurnPredictor

Promote = Callable[[tuple[bytes, ...]], None]


class NextTurns:
    def __init__(self, mode: str, lead_s: float, promote: Promote,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.mode = mode
        self._predictor = NextTurnPredictor(lead_s=lead_s)
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

    def finished(self, ranks: Sequence[Sequence[bytes]]) -> None:
        if self.mode == "off":
            return
        if self.mode == "warm":
            for keys in ranks:
                self._promote(tuple(keys))
            return
        with self._lock:
            for keys in ranks:
                self._predictor.finished(list(keys), self._clock())
            self._lock.notify()

    def expect(self, ranks: Sequence[Sequence[bytes]], in_s: float) -> None:
        """A hint: these chains are wanted in `in_s` seconds (fetched lead_s before)."""
        with self._lock:
            for keys in ranks:
                self._predictor.expect(list(keys), self._clock() + in_s)
            self._lock.notify()

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                due = self._predictor.due(self._clock())
                if not due:
                    wake = self._predictor.next_due()
                    self._lock.wait(None if wake is None else max(0.0, wake - self._clock()))
                    continue
            for keys in due:
                self._promote(keys)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
