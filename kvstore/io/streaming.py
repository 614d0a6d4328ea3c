"""glibc's streaming-store thresholds: what a process has, and what to start one with.

glibc's memcpy streams a copy past the cache (non-temporal stores: no read of the
destination first) only from a size it derives from the cache's (`x86_non_temporal_threshold`),
often far above the pieces kvstore copies: one layer's KV block in a load, a 256 KiB hash
piece in a put (format/checksum.py). Those copies then read every destination line before
writing it (measured in docs/benchmarks.md: a put's copy and hash, a vLLM CPU load). And a
copy of more than `x86_rep_movsb_threshold` (2 KiB or so) takes `rep movsb` first, up to a
stop that is the streaming threshold on Intel but the L2 cache's size on AMD (glibc 2.33
on): there a 256 or 512 KiB copy never reaches the streaming loop, whatever that threshold
(measured on one core of an AMD EPYC, docs/benchmarks.md: a load of 512 KiB blocks at
10.2-11.0 GiB/s with the streaming threshold alone, 11.2-12.1 with `rep movsb` kept below
them too, 10.9-12.0 with neither: there the threshold alone is worse than nothing). So
both are asked for: the streaming threshold under the pieces (half a piece: whether a copy
of exactly the threshold streams differs between glibc's copy loops) and `rep movsb` above
any L2 (REP_MOVSB_ABOVE).
They are read once, when a process starts, from GLIBC_TUNABLES: `with_streaming` is the
environment to start a process in (the service kvstore spawns), `streaming_tunable` the
entries to tell the user of a process already running (a vLLM worker).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from collections.abc import Mapping
from typing import NamedTuple

TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
REP_MOVSB = "glibc.cpu.x86_rep_movsb_threshold"
GLIBC_LEAST = 0x4040  # the least streaming threshold glibc takes
REP_MOVSB_ABOVE = 1 << 25  # above any core's L2: no copy of a piece takes `rep movsb`


class Thresholds(NamedTuple):
    """A process's glibc copy thresholds, in bytes."""

    non_temporal: int
    rep_movsb: int


def streaming_tunable(piece_bytes: int, thresholds: Thresholds | None) -> str | None:
    """The GLIBC_TUNABLES entries under which copies of `piece_bytes` and more stream, or
    None: they do under `thresholds` already, or those are not known."""
    if thresholds is None:
        return None
    entries = []
    if thresholds.non_temporal >= piece_bytes:
        entries.append(f"{TUNABLE}={max(GLIBC_LEAST, piece_bytes // 2):#x}")
    if thresholds.rep_movsb < REP_MOVSB_ABOVE:
        entries.append(f"{REP_MOVSB}={REP_MOVSB_ABOVE:#x}")
    return ":".join(entries) or None


def with_streaming(environ: Mapping[str, str], piece_bytes: int) -> dict[str, str]:
    """`environ` for a process to start whose copies of `piece_bytes` should stream: its
    GLIBC_TUNABLES with the entries, which take the place of inherited ones that would not
    stream them (the engine's, chosen for its own copies); every other entry is kept, and
    nothing changes where the thresholds they give stream them already."""
    env = dict(environ)
    tunables = env.get("GLIBC_TUNABLES", "")
    entries = streaming_tunable(piece_bytes, loader_thresholds(tunables))
    if entries is not None:
        replaced = tuple(entry.split("=", 1)[0] + "=" for entry in entries.split(":"))
        kept = [item for item in tunables.split(":") if item and not item.startswith(replaced)]
        env["GLIBC_TUNABLES"] = ":".join([entries, *kept])
    return env


def streaming_thresholds() -> Thresholds | None:
    """The thresholds of this process (started with the GLIBC_TUNABLES it has now)."""
    return loader_thresholds(os.environ.get("GLIBC_TUNABLES", ""))


@functools.cache
def loader_thresholds(tunables: str) -> Thresholds | None:
    """The thresholds a process started with GLIBC_TUNABLES=`tunables` has, as this process's
    dynamic loader reports them (glibc >= 2.33 on x86-64: `ld.so --list-tunables`), or None
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
    found = [re.search(rf"{re.escape(name)}: (0x[0-9a-f]+)", listed) for name in (TUNABLE, REP_MOVSB)]
    if found[0] is None or found[1] is None:
        return None
    return Thresholds(int(found[0].group(1), 16), int(found[1].group(1), 16))


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
