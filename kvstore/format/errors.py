"""Exceptions that name what went wrong, so a user can fix it without reading code."""

from __future__ import annotations

import re

# scheme://user:PASSWORD@host: the password (no / or @ in it: a URL quotes those)
_URL_PASSWORD = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@'\"]*:)[^\s/@'\"]*@")


def masked(text: str) -> str:
    """`text` with the password of every URL in it hidden (`redis://user:***@host`), for any
    message that may quote a config (an index URL's password) and reach a log or a client."""
    return _URL_PASSWORD.sub(r"\1***@", text)


class KVStoreError(Exception):
    """Base class for every error kvstore raises on purpose."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value is invalid; `field` is its dotted path, `value` what was given."""

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
