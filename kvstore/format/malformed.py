"""Input from outside that does not parse: refused as a value, counted, logged once per kind.

kvstore's parsers at a boundary (a request's kv_transfer_params and KV hints, the
service's protocol frames, a config file read on reload) raise `Malformed` naming the
kind of input and what is wrong with it; the code that called them counts it as
`malformed.KIND` (shown by `kvstore info` and Prometheus) and goes on without it. The
first of each kind is logged as a warning, later ones at debug level, so a peer that
sends nothing but garbage cannot flood the log. A detail names the field and the
problem; where it quotes a config value, a URL's password in it is masked (secrets.masked).
The counting and the once-per-kind log are `KindCounts`'s, which the service's refusals of
clients (`clients.REASON`: kvstore/service/client_slots.py) use too.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import MutableMapping
from typing import Any


class Malformed(ValueError):
    """`kind` is the counter's suffix (a short snake_case name), `why` says what is wrong."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(f"malformed {kind}: {why}")
        self.kind = kind
        self.why = why


class KindCounts:
    """Counts events by kind into `counters` (its own Counter if none is given) as
    `PREFIX.KIND`, every name in `kinds` shown from the start (as 0); logs each kind's
    first as a warning on `log`, later ones at debug, so a peer that repeats one thing
    cannot flood the log. Thread-safe."""

    def __init__(self, log: logging.Logger, prefix: str, counters: MutableMapping[str, Any] | None = None,
                 kinds: tuple[str, ...] = ()) -> None:
        self._log = log
        self._prefix = prefix
        self._counters: MutableMapping[str, Any] = Counter() if counters is None else counters
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        for kind in kinds:
            self._counters.setdefault(f"{prefix}.{kind}", 0)

    def add(self, kind: str, message: str, what: str, logged: bool = False) -> None:
        """Count one `kind`; log `message` and `what` became of it, unless the caller
        `logged` it already."""
        name = f"{self._prefix}.{kind}"
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + 1
            first = kind not in self._logged
            self._logged.add(kind)
        if not logged:
            (self._log.warning if first else self._log.debug)(
                "%s (%s; counted as %s%s)", message, what, name, ", logged once" if first else "")

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._counters)


class MalformedCounts(KindCounts):
    """Counts Malformed input as `malformed.KIND` (KindCounts)."""

    def __init__(self, log: logging.Logger, counters: MutableMapping[str, Any] | None = None) -> None:
        super().__init__(log, "malformed", counters)

    def count(self, error: Malformed, what: str = "ignored", logged: bool = False) -> None:
        """Count `error`; `what` says what became of the input, for the log line (none if
        the caller `logged` it already)."""
        self.add(error.kind, str(error), what, logged)


def whole(value: Any, kind: str, field: str, low: int, high: int) -> int:
    """`value` as an int in [low, high]; a bool, a float (even 1.0, inf or NaN), a string or
    anything else is Malformed."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise Malformed(kind, f"{field} must be an integer, not {type(value).__name__}")
    if not low <= value <= high:
        raise Malformed(kind, f"{field} must be between {low} and {high}")
    return value


def finite(value: Any, kind: str, field: str, low: float, high: float) -> float:
    """`value` (an int or float, not a bool) as a float in [low, high]; inf and NaN are Malformed."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Malformed(kind, f"{field} must be a number, not {type(value).__name__}")
    number = float(value) if abs(value) < 1e300 else math.inf
    if not math.isfinite(number) or not low <= number <= high:
        raise Malformed(kind, f"{field} must be a finite number between {low:g} and {high:g}")
    return number
