"""A fault-injecting wrapper around a real engine: errors, short reads, torn writes,
latency, requests that land late and requests that never return (until released).

It exists to prove that every failure the hardware can produce becomes a counted
miss and never wrong data or a hang. Requests it leaves alone go to the real
engine underneath, so everything else stays real I/O. A faulted request holds its
memory as a real one would (base.py): a late one until the real engine has carried it
out, a hung one until `release`.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.io.base import TIMED_OUT, IoEngine, IoRequest, OnComplete

_DIRECT_ALIGN = 4096
FAULT_KINDS = ("error", "short", "torn_write", "latency", "late", "hang")


@dataclass(eq=False)
class Fault:
    """Applies to requests for which `match` is true (reads/writes as selected). A `late`
    request is carried out by the real engine once `land` is called (or `delay_s` after
    it was sent, if set); its caller waits for it until its deadline, no longer."""

    kind: str
    reads: bool = True
    writes: bool = False
    error: int = errno.EIO
    delay_s: float = 0.0
    remaining: int | None = None  # None: every matching request
    match: Callable[[IoRequest], bool] | None = None
    _landing: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _landed: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0), init=False,
                                         repr=False)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {FAULT_KINDS}")

    def applies(self, request: IoRequest) -> bool:
        if (request.write and not self.writes) or (not request.write and not self.reads):
            return False
        if self.remaining is not None and self.remaining <= 0:
            return False
        return self.match is None or self.match(request)

    def land(self) -> None:
        """Let this fault's late requests land: now and from now on."""
        self._landing.set()

    def landing(self) -> None:
        """Wait until a late request may land."""
        self._landing.wait(self.delay_s or None)

    def carried_out(self) -> None:
        """A late request has landed (its memory given back)."""
        self._landed.release()

    def wait_landed(self, timeout_s: float) -> bool:
        """Wait for one more of its late requests to land; False if none did in `timeout_s`."""
        return self._landed.acquire(timeout=timeout_s)


class FaultyEngine(IoEngine):
    name = "faulty"

    def __init__(self, inner: IoEngine) -> None:
        super().__init__(inner.queue_depth)
        self.inner = inner
        self.faults: list[Fault] = []
        self.injected = 0
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._hung: list[IoRequest] = []  # until `release`
        self._late: list[Fault] = []  # late faults applied (`release` lands them)

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()

    def release(self) -> None:
        """Let every hung request finish (with a timeout result, its memory untouched) and
        every late one land; call in teardown."""
        with self._lock:
            self._released.set()
            hung, self._hung = self._hung, []
            late = list(self._late)
        for request in hung:
            request.landed()
        for fault in late:
            fault.land()

    def _pick(self, request: IoRequest) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.applies(request):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                    self.injected += 1
                    if fault.kind == "late" and fault not in self._late:
                        self._late.append(fault)
                    return fault
        return None

    def _run(self, requests: Sequence[IoRequest], timeout_s: float | None,
             on_complete: OnComplete | None) -> list[int]:
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
        budget = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - start))
        if fault.kind == "late":
            return self._late_result(fault, request, budget)
        if fault.kind == "hang":
            self._released.wait(budget)
            with self._lock:
                if not self._released.is_set():
                    self._hung.append(request)
                    return TIMED_OUT
            request.landed()
            return TIMED_OUT
        if fault.kind == "error":
            request.landed()
            return -fault.error
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
        torn = IoRequest(request.fd, request.offset, request.memory, write=True, views=kept)
        result = self.inner.run([torn])[0]
        request.landed()
        return request.nbytes if result >= 0 else result

    def _late_result(self, fault: Fault, request: IoRequest, budget: float | None) -> int:
        """The request goes to the real engine on a thread of its own once the fault lets it
        land (which lands it, handing its memory back); the caller waits `budget` at most."""
        result: list[int] = []
        done = threading.Event()

        def land() -> None:
            fault.landing()
            result.append(self.inner.run([request])[0])
            done.set()
            fault.carried_out()

        threading.Thread(target=land, name="kvstore-io-late-fault", daemon=True).start()
        return result[0] if done.wait(budget) else TIMED_OUT

    def close(self) -> None:
        self.release()
        self.inner.close()
