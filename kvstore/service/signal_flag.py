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

import contextlib
import os
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
    of one loop that polls `wake_fd` (the write end of its non-blocking wake pipe), held from
    `with` to its end in the main thread (where Python runs handlers).

    The kernel hands a signal sent to the process to any of its threads; Python's C-level
    handler then runs on that thread and the main thread's poll is not interrupted, so its
    Python handler would wait for the next wake-up. `signal.set_wakeup_fd` makes the C-level
    handler write to `wake_fd` on whatever thread caught the signal; each Python handler
    raises its flag and writes there too, so a flag raised after the loop looked wakes it
    again. A signal caught before these handlers took over (`reloads` given, raised by an
    earlier handler) is acted on at the loop's first look: `wake_fd` is written once here.
    """

    def __init__(self, wake_fd: int, reloads: SignalFlag | None, hangup: bool) -> None:
        self.ended = SignalFlag()
        self.reloads = reloads or SignalFlag()
        self._wake_fd = wake_fd
        self._hangup = hangup
        self._wakeup_before = -1

    def __enter__(self) -> LoopSignals:
        self._wakeup_before = signal.set_wakeup_fd(self._wake_fd, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._waking(self.ended))
        if self._hangup:
            signal.signal(signal.SIGHUP, self._waking(self.reloads))
        self._wake()
        return self

    def __exit__(self, *_: object) -> None:
        """The wake-up fd there was before, and no more writes to `wake_fd` (the loop's pipe
        is about to close; its number may be reused). The handlers stay: a signal while the
        service drains raises a flag no one reads, where the default action would end it."""
        signal.set_wakeup_fd(self._wakeup_before)
        self._wake_fd = -1

    def _waking(self, flag: SignalFlag) -> Callable[..., None]:
        def handler(*_: object) -> None:
            flag.raise_()
            self._wake()
        return handler

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: the loop is woken already
            os.write(self._wake_fd, b"x")
