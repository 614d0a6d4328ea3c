"""glibc's streaming-store threshold: what a process has, and what to start one with.

glibc's memcpy streams a copy past the cache (non-temporal stores: no read of the
destination first) only from a size it derives from the cache's (`x86_non_temporal_threshold`),
often far above the pieces kvstore copies: one layer's KV block in a load, a 256 KiB hash
piece in a put (format/checksum.py). Those copies then read every destination line before
writing it (measured in docs/benchmarks.md: a put's copy and hash, a vLLM CPU load). The
threshold is read once, when a process starts, from GLIBC_TUNABLES: `with_streaming` is the
environment to start a process in (the service kvstore spawns), `streaming_tunable` the
entry to tell the user of a process already running (a vLLM worker). Whether a copy of
exactly the threshold streams differs between glibc's copy loops, so the entry asked for
is half a piece.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from collections.abc import Mapping

TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
GLIBC_LEAST = 0x4040  # the least threshold glibc takes


def streaming_tunable(piece_bytes: int, threshold: int | None) -> str | None:
    """The GLIBC_TUNABLES entry under which copies of `piece_bytes` stream, or None: they do
    under `threshold` already, or it is not known."""
    if threshold is None or threshold < piece_bytes:
        return None
    return f"{TUNABLE}={max(GLIBC_LEAST, piece_bytes // 2):#x}"


def with_streaming(environ: Mapping[str, str], piece_bytes: int) -> dict[str, str]:
    """`environ` for a process to start whose copies of `piece_bytes` should stream: its
    GLIBC_TUNABLES with the entry, which takes the place of an inherited threshold that
    would not stream them (the engine's, chosen for its own copies); every other entry is
    kept, and nothing changes where the threshold they give streams them already."""
    env = dict(environ)
    tunables = env.get("GLIBC_TUNABLES", "")
    entry = streaming_tunable(piece_bytes, loader_threshold(tunables))
    if entry is not None:
        kept = [item for item in tunables.split(":") if item and not item.startswith(TUNABLE + "=")]
        env["GLIBC_TUNABLES"] = ":".join([entry, *kept])
    return env


def streaming_threshold() -> int | None:
    """The threshold of this process (started with the GLIBC_TUNABLES it has now)."""
    return loader_threshold(os.environ.get("GLIBC_TUNABLES", ""))


@functools.cache
def loader_threshold(tunables: str) -> int | None:
    """The threshold a process started with GLIBC_TUNABLES=`tunables` has, as this process's
    dynamic loader reports it (glibc >= 2.33 on x86-64: `ld.so --list-tunables`), or None
    where it cannot be asked (another libc or loader, a loader replaced on disk since this
    process started). Remembered per `tunables` for the process's life: it is advice."""
    loader = _loader()
    if loader is None:
        return None
    env = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    try:
        listed = subprocess.run([loader, "--list-tunables"], capture_output=True, text=True, timeout=10,
                                check=False, env=env).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"glibc\.cpu\.x86_non_temporal_threshold: (0x[0-9a-f]+)", listed)
    return int(found.group(1), 16) if found else None


def _loader() -> str | None:
    """This process's dynamic loader, by the absolute path it was mapped from, or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.rstrip("\n").split(maxsplit=5)
                path = fields[5] if len(fields) == 6 else ""
                if "/ld-linux-x86-64.so" in path:
                    return path if os.path.isabs(path) and not path.endswith(" (deleted)") else None
    except OSError:
        return None
    return None
