"""Exceptions that name what went wrong, so a user can fix it without reading code."""

from __future__ import annotations

from kvstore.format.secrets import masked


class KVStoreError(Exception):
    """Base class for every error kvstore raises on purpose."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value is invalid; `field` is its dotted path, `value` what was given
    (the message masks any password in it: a config error is printed and logged)."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(masked(f"config field '{field}' = {value!r}: {reason}"))


class DeviceError(KVStoreError, OSError):
    """A storage path cannot be used (missing, too small, locked, wrongly formatted)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"{path}: {reason}")


class ShapeError(KVStoreError, ValueError):
    """A caller buffer does not fit the record it should receive or hold."""


class BadKeyError(KVStoreError, ValueError):
    """A chunk key is not a 16-byte key (kvstore.format.keys.chunk_keys makes them)."""
