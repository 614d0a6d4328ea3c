"""Payload checksums (xxh3-64) computed without holding the GIL.

The `xxhash` package's Python functions hold the GIL while they hash, so a thread
verifying a 32 MiB chunk (about 2 ms) stops every other thread of the service. The
same wheel's C library exports `XXH3_64bits_dispatch` (the SIMD-dispatching entry
point): called through ctypes, which releases the GIL around foreign calls, the
identical hash runs while other threads work. Where the symbol is missing (another
build of the package), the Python function is used: same digest, GIL held.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
from typing import Any

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


_XXH3 = _native()
_SMALL = 1 << 16  # below this the ctypes call costs more than the GIL it frees


def xxh3_64(data: memoryview | bytes) -> int:
    """xxh3-64 (seed 0) of `data`, equal to xxhash.xxh3_64_intdigest(data)."""
    view = memoryview(data)
    if _XXH3 is None or view.nbytes < _SMALL or view.readonly:  # ctypes needs a writable view
        return xxhash.xxh3_64_intdigest(view)
    address = ctypes.addressof(ctypes.c_char.from_buffer(view.cast("B")))
    return int(_XXH3(address, view.nbytes))
