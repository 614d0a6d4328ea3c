"""The store's API edge: keys and buffers checked once, with errors that name the fix.

Past this edge every key is 16 bytes and every buffer a byte view of exactly one chunk
(writable for a get, and not one a read that missed its deadline may still land in).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.format.errors import BadKeyError, ShapeError
from kvstore.format.keys import KEY_BYTES
from kvstore.io.aligned import byte_view
from kvstore.io.regions import DirectRegions


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """The keys as a list, or BadKeyError naming the first bad one."""
    keys = list(keys)
    if set(map(type, keys)) <= {bytes} and set(map(len, keys)) <= {KEY_BYTES}:
        return keys  # the common case, checked at C speed: a lookup is on every request
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            what = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
            raise BadKeyError(f"key {i} is {what}; chunk keys are {KEY_BYTES} bytes "
                              "(kvstore.format.keys.chunk_keys)")
    return keys


def chunk_views(buffers: Sequence[Any], count: int, chunk_bytes: int, *, writable: bool,
                regions: DirectRegions | None = None) -> list[memoryview]:
    """One byte view per buffer, or ShapeError naming the first unfit one. `regions`:
    the store's direct-read regions: a get is refused a buffer a late read may still land in."""
    if len(buffers) != count:
        raise ShapeError(f"{count} keys but {len(buffers)} buffers")
    views = []
    for i, buffer in enumerate(buffers):
        try:
            view = byte_view(buffer)
        except (TypeError, ValueError) as exc:
            raise ShapeError(f"buffer {i}: {exc}") from None
        if len(view) != chunk_bytes:
            raise ShapeError(f"buffer {i} has {len(view)} bytes; this store's chunks are "
                             f"{chunk_bytes} bytes")
        if writable and view.readonly:
            raise ShapeError(f"buffer {i} is read-only: a get writes the chunk into it")
        if regions is not None and regions.late(view):
            raise ShapeError(f"buffer {i} is still lent to a read that missed its deadline "
                             "(the device may still write it): take new ones with "
                             "TieredStore.buffers(), or use it again once that read has landed")
        views.append(view)
    return views
