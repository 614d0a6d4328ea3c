"""Chunks moved between a client's memory and the service: the one data plane of every engine.

vLLM's worker (loads.py, saves.py, stages.py) and the engines that name pages by address
(page_io.py: SGLang's HiCache, LMCache) fetch, release and store through a `Transfers`:

- fetch: where this process maps the service's DRAM tier, the service pins what it holds
  there (a lease; a disk hit is read into a DRAM slot and verified there first) and the
  caller copies straight out of the tier; the rest the service fills into window slots
  (DRAM copy or O_DIRECT read, checksummed). `fetch_waves` runs a list of keys in equal
  waves of at most half the window (`wave_plan`: the last one's last quarter a wave of
  its own), the next wave's fetch running on a thread of its own while the caller copies
  the current one; each wave's lease goes back with the next Pin sent after its copy (the
  last ones in one Unpin).
- store: window slots handed to the service as one chain, head first: the first chunk's
  parent is the one given (the chunk before it in the engine's sequence), each next
  chunk's parent the one before it (`chain_parent`: a sequence stored in several waves
  stays one chain, as the parent links feed leaf-first eviction and the depth and family
  that `cost` eviction and `predicted` admission use). `store_waves` stores a list in the
  same waves a fetch takes, each wave gathered into one half of the window while the
  wave before it is put from the other (PageIO's saves); vLLM's saves gather within
  their engine step and put behind it (saves.py), by the same wave and parent rules.
- failure: a `KVStoreError` (or any other fault) is logged, the connection dropped
  (which releases every pin it holds) and the chunks it carried miss; a miss is never an
  exception to the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from connectors.link import ServiceLink
from connectors.worker_threads import pool
from kvstore.format.errors import KVStoreError
from kvstore.service.client import StoreClient
from kvstore.service.client_memory import ClientMemory

log = logging.getLogger("kvstore.transfer")


@dataclass
class Fetched:
    """One wave's chunks: j is pinned in the mapped tier at offsets[j] (>= 0), or in window
    slot first_slot + j where in_window[j]; neither is a miss. `lease` holds the pins
    until `Transfers.release`. checks[j], where set, is the xxh3-64 chunk j's bytes in the
    tier must have (a disk hit the service left for the copy to verify: one pass); the
    copy names the keys it verified in `good` and those whose bytes had another in `bad`
    (it uses none of those: a miss)."""

    first_slot: int
    offsets: list[int]
    in_window: list[bool]
    lease: int | None = None
    checks: list[int | None] = field(default_factory=list)
    good: list[bytes] = field(default_factory=list)
    bad: list[bytes] = field(default_factory=list)

    def check(self, j: int) -> int | None:
        return self.checks[j] if j < len(self.checks) else None

    def source(self, memory: ClientMemory, j: int) -> memoryview | None:
        """Chunk j's verified bytes in the fetching client's `memory` (valid until the
        wave is released), None on a miss."""
        if self.offsets[j] >= 0:
            return memory.tier_payload(self.offsets[j])
        return memory.slot(self.first_slot + j) if self.in_window[j] else None


Copy = Callable[[range, Fetched], None]  # copies one wave (its indices into the keys) out
Gather = Callable[[range, int], None]  # copies one wave (indices into the keys) into slots from one
TAIL_SPLIT = 8  # a last wave of at least this many chunks leaves its last quarter for a wave of its own


def wave_plan(count: int, half: int) -> list[range]:
    """`count` keys in order, in as few waves as fit in `half`, of equal size, the last
    wave's last quarter a wave of its own. Each wave's copy runs while the next wave is
    fetched, so a wave should be no shorter than the one before it is long to copy (a
    read is several times slower than the copy out): equal waves, not whole ones and a
    remainder of one or two. Only the last wave's copy runs after every fetch has ended:
    split off, it is a quarter wave's copy instead of a whole one."""
    if count == 0:
        return []
    size = -(-count // -(-count // half))  # the waves needed, shared out evenly
    waves = [range(start, min(start + size, count)) for start in range(0, count, size)]
    if len(waves[-1]) >= TAIL_SPLIT:
        last = waves.pop()
        cut = last.stop - len(last) // 4
        waves += [range(last.start, cut), range(cut, last.stop)]
    return waves


def chain_parent(keys: Sequence[bytes], start: int, parent: bytes | None) -> bytes | None:
    """The parent of keys[start] in a chain stored in waves: the key before it, or for the
    first, the chain's `parent` (the chunk before them in the engine's sequence)."""
    return keys[start - 1] if start else parent


def _handed_back(waves: Sequence[Fetched]) -> tuple[list[int], list[bytes], list[bytes]]:
    """The leases of `waves` that are still held, and what their copies verified; each
    lease is taken once (the wave's `lease` is then None), so it is given back once."""
    leases: list[int] = []
    good: list[bytes] = []
    bad: list[bytes] = []
    for wave in waves:
        if wave.lease is not None:
            leases.append(wave.lease)
            good += wave.good
            bad += wave.bad
            wave.lease = None
    return leases, good, bad


class Transfers:
    """Fetches and stores over one `ServiceLink`. Invariants: one request at a time on the
    link's connection (the caller holds it; `fetch_waves` sends its fetches and releases
    from one thread, in order); every lease a fetch took is released exactly once, or
    dropped with its connection."""

    def __init__(self, link: ServiceLink, name: str) -> None:
        self.link = link
        self._fetcher = pool(f"kvstore-{name}-fetch")  # the next wave's fetch

    def fetch(self, client: StoreClient, keys: Sequence[bytes], first_slot: int = 0,
              checks_copies: bool = False, done: Sequence[Fetched] = ()) -> Fetched:
        """One wave: pin what the mapped tier can hold (disk hits promoted there first; with
        `checks_copies`, the copy verifies them, not the service), the rest into window slots
        from `first_slot`. All misses once the link dropped `client`. The leases of `done`
        (waves copied) are given back by the same Pin, before it pins (`release`). Raises
        what its requests raised: the caller drops the connection (`failed`), but only once
        no copy reads the tier under the pins it holds (`fetch_waves`)."""
        fetched = Fetched(first_slot, [-1] * len(keys), [False] * len(keys))
        leases, good, bad = _handed_back(done)
        if self.link.peek() is not client:
            return fetched
        if client.memory.tier is not None:
            fetched.lease, fetched.offsets, fetched.checks = client.pin(
                keys, not checks_copies, leases, good, bad)
        rest = [j for j, offset in enumerate(fetched.offsets) if offset < 0]
        if rest and client.memory.window is not None:
            found = client.get([keys[j] for j in rest], [first_slot + j for j in rest])
            for j, ok in zip(rest, found, strict=True):
                fetched.in_window[j] = ok
        return fetched

    def release(self, client: StoreClient, waves: Sequence[Fetched]) -> None:
        """Unpin the waves' leases, each once, in one round trip (their sources are no
        longer to be read)."""
        leases, good, bad = _handed_back(waves)
        if not leases or self.link.peek() is not client:
            return  # no pins, or a dropped connection released them
        try:
            client.unpin(leases, good, bad)
        except Exception as exc:  # a fault past the service's errors too: the drop releases them
            self.failed("release", exc)

    def fetch_waves(self, client: StoreClient, keys: Sequence[bytes], copy: Copy,
                    checks_copies: bool = False) -> None:
        """Fetch `keys` in waves of at most half the window (`wave_plan`) and `copy` each, the
        next wave's fetch running while this one is copied (into the other half of the window).
        A wave's lease goes back with the first fetch sent after its copy (that fetch's Pin
        gives it back before pinning, so the pins held never pass the window); the last
        waves' in one Unpin, on the fetch thread. On return no fetch is writing the window
        and no pin is held, also when `copy` raised: W waves are W Pins and one Unpin. A
        fetch that fails (any fault) ends the requests: the waves after it miss, and the
        connection, with every pin it holds, is dropped only after the last copy, as a copy
        out of the tier reads under the pins of its wave (dropped under it, another client's
        put could reuse the slot mid-copy). `checks_copies`: the copy verifies the disk hits
        the service leaves unverified (Fetched.checks)."""
        half = max(1, client.memory.slots // 2)
        ahead = client.memory.slots >= 2  # a window of one slot cannot fetch ahead
        waves = wave_plan(len(keys), half)
        if not waves:
            return

        fault: list[Exception] = []  # the first fetch's: no request goes out after it

        def fetch(k: int, done: list[Fetched]) -> Fetched:
            wave, first = [keys[i] for i in waves[k]], half * (k % 2) if ahead else 0
            if not fault:
                try:
                    return self.fetch(client, wave, first, checks_copies, done)
                except Exception as exc:  # its Unpin done or not: the drop below undoes it all
                    fault.append(exc)
            _handed_back(done)  # released with the connection
            return Fetched(first, [-1] * len(wave), [False] * len(wave))

        copied: list[Fetched] = []  # waves copied whose leases the next fetch gives back
        next_fetch = self._fetcher.submit(fetch, 0, [])
        taken: Future[Fetched] | None = None  # the last fetch whose wave the loop copies
        try:
            for k, wave in enumerate(waves):
                fetched, taken = next_fetch.result(), next_fetch
                if k + 1 < len(waves) and ahead:
                    next_fetch, copied = self._fetcher.submit(fetch, k + 1, copied), []
                try:
                    copy(wave, fetched)
                finally:
                    copied.append(fetched)
                if k + 1 < len(waves) and not ahead:
                    next_fetch, copied = self._fetcher.submit(fetch, k + 1, copied), []
        finally:
            try:
                last = next_fetch.result()  # bounded by the service deadline
                if next_fetch is not taken:
                    copied.append(last)
            finally:  # also when that fetch raised: the waves copied go back
                self._fetcher.submit(self._settle, client, copied, fault).result()

    def _settle(self, client: StoreClient, copied: list[Fetched], fault: list[Exception]) -> None:
        """After the last copy: the waves' leases go back, or after a fetch's fault the
        connection is dropped, and every pin it held with it."""
        if not fault:
            self.release(client, copied)
        elif self.link.peek() is client:
            self.failed("fetch", fault[0])

    def store_waves(self, client: StoreClient, keys: Sequence[bytes], gather: Gather,
                    parent: bytes | None, namespace: bytes | None = None) -> list[bool]:
        """Store `keys` as one chain under `parent`, in the waves `wave_plan` makes of half
        the window: `gather(wave, first_slot)` copies a wave's chunks into window slots
        from first_slot (on the caller's thread) while the wave before it is put, on the
        transfer thread, from the other half. Returns, True per chunk stored, once every
        put has; on a failed one the rest are not gathered (they would miss too)."""
        half = max(1, client.memory.slots // 2)
        done = [False] * len(keys)
        putting: Future[None] | None = None

        def put(wave: range, first: int) -> None:
            done[wave.start : wave.stop] = self.store(client, [keys[i] for i in wave],
                                                      range(first, first + len(wave)),
                                                      chain_parent(keys, wave.start, parent), namespace)

        try:
            for k, wave in enumerate(wave_plan(len(keys), half)):
                first = half * (k % 2) if client.memory.slots >= 2 else 0
                if client.memory.slots < 2 and putting is not None:
                    putting.result()  # one slot: its put before the next gather
                if self.link.peek() is not client:
                    break
                gather(wave, first)
                if putting is not None:
                    putting.result()  # one request at a time on the connection
                putting = self._fetcher.submit(put, wave, first)
        finally:
            if putting is not None:
                putting.result()  # nothing is left reading the window
        return done

    def store(self, client: StoreClient, keys: Sequence[bytes], slots: Sequence[int],
              parent: bytes | None, namespace: bytes | None = None) -> list[bool]:
        """Store keys[i] from window slot slots[i] as one chain under `parent` (None: the
        chain starts here); their headers name `namespace` (None: the client's). False
        where a chunk was not stored."""
        if self.link.peek() is not client:
            return [False] * len(keys)
        try:
            return client.put(keys, slots, parent, namespace)
        except Exception as exc:  # a fault past the service's errors too: the chunks miss
            self.failed("store", exc)
            return [False] * len(keys)

    def failed(self, what: str, exc: Exception) -> None:
        """The one failure path: log, and drop the connection (which releases every pin it
        holds); the link reconnects, rate-limited, on a later `get`. A fault other than the
        service's errors (a reply that cannot be taken apart, a bug) is logged with its trace."""
        log.warning("kvstore %s failed (%s); its chunks miss", what, exc,
                    exc_info=not isinstance(exc, KVStoreError))
        self.link.fail()

    def close(self) -> None:
        """Stop the fetch thread and close the link's connection."""
        self._fetcher.shutdown(wait=True)
        self.link.close()
