"""Byte copies between buffers, large ones shared out across a few threads.

One core's memcpy moves about half of what the memory bus gives (measured here: 5.4
GiB/s on one core, 10-11 GiB/s for torch's threaded copy on two), and a DRAM get is
a copy: it must keep pace with a plain threaded copy of the same bytes. numpy's copy
releases the GIL, so plain threads run the pieces in parallel. The calling thread
takes pieces too and waits only for pieces a helper has started, never for a helper
that has not been scheduled yet (on a busy machine one may not run for a whole time
slice): a stall costs at most one piece. Helpers run where their creator may: a caller an
engine bound to one core (vLLM's CPU worker) copies alone, unless the operator named CPUs
its copies may also use (share_with).
Whether those copies stream past the cache is glibc's choice, made by size (io/streaming.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections import deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstore.format.checksum import xxh3_64_scatter

_SMALL = 1 << 16        # below this a memoryview assignment beats numpy's call overhead
_PARALLEL = 2 << 20     # a copy of less than this in all stays on the calling thread
_PIECE = 4 << 20        # the most one thread takes at a time: bounds a straggler's cost
_MAX_THREADS = 4        # the bus is saturated well before this on the machines we know

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()
_shared_cpus: frozenset[int] = frozenset()  # CPUs helpers may run on beyond their creator's (share_with)


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src on the calling thread; large copies go through numpy, which releases
    the GIL for them, so the service's client threads copy in parallel."""
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
    if len(src) < _SMALL:
        dst[:] = src
        return
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


def copy_many(pairs: Sequence[tuple[memoryview, memoryview]]) -> None:
    """dst[:] = src for each (dst, src), shared out across the copy threads when the
    bytes are many; returns when every byte is copied."""
    for dst, src in pairs:
        if len(dst) != len(src):
            raise ValueError(f"copy of {len(src)} bytes into {len(dst)}")
    helpers, pool = _helpers()
    if pool is None or sum(len(src) for _, src in pairs) < _PARALLEL:
        for dst, src in pairs:
            copy_bytes(dst, src)
        return
    pieces: list[list[tuple[memoryview, memoryview]]] = [[]]
    size = 0
    for dst, src in pairs:
        parts = [(dst, src)] if len(src) <= _PIECE else [
            (dst[at : at + _PIECE], src[at : at + _PIECE]) for at in range(0, len(src), _PIECE)]
        for part in parts:
            if size + len(part[1]) > _PIECE and pieces[-1]:
                pieces.append([])
                size = 0
            pieces[-1].append(part)
            size += len(part[1])
    _Share(deque(functools.partial(_copy_all, piece) for piece in pieces)).run(pool, helpers)


def copy_checked(chunks: Sequence[tuple[memoryview, Sequence[tuple[memoryview, int]]]]) -> list[int]:
    """For each (payload, pieces): payload[at : at + len(dst)] copied into each (dst, at)
    and the whole payload's xxh3-64 taken in the same pass (format/checksum.py
    xxh3_64_scatter). Returns each payload's digest, for the caller to compare before it
    uses any. On the calling thread: these are disk hits, which come slower than one thread
    hashes and copies them (4.5 GiB/s here against the disk's 2), and two threads sharing
    the memory bus spend a fifth more CPU on the same bytes."""
    return [xxh3_64_scatter(payload, pieces) for payload, pieces in chunks]


def _copy_all(piece: list[tuple[memoryview, memoryview]]) -> None:
    for dst, src in piece:
        copy_bytes(dst, src)


class _Share:
    """One call's work (copies of up to _PIECE bytes in all) and the count of items done
    (an item taken is always finished: what could fail was checked before any was taken)."""

    def __init__(self, work: deque[Callable[[], None]]) -> None:
        self.work = work
        self.left = len(work)
        self.lock = threading.Lock()
        self.done = threading.Event()

    def run(self, pool: ThreadPoolExecutor, helpers: int) -> None:
        for _ in range(min(helpers, len(self.work) - 1)):
            try:
                pool.submit(self.drain)
            except RuntimeError:  # shut down by share_with meanwhile: the caller copies the rest
                break
        self.drain()
        self.done.wait()

    def drain(self) -> None:
        while True:
            try:
                item = self.work.popleft()
            except IndexError:
                return
            try:
                item()
            finally:
                with self.lock:
                    self.left -= 1
                    if self.left == 0:
                        self.done.set()


def share_with(cpus: Collection[int]) -> None:
    """Let this process's large copies also run on `cpus`, beyond the cores the calling
    thread may use: an engine binds its worker to its own cores (one, on a small machine),
    and its operator may know of CPUs no engine thread needs while a load is copied (those
    vLLM keeps for its front end). The helpers start anew, on their creator's cores and
    these; a CPU this process's cpuset refuses is left out by the kernel. Empty: back to the
    caller's cores only."""
    global _pool, _shared_cpus
    with _pool_lock:
        _shared_cpus = frozenset(cpus)
        if _pool is not None:
            _pool.shutdown(wait=False)
        _pool = None


def _helpers() -> tuple[int, ThreadPoolExecutor | None]:
    """Helper threads beside the caller (one fewer than the cores it may run on, with
    share_with's, at most _MAX_THREADS in all) and their pool, None where there are none.
    The pool starts on first use, and anew in a forked child (whose copy of the pool has no
    threads: its queue would only grow)."""
    global _pool, _pool_pid
    cores = os.sched_getaffinity(0) | _shared_cpus
    count = min(len(cores), _MAX_THREADS) - 1
    if count <= 0:
        return 0, None
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            spread = functools.partial(_run_on, cores) if _shared_cpus else None
            _pool = ThreadPoolExecutor(count, thread_name_prefix="kvstore-copy", initializer=spread)
            _pool_pid = os.getpid()
        return count, _pool


def _run_on(cores: Collection[int]) -> None:
    """A helper's CPUs: its creator's and the shared ones, as far as the cpuset allows."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cores)
