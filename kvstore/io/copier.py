"""Byte copies between buffers, large ones shared out across a few threads.

One core's memcpy moves about half of what the memory bus gives (measured here: 5.4
GiB/s on one core, 10-11 GiB/s for torch's threaded copy on two), and a DRAM get is
a copy: it must keep pace with a plain threaded copy of the same bytes. numpy's copy
releases the GIL, so plain threads run the pieces in parallel. The calling thread
takes pieces too and waits only for pieces a helper has started, never for a helper
that has not been scheduled yet (on a busy machine one may not run for a whole time
slice): a stall costs at most one piece.

glibc's memcpy streams a copy past the cache (non-temporal stores: no read of the
destination first) only from a size it sets by the cache's (`x86_non_temporal_threshold`,
181 MiB on this machine's 480 MiB L3), so copies of a block or a hash piece pay that read:
a load into vLLM's CPU KV blocks (512 KiB copies) ran at 6.1 GiB/s on one core here
against 9.9 with the threshold under them, and a put (hashed and copied 256 KiB at a
time) at 4.5 against 6.5. The threshold is set only at a process's start (GLIBC_TUNABLES):
`with_streaming` is the environment to start a process in (the service kvstore spawns),
`streaming_tunable` what to tell the user of a process already started.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
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
    helpers = _helpers()
    if helpers == 0 or sum(len(src) for _, src in pairs) < _PARALLEL:
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
    _Share(deque(functools.partial(_copy_all, piece) for piece in pieces)).run(helpers)


def copy_checked(chunks: Sequence[tuple[memoryview, Sequence[tuple[memoryview, int]]]]) -> list[int]:
    """For each (payload, pieces): payload[at : at + len(dst)] copied into each (dst, at)
    and the whole payload's xxh3-64 taken in the same pass (format/checksum.py
    xxh3_64_scatter). Returns each payload's digest, for the caller to compare before it
    uses any. On the calling thread: these are disk hits, which come slower than one thread
    hashes and copies them (4.5 GiB/s here against the disk's 2), and two threads sharing
    the memory bus spend a fifth more CPU on the same bytes."""
    return [xxh3_64_scatter(payload, pieces) for payload, pieces in chunks]


_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
GLIBC_LEAST = 0x4040  # the least threshold glibc takes


def streaming_tunable(piece_bytes: int, threshold: int | None) -> str | None:
    """The GLIBC_TUNABLES entry under which copies of `piece_bytes` stream, or None: they do
    under `threshold` (a process's: streaming_threshold) already, or it is not known."""
    if threshold is None or threshold <= piece_bytes:
        return None
    return f"{_TUNABLE}={max(GLIBC_LEAST, piece_bytes):#x}"


def with_streaming(environ: Mapping[str, str], piece_bytes: int) -> dict[str, str]:
    """`environ` for a process to start whose copies of `piece_bytes` should stream: the
    entry added to its GLIBC_TUNABLES, unless that names a threshold already (the user's
    choice stands) or this glibc streams them anyway."""
    env = dict(environ)
    tunables = env.get("GLIBC_TUNABLES", "")
    entry = None if _TUNABLE in tunables else streaming_tunable(piece_bytes, streaming_threshold())
    if entry is not None:
        env["GLIBC_TUNABLES"] = f"{tunables}:{entry}" if tunables else entry
    return env


@functools.cache
def streaming_threshold() -> int | None:
    """The size from which this process's memcpy streams past the cache, as its dynamic
    loader reports it (glibc >= 2.33 on x86-64: `ld.so --list-tunables`, which reads the
    GLIBC_TUNABLES this process started with), or None where it cannot be asked."""
    try:
        with open("/proc/self/maps") as maps:
            loader = next((line.split()[-1] for line in maps if "/ld-linux-x86-64.so" in line), None)
        if loader is None:
            return None
        listed = subprocess.run([loader, "--list-tunables"], capture_output=True, text=True, timeout=10,
                                check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"glibc\.cpu\.x86_non_temporal_threshold: (0x[0-9a-f]+)", listed)
    return int(found.group(1), 16) if found else None


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

    def run(self, helpers: int) -> None:
        assert _pool is not None
        for _ in range(min(helpers, len(self.work) - 1)):
            _pool.submit(self.drain)
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


def _helpers() -> int:
    """Helper threads beside the caller: one fewer than the cores we may run on, at most
    _MAX_THREADS in all. The pool starts on first use, and anew in a forked child (whose
    copy of the pool has no threads: its queue would only grow)."""
    global _pool, _pool_pid
    count = min(len(os.sched_getaffinity(0)), _MAX_THREADS) - 1
    if count > 0 and (_pool is None or _pool_pid != os.getpid()):
        with _pool_lock:
            if _pool is None or _pool_pid != os.getpid():
                _pool = ThreadPoolExecutor(count, thread_name_prefix="kvstore-copy")
                _pool_pid = os.getpid()
    return count
