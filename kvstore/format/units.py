"""Human-readable byte sizes ("16GiB", "4MiB", 512) in configs and on the command line, and
write rates: a size a day, or drive writes per day ("0.5 dwpd")."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DWPD_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*dwpd\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Return a byte count; raises ValueError naming the bad text."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative: {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"not a size: {value!r}")
    match = _SIZE_RE.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 512, 64KiB, 4MiB, 16GiB, 2TiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(nbytes: float) -> str:
    """Binary units with three significant digits, for tables and logs."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f}{unit}" if unit == "B" else f"{nbytes:.3g}{unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def drive_writes(value: int | str) -> float | None:
    """The drive writes per day `value` names ("0.5 dwpd" -> 0.5), or None if it is not so written."""
    match = _DWPD_RE.match(value) if isinstance(value, str) else None
    return float(match.group(1)) if match else None


def parse_write_budget(value: int | str, device_bytes: int) -> int:
    """Bytes a day: a size (`2TiB`, a number of bytes), or drive writes per day (`0.5 dwpd`)
    of a device of `device_bytes`; raises ValueError naming the bad text."""
    per_drive = drive_writes(value)
    if per_drive is not None:
        return int(per_drive * device_bytes)
    try:
        return parse_size(value)
    except ValueError:
        raise ValueError(f"not a write budget: {value!r} (a size a day, e.g. 2TiB, or drive writes "
                         "per day, e.g. 0.5 dwpd)") from None
