"""Payload checksums (xxh3-64) computed without holding the GIL.

The `xxhash` package's Python functions hold the GIL while they hash, so a thread
verifying a 32 MiB chunk (about 2 ms) stops every other thread of the service. The
same wheel's C library exports `XXH3_64bits_dispatch` (the SIMD-dispatching entry
point): called through ctypes, which releases the GIL around foreign calls, the
identical hash runs while other threads work. Where the symbol is missing (another
build of the package), the Python function is used: same digest, GIL held.

`xxh3_64_copy` verifies bytes on their way somewhere: it copies a cache-sized piece,
then hashes that piece's source while the copy has left it in cache, so a read that must
be checked and copied (a staged disk read) comes from memory once, not twice.
`xxh3_64_scatter` does the same for bytes that go to many places (a chunk into an engine's
KV blocks): each piece copied to where it goes, the whole payload hashed in order. The copy
goes first: its loads fill the cache even where its stores stream past it (io/streaming.py),
so the hash reads from cache (hash first, then copy, measured slower here: the hash's reads
from memory and the copy's writes then never overlap). The piecewise hash is the library's
SIMD-dispatching update where the build has one (AVX-512 where the CPU has it): its plain
update is the baseline SSE2 code, 24 GiB/s from cache against the dispatched one's 42-43
on an AVX-512 core (bench/lab/piece_hash.py, docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

log = logging.getLogger(__name__)


def _native() -> Any:
    """The C function, or None."""
    try:
        library = ctypes.CDLL(importlib.import_module("xxhash._xxhash").__file__)
        for name in ("XXH3_64bits_dispatch", "XXH3_64bits"):
            function = getattr(library, name, None)
            if function is not None:
                function.restype = ctypes.c_uint64
                function.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                return function
    except (ImportError, OSError, AttributeError) as exc:
        log.info("xxh3 through ctypes unavailable (%s); hashing holds the GIL", exc)
    return None


def stream_functions(update_name: str | None = None) -> Any:
    """(createState, reset, update, digest, freeState) of the C library, or None. The update
    is `update_name`'s where given, else the SIMD-dispatching one where the build has it
    (bench/lab/piece_hash.py compares the two)."""
    try:
        library = ctypes.CDLL(importlib.import_module("xxhash._xxhash").__file__)
        create, reset = library.XXH3_createState, library.XXH3_64bits_reset
        update = (getattr(library, update_name) if update_name else
                  getattr(library, "XXH3_64bits_update_dispatch", None) or library.XXH3_64bits_update)
        digest, free = library.XXH3_64bits_digest, library.XXH3_freeState
    except (ImportError, OSError, AttributeError) as exc:
        log.info("streaming xxh3 through ctypes unavailable (%s); hash and copy run apart", exc)
        return None
    create.restype, free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    reset.argtypes, reset.restype = [ctypes.c_void_p], ctypes.c_int
    update.argtypes, update.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
    digest.argtypes, digest.restype = [ctypes.c_void_p], ctypes.c_uint64
    return create, reset, update, digest, free


_XXH3 = _native()
_STREAM = stream_functions()
_SMALL = 1 << 16  # below this the ctypes call costs more than the GIL it frees
PIECE = 256 << 10  # copied, then hashed while it is still in cache (fits L2 on current cores)


def xxh3_64(data: memoryview | bytes) -> int:
    """xxh3-64 (seed 0) of `data`, equal to xxhash.xxh3_64_intdigest(data)."""
    view = memoryview(data)
    if _XXH3 is None or view.nbytes < _SMALL or view.readonly:  # ctypes needs a writable view
        return xxhash.xxh3_64_intdigest(view)
    address = ctypes.addressof(ctypes.c_char.from_buffer(view.cast("B")))
    return int(_XXH3(address, view.nbytes))


def xxh3_64_scatter(payload: memoryview, pieces: Sequence[tuple[memoryview, int]]) -> int:
    """xxh3-64 of all of `payload`, copying payload[at : at + len(dst)] into each (dst, at)
    of `pieces` in the same pass over memory (the hash reads what the copy left in cache).
    Bytes no piece takes are hashed all the same. The GIL is released throughout."""
    source = memoryview(payload).cast("B")
    targets = sorted(((at, memoryview(dst).cast("B")) for dst, at in pieces), key=lambda p: p[0])
    for at, dst in targets:
        if at < 0 or at + len(dst) > len(source):
            raise ValueError(f"a piece of {len(dst)} bytes at {at} is outside a {len(source)}-byte payload")
    if _STREAM is None or len(source) < _SMALL:
        for at, dst in targets:
            dst[:] = source[at : at + len(dst)]
        return xxh3_64(source)
    create, reset, update, digest, free = _STREAM
    state = create()
    if not state:
        raise MemoryError("XXH3_createState")
    try:
        reset(state)
        src_base = np.frombuffer(source, np.uint8).ctypes.data
        addressed = [(at, at + len(dst), ctypes.addressof(ctypes.c_char.from_buffer(dst)))
                     for at, dst in targets if len(dst)]
        first = 0  # the first piece not yet wholly copied (pieces are in payload order)
        for start in range(0, len(source), PIECE):
            end = min(start + PIECE, len(source))
            for begin, stop, address in addressed[first:]:
                if begin >= end:
                    break
                lo, hi = max(begin, start), min(stop, end)
                if lo < hi:
                    ctypes.memmove(address + lo - begin, src_base + lo, hi - lo)
            update(state, src_base + start, end - start)
            while first < len(addressed) and addressed[first][1] <= end:
                first += 1
        return int(digest(state))
    finally:
        free(state)


def xxh3_64_copy(dst: memoryview, src: memoryview) -> int:
    """Copy `src` into `dst` (same length) and return xxh3-64 of `src`, in one pass over
    memory: each piece is copied, then hashed from cache (xxh3_64_scatter, one piece)."""
    source, target = memoryview(src).cast("B"), memoryview(dst).cast("B")
    if len(source) != len(target):
        raise ValueError(f"copy of {len(source)} bytes into {len(target)}")
    return xxh3_64_scatter(source, [(target, 0)])
