"""The namespaces clients announced, so the service's owner can name what to purge.

A record's header carries its namespace digest (kvstore/format/keys.py), which says
nothing by itself. Engines announce each namespace they store under with a description:
its fields (model, weights fingerprint, generation, KV dtype and layout, chunk size,
rank, KV cache group) and a digest of its salt, never the salt itself (a cache salt may
name a user). The service keeps them by digest, with the uid that announced each and
when, in memory and in `SOCKET.namespaces` (0600 JSON in the service's private
directory, read at start), and lists them a page at a time (`page`: a book of any size
is listed in replies that fit a frame).

Bounded, because each distinct cache salt of an HTTP request makes a vLLM engine announce
new namespaces, and an allowed user may announce what it likes: the book holds at most
MAX_NAMESPACES namespaces and MAX_BYTES of descriptions, a uid other than the service's
own at most a SHARE-th of either; what does not fit is refused, counted
(`namespaces.refused`). Room is made off the request path, on the book's own thread
(`tend`, every SAVE_EVERY_S): past CROWDED of a bound (the book's, a uid's share) the least
recently announced namespaces that hold no records go, down to ROOMY
(`namespaces.dropped`), after a scan of the records' headers (StoreProbe.namespaces: a
purge's scan, 0.3-0.6 s for 4,096 DRAM and 16,000 disk slots on this machine) at most every
TRIM_EVERY_S. The same thread writes the file, only after a change and at a bounded rate
(BookFile); an announcement never waits for a scan or a write.

Invariants: a digest keeps its first description (a later client cannot relabel it); a
description is a label, not a proof (the salt is hashed, so the digest cannot be checked
against it): a lying client can only make the owner purge records the owner did not mean
to, which costs misses, never wrong KV. A namespace whose records the store may hold is
never dropped: a header the scan read names it, or a put under it (`storing`) was under way
when the scan began or began since; when that is not known (a disk header unread), nothing
is dropped. Announcements are bounded (protocol.py: MAX_ANNOUNCED per request, MAX_FIELDS
fields of at most MAX_TEXT characters each): anything else is refused with an error, and
nothing of it is kept. A file that cannot be read, whatever it holds, is moved aside
(`.bad`), logged and counted (`malformed.state_file`); the service starts without it.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec

from kvstore.config.runtime import read_private_json, set_aside, write_private_json
from kvstore.format.errors import KVStoreError
from kvstore.format.malformed import Malformed, MalformedCounts
from kvstore.service import protocol as P

log = logging.getLogger(__name__)

MAX_NAMESPACES = 1 << 16
MAX_BYTES = 32 << 20  # of descriptions (compact JSON): a vLLM engine's are 300-700 bytes
SHARE = 4  # a uid other than the service's own holds at most a quarter of the book
CROWDED, ROOMY = 0.75, 0.5  # past this fraction of a bound room is made, down to that one
SAVE_EVERY_S = 5.0
SAVE_BYTES_PER_S = 1 << 20
TRIM_EVERY_S = 30.0
MAX_FILE_BYTES = MAX_BYTES + 256 * MAX_NAMESPACES  # the descriptions and each row's other fields
_FIELD = re.compile(r"[a-z_]{1,32}")
_MAX_PUT_UNDER = 1 << 17  # namespaces put under during one scan that are told apart


class _Row(msgspec.Struct):
    """One namespace as the file keeps it (its shape bounds the file's nesting)."""

    namespace: str
    description: dict[str, str | int]
    uid: int
    first: float
    last: float


@dataclass(slots=True)
class _Entry:
    description: bytes  # compact JSON: a few hundred bytes, where a dict of it is kilobytes
    uid: int
    first: float
    last: float


class Shelf:
    """The namespaces kept, least recently announced first, within the bounds: the book's
    and each uid's share (the service's own uid: the whole book). Not thread-safe: the
    book's lock guards it."""

    def __init__(self, owner: int) -> None:
        self.owner = owner
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self.changed = False  # since the file was last written
        self._ordered: list[bytes] | None = None  # the digests sorted, for pages (None: to sort)
        self._count: Counter[int] = Counter()  # namespaces per uid
        self._bytes: Counter[int] = Counter()  # bytes of descriptions per uid
        self._total_bytes = 0

    def limits(self, uid: int | None) -> tuple[int, int]:
        """(namespaces, bytes of descriptions) `uid` may hold; None: the book."""
        share = SHARE if uid is not None and uid != self.owner else 1
        return MAX_NAMESPACES // share, MAX_BYTES // share

    def holds(self, uid: int | None) -> tuple[int, int]:
        """(namespaces, bytes of descriptions) `uid` holds; None: the book."""
        if uid is None:
            return len(self.entries), self._total_bytes
        return self._count[uid], self._bytes[uid]

    def room(self, uid: int, size: int) -> bool:
        """Whether one more description of `size` bytes from `uid` fits."""
        for who in (None, uid):
            (count, nbytes), (most, most_bytes) = self.holds(who), self.limits(who)
            if count >= most or nbytes + size > most_bytes:
                return False
        return True

    def past(self, fraction: float) -> list[int | None]:
        """The uids past `fraction` of their share, then None if the book is past it."""
        return [who for who in (*self._count, None)
                if any(has > fraction * most for has, most in zip(self.holds(who), self.limits(who),
                                                                  strict=True))]

    def add(self, digest: bytes, entry: _Entry) -> None:
        self.entries[digest] = entry
        self._count[entry.uid] += 1
        self._bytes[entry.uid] += len(entry.description)
        self._total_bytes += len(entry.description)
        self._ordered, self.changed = None, True

    def drop(self, digest: bytes) -> None:
        entry = self.entries.pop(digest)
        self._count[entry.uid] -= 1
        self._bytes[entry.uid] -= len(entry.description)
        self._total_bytes -= len(entry.description)
        if not self._count[entry.uid]:
            del self._count[entry.uid], self._bytes[entry.uid]
        self._ordered, self.changed = None, True

    def page(self, after: bytes | None, limit: int) -> list[dict[str, Any]]:
        """NamespaceBook.page."""
        if self._ordered is None:
            self._ordered = sorted(self.entries)
        ordered = self._ordered
        start = 0 if after is None else bisect.bisect_right(ordered, after)
        rows, size = [], 0
        for digest in ordered[start : start + max(1, min(limit, P.MAX_PAGE))]:
            entry = self.entries[digest]
            rows.append({"namespace": digest.hex(), "description": msgspec.json.decode(entry.description),
                         "uid": entry.uid, "first": entry.first, "last": entry.last})
            size += len(entry.description)
            if size >= P.PAGE_BYTES:
                break
        return rows


# (namespaces, dry run) -> what was, or would be, removed: the service's purge (shared_store.py)
Purge = Callable[[Sequence[bytes], bool], dict[str, int]]


class NamespaceBook:
    """Announced namespaces by digest: `announce`, `page`, `storing` (around a put),
    `tend` (room made and the file written: the book's thread, `start`), `close`, and
    `handle`, which answers the protocol's requests about them. `held` says which
    namespaces the store's records name (None: not known, and nothing is dropped);
    `purge` removes their records."""

    def __init__(self, path: str | None, malformed: MalformedCounts | None = None,
                 held: Callable[[], set[bytes] | None] = set, purge: Purge | None = None) -> None:
        self._held = held
        self._purge = purge
        self._lock = threading.Lock()
        self._file = BookFile(path)
        self._shelf = self._file.load(os.geteuid(), malformed or MalformedCounts(log))
        self._counters: Counter[str] = Counter()
        self._trimmed_at: float | None = None
        self._puts_lock = threading.Lock()
        self._putting: Counter[bytes] = Counter()  # puts under way, by namespace
        self._put_under: set[bytes] | None = set()  # since the last scan began (None: too many)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvstore-namespaces")

    def handle(self, uid: int, request: P.Announce | P.Namespaces | P.Purge) -> Any:
        """Announcements from any client (`uid`); listing and purging for the service's owner
        only: a purge deletes other users' records, and `allowed_uids` clients may not."""
        if isinstance(request, P.Announce):
            self.announce(uid, request.namespaces)
            return None
        owner = self._shelf.owner
        if uid != owner:
            raise KVStoreError(f"'{type(request).__name__.lower()}' is for the service's owner (uid "
                               f"{owner}); uid {uid} may only use the store")
        if isinstance(request, P.Namespaces):
            return self.page(request.after, request.limit)
        if self._purge is None:
            raise KVStoreError("this namespace book purges nothing")
        log.warning("purge%s of %d namespaces by uid %d", " (dry run)" if request.dry_run else "",
                    len(request.namespaces), uid)
        return self._purge(request.namespaces, request.dry_run)

    def announce(self, uid: int, namespaces: Sequence[tuple[bytes, Mapping[str, str | int]]]) -> None:
        """Keep what is new of these (all checked first: KVStoreError, and nothing kept, if
        one is malformed); those known already are announced again now. What finds no room
        is counted (`namespaces.refused`)."""
        if len(namespaces) > P.MAX_ANNOUNCED:
            raise KVStoreError(f"{len(namespaces)} namespaces in one announcement; "
                               f"at most {P.MAX_ANNOUNCED}")
        checked = [(digest, msgspec.json.encode(_checked(digest, description)))
                   for digest, description in namespaces]
        now = time.time()
        with self._lock:
            shelf = self._shelf
            for digest, description in checked:
                entry = shelf.entries.get(digest)
                if entry is not None:
                    entry.last = now
                    shelf.entries.move_to_end(digest)
                elif shelf.room(uid, len(description)):
                    shelf.add(digest, _Entry(description, uid, now, now))
                else:
                    self._counters["namespaces.refused"] += 1

    def page(self, after: bytes | None, limit: int = P.MAX_PAGE) -> list[dict[str, Any]]:
        """Namespaces in digest order after `after` (None: from the first), at most `limit`
        and about PAGE_BYTES of descriptions (one more at most): [{"namespace": hex digest,
        "description", "uid", "first", "last"}]; empty after the last."""
        with self._lock:
            return self._shelf.page(after, limit)

    def counters(self) -> dict[str, int]:
        """namespaces.refused and namespaces.dropped, for the service's info."""
        with self._lock:
            return dict(self._counters)

    @contextmanager
    def storing(self, namespace: bytes) -> Iterator[None]:
        """Around a put under `namespace`: its records are not seen by a scan that began
        before they were published, so it is kept until a scan that began after."""
        with self._puts_lock:
            self._putting[namespace] += 1
            if self._put_under is not None:
                self._put_under.add(namespace)
                if len(self._put_under) > _MAX_PUT_UNDER:
                    self._put_under = None  # too many to tell apart: nothing is dropped this time
        try:
            yield
        finally:
            with self._puts_lock:
                self._putting[namespace] -= 1
                if not self._putting[namespace]:
                    del self._putting[namespace]

    def start(self) -> None:
        """Tend the book from a thread of its own until `close`."""
        self._thread.start()

    def tend(self) -> None:
        """One round of the book's thread: room made where a bound is near (at most one scan
        of the records every TRIM_EVERY_S), the file written if it changed and a write is due."""
        with self._lock:
            crowded = bool(self._shelf.past(CROWDED))
        if crowded and (self._trimmed_at is None or time.monotonic() - self._trimmed_at >= TRIM_EVERY_S):
            self._trim()
        self._save(force=False)

    def close(self) -> None:
        """Stop the book's thread, then write the file once more if it changed."""
        self._stopping.set()
        if self._thread.ident is not None:
            self._thread.join()
        self._save(force=True)

    def _trim(self) -> None:
        """Drop the least recently announced namespaces that hold no records, from each uid
        past CROWDED of its share and from the book past CROWDED of its bounds, down to
        ROOMY. Kept: those the scan read in a header, and those a put under way when it
        began, or begun since, stores under."""
        with self._puts_lock:
            self._put_under = set()
            keep = set(self._putting)
        self._trimmed_at = time.monotonic()
        held = self._held()  # the scan: seconds on a large disk tier, outside the book's lock
        with self._puts_lock:
            put_under = self._put_under
        if held is None or put_under is None:
            log.info("announced namespaces: none dropped (which hold records is not known)")
            return
        keep |= held | put_under
        with self._lock:
            shelf = self._shelf
            for who in shelf.past(CROWDED):
                most = [ROOMY * bound for bound in shelf.limits(who)]
                for digest, entry in list(shelf.entries.items()):
                    if all(has <= bound for has, bound in zip(shelf.holds(who), most, strict=True)):
                        break
                    if (who is None or entry.uid == who) and digest not in keep:
                        shelf.drop(digest)
                        self._counters["namespaces.dropped"] += 1

    def _save(self, force: bool) -> None:
        """The book written if it changed and, unless `force`, a write is due (BookFile);
        encoded and written outside the book's lock."""
        with self._lock:
            shelf = self._shelf
            if not shelf.changed or not (force or self._file.due()):
                return
            rows = [{"namespace": digest.hex(), "description": msgspec.Raw(entry.description),
                     "uid": entry.uid, "first": entry.first, "last": entry.last}
                    for digest, entry in shelf.entries.items()]
            shelf.changed = False
        if not self._file.write(rows):
            with self._lock:
                self._shelf.changed = True  # the next round tries again

    def _run(self) -> None:
        while not self._stopping.wait(SAVE_EVERY_S):
            try:
                self.tend()
            except Exception:  # never the end of the book's upkeep: the next round may do
                log.exception("announced namespaces: a round of upkeep failed")


class BookFile:
    """`SOCKET.namespaces`: read at start, a file that cannot be read set aside; written
    whole (a temporary file renamed over the old one) at most every SAVE_EVERY_S, or more
    seldom for a large one (SAVE_BYTES_PER_S). No path: nothing read or written."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._write_at = 0.0  # monotonic: the earliest next write

    def load(self, owner: int, malformed: MalformedCounts) -> Shelf:
        """The file's namespaces on a shelf, the most recently announced kept where more
        than the bounds take; an empty shelf if there is none, or it cannot be read."""
        shelf = Shelf(owner)
        if self.path is None:
            return shelf
        try:
            rows = read_private_json(self.path, list[_Row], MAX_FILE_BYTES) or []
            for row in reversed(rows):
                digest = bytes.fromhex(row.namespace)
                description = msgspec.json.encode(_checked(digest, row.description))
                if digest not in shelf.entries and shelf.room(row.uid, len(description)):
                    shelf.add(digest, _Entry(description, row.uid, row.first, row.last))
                    shelf.entries.move_to_end(digest, last=False)
        except Exception as exc:  # whatever the file holds: the service starts without it
            why = f"{self.path}: {type(exc).__name__}: {str(exc)[:300]}; {set_aside(self.path)}"
            malformed.count(Malformed("state_file", why), "starting without the namespaces it held")
            return Shelf(owner)
        shelf.changed = False
        return shelf

    def due(self) -> bool:
        return time.monotonic() >= self._write_at

    def write(self, rows: list[dict[str, Any]]) -> bool:
        """Write `rows`; False (logged) if they could not be."""
        if self.path is None:
            return True
        data = msgspec.json.encode(rows)
        self._write_at = time.monotonic() + max(SAVE_EVERY_S, len(data) / SAVE_BYTES_PER_S)
        try:
            write_private_json(self.path, msgspec.Raw(data))
        except (OSError, KVStoreError) as exc:
            log.warning("announced namespaces not written to %s (%s)", self.path, exc)
            return False
        return True


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
