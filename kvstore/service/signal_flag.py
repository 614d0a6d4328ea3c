"""Signals as flags: a flag a handler raises without taking a lock, and a loop's signals.

Python runs a signal handler in the main thread between two bytecodes, whatever that
thread was doing, and runs it again if another signal comes while it runs. A handler
that takes a lock (`threading.Event.set` takes its condition's) deadlocks when the
signal lands while the main thread holds that lock, and a storm of signals (a SIGHUP
sent over and over while the service starts) nests handler in handler until the
interpreter's recursion limit ends the process. So a handler only counts, here, and
the loop that acts on the signal reads the count in its own time.
"""

from __future__ import annotations

import signal
from collections.abc import Callable


class SignalFlag:
    """Raised by a handler (`raise_`), seen once by the one loop that acts on it (`take`).

    Invariants: `raise_` stores one integer and takes no lock, so it is safe however
    handlers nest; only `raise_` writes the count and only `take` writes what was seen,
    so a signal caught while `take` runs is seen by the next `take`, never lost (a count
    lost to a nested handler's increment still leaves the count changed).
    """

    def __init__(self) -> None:
        self._raised = 0
        self._seen = 0

    def raise_(self, *_: object) -> None:
        """Note a signal (usable as the handler itself: it takes the handler's arguments)."""
        self._raised += 1

    def take(self) -> bool:
        """Whether a signal came since the last `take`."""
        raised = self._raised
        if raised == self._seen:
            return False
        self._seen = raised
        return True


class LoopSignals:
    """SIGTERM and SIGINT (`ended`) and, where the loop reloads, SIGHUP (`reloads`) as flags
    of one loop that polls: each handler raises its flag and calls `wake`, which must take
    no lock (a write to the loop's wake pipe). Made in the main thread (where Python runs
    handlers); a signal caught before these handlers took over (`reloads` given, raised by
    an earlier handler) is acted on at the loop's first look: `wake` is called once here.
    """

    def __init__(self, wake: Callable[[], None], reloads: SignalFlag | None, hangup: bool) -> None:
        self.ended = SignalFlag()
        self.reloads = reloads or SignalFlag()

        def waking(flag: SignalFlag) -> Callable[..., None]:
            def handler(*_: object) -> None:
                flag.raise_()
                wake()
            return handler

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, waking(self.ended))
        if hangup:
            signal.signal(signal.SIGHUP, waking(self.reloads))
        wake()
