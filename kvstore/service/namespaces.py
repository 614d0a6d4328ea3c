"""The namespaces clients announced, so the service's owner can name what to purge.

A record's header carries its namespace digest (kvstore/format/keys.py), which says
nothing by itself. Engines announce each namespace they store under with a description:
its fields (model, weights fingerprint, generation, KV dtype and layout, chunk size,
rank, KV cache group) and a digest of its salt, never the salt itself (a cache salt may
name a user). The service keeps them by digest, with the uid that announced each and
when, in memory and in `SOCKET.namespaces` (0600 JSON in the service's private
directory, written at most every SAVE_EVERY_S and at close, read at start: a file that
cannot be read, whatever it holds, is moved aside to `.namespaces.bad`, logged and counted
as `malformed.state_file`, and the service starts without it), at most MAX_NAMESPACES (the
least recently announced go first).

Invariants: a digest keeps its first description (a later client cannot relabel it); a
description is a label, not a proof (the salt is hashed, so the digest cannot be checked
against it): a lying client can only make the owner purge records the owner did not
mean to, which costs misses, never wrong KV. Announcements are bounded (protocol.py:
MAX_ANNOUNCED per request, MAX_FIELDS fields of at most MAX_TEXT characters each): anything else is
refused with an error, and nothing of it is kept.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from kvstore.config.runtime import read_private_json, set_aside, write_private_json
from kvstore.format.errors import KVStoreError
from kvstore.format.malformed import Malformed, MalformedCounts
from kvstore.service import protocol as P
from kvstore.store.tiered import TieredStore

log = logging.getLogger(__name__)

MAX_NAMESPACES = 1 << 16
SAVE_EVERY_S = 5.0
MAX_FILE_BYTES = 48 << 20  # MAX_NAMESPACES rows of 700 bytes or so
_FIELD = re.compile(r"[a-z_]{1,32}")


class _Row(msgspec.Struct):
    """One namespace as the file keeps it (its shape bounds the file's nesting)."""

    namespace: str
    description: dict[str, str | int]
    uid: int
    first: float
    last: float


class NamespaceBook:
    """Announced namespaces by digest: `announce`, `entries`, `close` (writes them), and
    `handle`, which answers the protocol's requests about them."""

    def __init__(self, path: str | None, malformed: MalformedCounts | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, dict[str, Any]] = OrderedDict()
        self._saved_at = 0.0
        self._dirty = False
        self._load(malformed or MalformedCounts(log))

    def handle(self, uid: int, store: TieredStore | None,
               request: P.Announce | P.Namespaces | P.Purge) -> Any:
        """Announcements from any client (`uid`); listing and purging for the service's owner
        only: a purge deletes other users' records, and `allowed_uids` clients may not."""
        if isinstance(request, P.Announce):
            self.announce(uid, request.namespaces)
            return None
        if uid != os.geteuid():
            raise KVStoreError(f"'{type(request).__name__.lower()}' is for the service's owner (uid "
                               f"{os.geteuid()}); uid {uid} may only use the store")
        if isinstance(request, P.Namespaces):
            return self.entries()
        if store is None:
            return {"chunks": 0, "bytes": 0, "host_chunks": 0, "disk_chunks": 0, "unread": 0, "removed": 0}
        log.warning("purge%s of %d namespaces by uid %d", " (dry run)" if request.dry_run else "",
                    len(request.namespaces), uid)
        return store.purge(request.namespaces, dry_run=request.dry_run)

    def announce(self, uid: int, namespaces: Sequence[tuple[bytes, Mapping[str, str | int]]]) -> None:
        if len(namespaces) > P.MAX_ANNOUNCED:
            raise KVStoreError(f"{len(namespaces)} namespaces in one announcement; "
                               f"at most {P.MAX_ANNOUNCED}")
        checked = [(digest, _checked(digest, description)) for digest, description in namespaces]
        now = time.time()
        with self._lock:
            for digest, description in checked:
                entry = self._entries.pop(digest, None)
                if entry is None:
                    entry = {"description": description, "uid": uid, "first": now}
                    self._dirty = True
                entry["last"] = now
                self._entries[digest] = entry
            while len(self._entries) > MAX_NAMESPACES:
                self._entries.popitem(last=False)
            if self._dirty and now - self._saved_at >= SAVE_EVERY_S:
                self._save(now)

    def entries(self) -> list[dict[str, Any]]:
        """Every namespace: {"namespace": hex digest, "description", "uid", "first", "last"}."""
        with self._lock:
            return [{"namespace": digest.hex(), **entry} for digest, entry in self._entries.items()]

    def close(self) -> None:
        with self._lock:
            if self._dirty:
                self._save(time.time())

    def _load(self, malformed: MalformedCounts) -> None:
        if self.path is None:
            return
        try:
            stored = read_private_json(self.path, list[_Row], MAX_FILE_BYTES) or []
            for row in stored[-MAX_NAMESPACES:]:
                digest = bytes.fromhex(row.namespace)
                self._entries[digest] = {"description": _checked(digest, row.description),
                                         "uid": row.uid, "first": row.first, "last": row.last}
        except Exception as exc:  # whatever the file holds: the service starts without it
            self._entries.clear()
            why = f"{self.path}: {type(exc).__name__}: {str(exc)[:300]}; {set_aside(self.path)}"
            malformed.count(Malformed("state_file", why), "starting without the namespaces it held")

    def _save(self, now: float) -> None:
        """Written whole to a temporary file, renamed over the old one (lock held)."""
        self._saved_at, self._dirty = now, False
        if self.path is None:
            return
        rows = [{"namespace": digest.hex(), **entry} for digest, entry in self._entries.items()]
        try:
            write_private_json(self.path, rows)
        except (OSError, KVStoreError) as exc:
            log.warning("announced namespaces not written to %s (%s)", self.path, exc)


def _checked(digest: Any, description: Any) -> dict[str, str | int]:
    """The description as kept, or KVStoreError saying what is wrong with it."""
    if not isinstance(digest, bytes) or len(digest) != 16:
        raise KVStoreError("an announced namespace digest must be 16 bytes")
    if not isinstance(description, Mapping) or len(description) > P.MAX_FIELDS:
        raise KVStoreError(f"a namespace description must be a mapping of at most {P.MAX_FIELDS} "
                           "fields")
    kept: dict[str, str | int] = {}
    for name, value in description.items():
        if not isinstance(name, str) or not _FIELD.fullmatch(name):
            raise KVStoreError(f"namespace field {str(name)[:40]!r}: names are {_FIELD.pattern}")
        if isinstance(value, bool) or not isinstance(value, str | int) or (
                isinstance(value, str) and len(value) > P.MAX_TEXT) or (
                isinstance(value, int) and not -(1 << 63) <= value < 1 << 63):
            raise KVStoreError(f"namespace field {name!r}: a string of at most {P.MAX_TEXT} "
                               "characters or a 64-bit integer")
        kept[name] = value
    return kept
