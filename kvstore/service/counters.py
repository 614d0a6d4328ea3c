"""The service's accounting: the counters clients add, those the service keeps of its own,
and the info (`kvstore info`, Info, /metrics) that reports them with the store's.

Clients add the scheduler's and the workers' counters (Count, or a Residency's
`counters`): CLIENT_COUNTER names only, and a bounded number of them. The service counts
the round trips engines make by kind (`requests.KIND`), what it refused of what came from
outside (`malformed.KIND`: frames, reloads, counter names past the bound), the server's
refused clients (`clients.*`) and the namespace book's (`namespaces.*`), whether or not a
store was made. Invariants: no client can grow the counters, and so Info's reply or
/metrics, without end; a counter name a client may not add is a clear error for its
request, a name past the bound is dropped and counted, never raised.
"""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from typing import Any

from kvstore.format.errors import KVStoreError
from kvstore.format.malformed import KindCounts, Malformed, MalformedCounts
from kvstore.service import protocol as P
from kvstore.service.namespaces import NamespaceBook
from kvstore.service.shared_store import SharedStore
from kvstore.store.tiered import TieredStore

# The counters a client may add to (the scheduler's and the workers'): a bounded set of
# names, so a client cannot grow the service's counters (and /metrics) without end.
CLIENT_COUNTER = re.compile(
    r"(prefetch|save|save_wait|staging|load|handoff|malformed|connector|keys)\.[a-z_]{1,32}")


class ClientCounters:
    """The counters clients add to (the scheduler's and the workers'): CLIENT_COUNTER names
    only, and at most MAX_NAMES distinct ones, so no client can grow the service's counters
    (Info, /metrics) without end; a new name past that is dropped and counted
    (`malformed.counter`), the rest of its request added. A uid other than the service's
    own brings in at most a SHARE-th of the names, so a co-tenant cannot use them all up
    before the owner's engines name theirs."""

    MAX_NAMES = 1024
    SHARE = 4

    def __init__(self, malformed: MalformedCounts) -> None:
        self._names: set[str] = set()
        self._brought: Counter[int] = Counter()  # names each uid brought in first
        self._lock = threading.Lock()
        self._malformed = malformed

    def add(self, store: TieredStore | None, counters: dict[str, float], uid: int | None = None) -> None:
        """Add a client's counters (`uid`: its user; None: the service's own)."""
        for name in counters:
            if not CLIENT_COUNTER.fullmatch(name):
                raise KVStoreError(f"counter {name[:80]!r}: a client may add only "
                                   f"{CLIENT_COUNTER.pattern} counters")
        uid = os.geteuid() if uid is None else uid
        with self._lock:
            new = [name for name in counters if name not in self._names]
            room = max(0, self.MAX_NAMES - len(self._names))
            if uid != os.geteuid():
                room = min(room, max(0, self.MAX_NAMES // self.SHARE - self._brought[uid]))
            self._names.update(new[:room])
            self._brought[uid] += min(room, len(new))
            kept = {name: amount for name, amount in counters.items() if name in self._names}
        if len(kept) < len(counters):
            self._malformed.count(Malformed("counter", f"{len(counters) - len(kept)} new counter names past "
                                                       f"the {self.MAX_NAMES} clients may add"), "dropped")
        if store is not None:
            for name, amount in kept.items():
                store.stats.add(name, amount)


class ServiceCounters:
    """The service's own counters, and the Info answer that adds them to the store's."""

    def __init__(self, shared: SharedStore, namespaces: NamespaceBook, malformed: MalformedCounts,
                 counted: tuple[KindCounts, ...] = ()) -> None:
        self.malformed = malformed  # frames, reloads, counter names: the service's own, store or not
        self.clients = ClientCounters(malformed)
        self._shared = shared
        self._namespaces = namespaces
        self._counted = (malformed, *counted)  # and the server's (refused clients)
        self._seen: Counter[str] = Counter()
        self._lock = threading.Lock()

    def saw(self, request: P.Request) -> None:
        """One round trip an engine made (`requests.KIND`)."""
        with self._lock:
            self._seen[f"requests.{type(request).__name__.lower()}"] += 1

    def own(self) -> dict[str, Any]:
        """The service's own counters (`malformed.*`, `clients.*`, `namespaces.*`, `requests.*`),
        kept whether or not a store was made."""
        counters: dict[str, Any] = dict(self._namespaces.counters())
        for counts in self._counted:
            counters.update(counts.snapshot())
        with self._lock:
            counters.update(self._seen)
        return counters

    def info(self) -> dict[str, Any]:
        """The store's info (none yet: no tiers), with the service's own counters added."""
        store = self._shared.store
        info = store.info() if store else {"tiers": [], "counters": {}}
        counters = Counter(info["counters"])
        counters.update(self.own())  # adds, and keeps zeros
        return {**info, "counters": dict(counters), "service_pid": os.getpid(),
                "socket": self._shared.socket_path}
