"""Whether a vLLM CPU worker's loads copy with streaming stores, and where they do not, what
would have them.

A load copies each chunk into the KV blocks one layer's block at a time (layout.py). glibc's
memcpy streams a copy past the cache (no read of the destination first) only from its
`x86_non_temporal_threshold`, which it sets from the cache's size, often above a block: the
copies then read every destination line before writing it. The threshold is fixed when the
process starts, so the worker cannot change it for itself; it says, once at start, the
GLIBC_TUNABLES that vLLM would need (measured in docs/vllm.md: a 512 MiB DRAM hit's load
took 65 ms instead of 100 on one core).
"""

from __future__ import annotations

GLIBC_LEAST = 0x4040  # the least x86_non_temporal_threshold glibc accepts


def streaming_advice(piece_bytes: int, threshold: int | None) -> str | None:
    """The line to log for copies of `piece_bytes`, or None: they stream already, or this
    process's threshold is not known (not glibc on x86-64)."""
    if threshold is None or threshold <= piece_bytes:
        return None
    wanted = max(GLIBC_LEAST, piece_bytes)
    return (f"a load copies pieces of {piece_bytes} bytes (one layer's block), under this process's "
            f"streaming-store threshold ({threshold} bytes): start vLLM with GLIBC_TUNABLES="
            f"glibc.cpu.x86_non_temporal_threshold={wanted:#x} for faster loads (docs/vllm.md)")
