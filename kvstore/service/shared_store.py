"""The one store every client of the service shares: made at the first hello that gives
a chunk size, changed by a reload, closed last.

The store is made by the first such hello from the service's own user (an allowed user's
engine cannot fix the store's chunk size nor have a fresh tier formatted for it); later
hellos must give the same chunk size (another is a clear error naming the socket). Once
made, its chunk events are logged for engines to read (chunk_events.py), its `learned`
admission starts from, and is kept in, the service's file (learned_file.py), and the purges
left pending (none open yet, or a device out of service) are run on it before any client
has it (purge_file.py).

Invariants: `lock` is held while the store is made, switched by a reload or closed, and
while a client's window is taken off its regions, so no store is made from a config being
replaced and no region is removed from a closed store; `store` is None until the store is
made and after it closed, and each request reads it once and works with what it read; a
reload's policy switch that raises changes nothing and is counted (`malformed.config`),
never the end of the service.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from kvstore.config.store import StoreConfig
from kvstore.format.errors import ConfigError, KVStoreError
from kvstore.format.malformed import Malformed, MalformedCounts
from kvstore.format.secrets import masked
from kvstore.io.regions import Region
from kvstore.service import learned_file
from kvstore.service import protocol as P
from kvstore.service.chunk_events import ChunkEvents
from kvstore.service.purge_file import PendingPurges
from kvstore.store.tiered import TieredStore

log = logging.getLogger(__name__)


class SharedStore:
    """The service's store and the config it runs with (a reload replaces it)."""

    def __init__(self, config: StoreConfig, socket_path: str, events: ChunkEvents,
                 malformed: MalformedCounts) -> None:
        self.config = config
        self.socket_path = socket_path
        self.store: TieredStore | None = None
        self.lock = threading.Lock()
        self._events = events
        self._malformed = malformed
        self._learned = learned_file.Keeper(socket_path, config.service.learned_save_s)
        self._purges = PendingPurges(socket_path, malformed)

    def join(self, uid: int, chunk_bytes: int, hello: P.Hello) -> TieredStore:
        """The store for a hello with chunks of `chunk_bytes` from a client of `uid`: made
        now if this is the first, from the service's own user; a KVStoreError if it is not
        made and `uid` may not make it, a ConfigError if it stores chunks of another size."""
        with self.lock:
            if self.store is None and uid != os.geteuid():
                raise KVStoreError("the store is made by the first engine of the service's own user "
                                   "(its chunk size sets the tiers' format); none has connected yet")
            if self.store is None:
                store = TieredStore(self.config, chunk_bytes, namespace=hello.namespace,
                                    dtype=hello.dtype, shape=hello.shape)
                try:
                    self._purges.opened(store)  # before any client has it
                except BaseException:  # the hello fails; the purges stay pending, the next one tries
                    store.close()
                    raise
                self.store = store
                self._learned.start(self.store)
                self._events.watch(self.store)
            elif self.store.chunk_bytes != chunk_bytes:
                raise ConfigError("service.socket", self.socket_path,
                                  f"this service stores chunks of {self.store.chunk_bytes} bytes, "
                                  f"this engine's are {chunk_bytes}: give it its own socket")
            return self.store

    def may_map_dram(self, uid: int) -> bool:
        """service.share_dram: the service's own user's engines, every allowed one, or none."""
        mode = self.config.service.share_dram
        return mode == "allowed" or (mode == "own-user" and uid == os.geteuid())

    def unregister(self, region: Region) -> None:
        """A client's window is no longer a region reads may land in (none once closed)."""
        with self.lock:
            if self.store is not None:
                self.store.regions.remove(region)

    def namespaces(self) -> set[bytes] | None:
        """The namespaces the store's records name (None, not known, before the store opens:
        its disk tier may hold records of any)."""
        store = self.store
        return store.probe.namespaces() if store is not None else None

    def purge(self, namespaces: Sequence[bytes], dry_run: bool) -> dict[str, int]:
        """Remove the records of `namespaces` (purge_file.py: with no store open yet, they
        wait for it). The lock is taken only while there is none, so a purge that finds no
        store cannot miss one being made."""
        store = self.store
        if store is None:
            with self.lock:
                store = self.store
                if store is None:
                    return self._purges.purge(None, namespaces, dry_run)
        return self._purges.purge(store, namespaces, dry_run)

    def reload(self, live: dict[str, Any], config: StoreConfig) -> bool:
        """A reload: its policy keys (`live`) applied to the store, then `config` the one the
        service runs with, under the lock (no store is made meanwhile from the config being
        replaced). A switch to `learned` starts from what the service learned before, as a
        start does. False, and nothing changed, if the switch raised: logged and counted as a
        config that cannot be applied (`malformed.config`), the service serving on."""
        with self.lock:
            store = self.store
            if live and store is not None:
                try:
                    self._learned.switch(store, lambda: store.admin.reload_policy(live))
                except Exception as exc:  # whatever the switch met: never the end of the service
                    why = masked(f"{type(exc).__name__}: {exc}")[:2000]
                    log.warning("reload: the policy was not applied: %s", why)
                    self._malformed.count(Malformed("config", why), logged=True)
                    return False
            self.config = config
        return True

    def close(self) -> None:
        """The learned rates and pending purges written once more, then the store closed
        (drained, checkpointed)."""
        with self.lock:
            self._learned.close()
            self._purges.closing(self.store)
            if self.store is not None:
                self.store.close()
                self.store = None
