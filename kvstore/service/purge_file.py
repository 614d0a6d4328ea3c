"""Purges that have not reached every record yet, kept across the service's restarts.

A purge cannot reach the records of a disk device out of service (they are zeroed when it
comes back: tiers/availability.py), nor any record while the service has no store open
(it opens at the first engine's hello, which sets its chunk size). Kept in memory only,
both were undone by a restart: the device's records, or every record of the namespace,
were served again, though the owner had purged them (cached KV reveals prompts). So the
service keeps those namespaces in `SOCKET.purges` (0600 JSON in its private directory: a
list of digests in hex) and purges them again when it opens its store, under the lock that
hands the store to the first hello, before any request can read a record.

Invariants: the file is written after each purge and when the store opens or closes, with
what is still pending then, and removed when nothing is. Between a returning device's
revalidation and the next write it may still name a namespace whose purge has completed:
a restart then purges that namespace once more, records stored since included (misses,
never KV the owner purged). A file that cannot be read, whatever it holds, is moved aside
(`.bad`), logged and counted (`malformed.state_file`): those purges are lost, as they were
before this file existed. At most MAX_PENDING namespaces wait: a purge past that is refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Collection

from kvstore.config.runtime import read_private_json, set_aside, write_private_json
from kvstore.format.errors import KVStoreError
from kvstore.format.malformed import Malformed, MalformedCounts
from kvstore.store.tiered import TieredStore

log = logging.getLogger(__name__)
SUFFIX = ".purges"  # after the service's socket path
MAX_PENDING = 1 << 16  # namespaces waiting for a store or a device (a 2.2 MiB file at most)
MAX_BYTES = MAX_PENDING * 36 + 16


class PendingPurges:
    """The namespaces whose purge is still to reach records: `purge` answers a purge, with or
    without a store; `opened` runs the pending ones on a store just made; `closing` writes
    what is left. Thread-safe (a purge request and a hello may come together)."""

    def __init__(self, socket: str, malformed: MalformedCounts) -> None:
        self.path = socket + SUFFIX
        self._lock = threading.Lock()
        self._waiting = self._load(malformed)  # purged with no store open, or read at start

    def purge(self, store: TieredStore | None, namespaces: Collection[bytes],
              dry_run: bool) -> dict[str, int]:
        """The store's purge report, with `pending`: how many namespaces still wait (for a
        device out of service; with no store open, for the store: then none is found).
        KVStoreError if more than MAX_PENDING would wait for the store."""
        if store is not None:
            report = store.admin.purge(namespaces, dry_run)
            with self._lock:  # read and written together: two purges at once write the later state
                pending = store.admin.purges_pending()
                if not dry_run:
                    self._write(pending)
            return {**report, "pending": len(pending)}
        report = {"chunks": 0, "bytes": 0, "dram_chunks": 0, "disk_chunks": 0, "unread": 0, "removed": 0}
        with self._lock:
            waiting = self._waiting | set(namespaces)
            if len(waiting) > MAX_PENDING:
                raise KVStoreError(f"{len(waiting)} namespaces would wait for the store to open; "
                                   f"at most {MAX_PENDING}")
            if not dry_run:
                self._waiting = waiting
                self._write(waiting)
            return {**report, "pending": len(waiting)}

    def opened(self, store: TieredStore) -> None:
        """Purge what waits on the store just made (before any client has it), then keep
        what a device out of service has still to see."""
        with self._lock:
            if self._waiting:
                removed = store.admin.purge(sorted(self._waiting), dry_run=False)["removed"]  # raises: kept
                log.warning("purged %d namespaces left pending at the last stop (%d chunks removed)",
                            len(self._waiting), removed)
            self._waiting = set()
            self._write(store.admin.purges_pending())

    def closing(self, store: TieredStore | None) -> None:
        """What is still pending written before the store closes."""
        with self._lock:
            self._write(sorted(self._waiting) if store is None else store.admin.purges_pending())

    def _load(self, malformed: MalformedCounts) -> set[bytes]:
        try:
            rows = read_private_json(self.path, list[str], MAX_BYTES) or []
            waiting = {bytes.fromhex(row) for row in rows}
            if len(waiting) > MAX_PENDING or any(len(digest) != 16 for digest in waiting):
                raise ValueError(f"not at most {MAX_PENDING} digests of 16 bytes")
        except Exception as exc:  # whatever the file holds: the service starts without it
            why = f"{self.path}: {type(exc).__name__}: {str(exc)[:300]}; {set_aside(self.path)}"
            malformed.count(Malformed("state_file", why), "starting without the purges it held")
            return set()
        return waiting

    def _write(self, pending: Collection[bytes]) -> None:
        """The file holds `pending`, or is gone when nothing is; a failure is logged."""
        try:
            if pending:
                write_private_json(self.path, sorted(digest.hex() for digest in pending))
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
        except (OSError, KVStoreError) as exc:
            log.warning("pending purges not written to %s (%s): a restart may serve their "
                        "records again", self.path, exc)
