"""Memory that I/O lands in (aligned buffers, staging pools, direct regions, the copier) and the I/O
engines: `uring` (io_uring) and `threads` (preadv/pwritev pool), chosen by name."""

from __future__ import annotations

import logging

from kvstore.io.base import IoEngine, IoRequest
from kvstore.io.threads import ThreadsEngine

log = logging.getLogger(__name__)

__all__ = ["IoEngine", "IoRequest", "ThreadsEngine", "make_engine"]


def make_engine(name: str, queue_depth: int) -> IoEngine:
    """`auto` tries io_uring and falls back to threads with a logged reason."""
    if name == "threads":
        return ThreadsEngine(queue_depth)
    if name not in ("uring", "auto"):
        raise ValueError(f"unknown I/O engine {name!r} (auto, uring, threads)")
    try:
        from kvstore.io.uring import UringEngine

        return UringEngine(queue_depth)
    except (ImportError, OSError) as exc:
        if name == "uring":
            raise OSError(f"io_uring engine unavailable: {exc}") from exc
        log.warning("io engine auto: io_uring unavailable (%s); using threads", exc)
        return ThreadsEngine(queue_depth)
