"""A fault-injecting wrapper around a real engine: errors, short reads, torn writes,
latency and requests that never return (until released).

It exists to prove that every failure the hardware can produce becomes a counted
miss and never wrong data or a hang. Requests it leaves alone go to the real
engine underneath, so everything else stays real I/O.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.io.base import TIMED_OUT, IoEngine, IoRequest, OnComplete

_DIRECT_ALIGN = 4096
FAULT_KINDS = ("error", "short", "torn_write", "latency", "hang")


@dataclass
class Fault:
    """Applies to requests for which `match` is true (reads/writes as selected)."""

    kind: str
    reads: bool = True
    writes: bool = False
    error: int = errno.EIO
    delay_s: float = 0.0
    remaining: int | None = None  # None: every matching request
    match: Callable[[IoRequest], bool] | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {FAULT_KINDS}")

    def applies(self, request: IoRequest) -> bool:
        if (request.write and not self.writes) or (not request.write and not self.reads):
            return False
        if self.remaining is not None and self.remaining <= 0:
            return False
        return self.match is None or self.match(request)


class FaultyEngine(IoEngine):
    name = "faulty"

    def __init__(self, inner: IoEngine) -> None:
        super().__init__(inner.queue_depth)
        self.inner = inner
        self.faults: list[Fault] = []
        self.injected = 0
        self._released = threading.Event()
        self._lock = threading.Lock()

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def release(self) -> None:
        """Let every hung request finish (with a timeout result); call in teardown."""
        self._released.set()

    def _pick(self, request: IoRequest) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.applies(request):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                    self.injected += 1
                    return fault
        return None

    def run(self, requests: Sequence[IoRequest], timeout_s: float | None = None,
            on_complete: OnComplete | None = None) -> list[int]:
        start = time.monotonic()
        picked = [self._pick(r) for r in requests]
        passthrough = [i for i, f in enumerate(picked) if f is None or f.kind == "latency"]
        results = [0] * len(requests)
        delay = max((f.delay_s for f in picked if f is not None and f.kind == "latency"), default=0)
        if delay:
            time.sleep(delay)
        if passthrough:
            for i, res in zip(passthrough, self.inner.run([requests[i] for i in passthrough],
                                                          timeout_s), strict=True):
                results[i] = res
        for i, fault in enumerate(picked):
            if fault is not None and fault.kind != "latency":
                results[i] = self._apply(fault, requests[i], timeout_s, start)
        if delay and timeout_s is not None and delay > timeout_s:
            results = [TIMED_OUT] * len(requests)
        if on_complete is not None:
            for i, result in enumerate(results):
                if result != TIMED_OUT:
                    on_complete(i, result)
        return results

    def _apply(self, fault: Fault, request: IoRequest, timeout_s: float | None,
               start: float) -> int:
        if fault.kind == "error":
            return -fault.error
        if fault.kind == "hang":
            budget = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - start))
            self._released.wait(budget)
            return TIMED_OUT
        if fault.kind == "short":
            full = self.inner.run([request])[0]
            return full // 2 if full > 0 else full
        # torn_write: only the first half of the bytes reach the device, success is reported.
        half = request.nbytes // 2 // _DIRECT_ALIGN * _DIRECT_ALIGN  # O_DIRECT-legal length
        kept, total = [], 0
        for buf in request.buffers:
            take = min(len(buf), half - total)
            if take <= 0:
                break
            kept.append(buf[:take])
            total += take
        torn = IoRequest(request.fd, request.offset, kept, write=True)
        result = self.inner.run([torn])[0]
        return request.nbytes if result >= 0 else result

    def close(self) -> None:
        self.release()
        self.inner.close()
