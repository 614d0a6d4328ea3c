"""This host's disk-tier chunks into the cluster index, from one background thread.

The slot table tells a listener of every publish and unpublish (under its lock); the
listener only appends to a bounded queue, so the data path never waits on Redis. The
thread sends the queue in pipelines (HSET/SADD, HDEL/SREM) and renews the lease in the
same round trip at least every `lease_s`/3. When anything is lost (the queue
overflowed, a pipeline failed, the lease was gone when renewed (Redis restarted or was
flushed), or at start, when the index recovered from the devices was never sent), the
thread reconciles instead: it compares the set of keys this host has published with its
slot table and sends the difference, so the index converges on what the devices hold
however long Redis was away.

Some losses no error shows: a Redis Cluster master that dies takes the writes its
replica had not received yet, and the promoted replica answers without them. So the
thread also sends its entries again, a slice at each renewal, all of them every
`republish_s`: what a failover lost is found again within that.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from typing import Any

from kvstore.cluster.connection import FAILURES, IndexConnection, shown
from kvstore.cluster.index import DEVICE_ID_BYTES, IndexKeys, Location
from kvstore.config.store import ClusterConfig
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.slots import Entry
from kvstore.tiers.stats import Stats

log = logging.getLogger(__name__)
QUEUE_LIMIT = 1 << 18  # index updates waiting for Redis; past it, a reconcile follows
_BATCH = 4096  # commands per pipeline


class IndexPublisher:
    def __init__(self, config: ClusterConfig, disk: DiskTier, stats: Stats, *, start: bool = True) -> None:
        self.config = config
        self.disk = disk
        self.stats = stats
        self.host_id = config.host_id
        self.keys = IndexKeys(config.key_prefix)
        self.generation = int.from_bytes(os.urandom(8), "little")
        self._index = IndexConnection(config.index_url, config.lease_s / 3)
        self._queue: deque[tuple[bool, bytes, int, int]] = deque()
        self._dirty = True  # the recovered index has not been sent yet
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._renewed = 0.0
        self._failing = False
        self._round: list[bytes] = []  # this republish round's keys not yet sent again
        self.sent = 0  # updates (and reconciles) that reached the index: tests wait on it
        disk.table.listeners.append(self._changed)
        self._thread = threading.Thread(target=self._loop, name="kvstore-index", daemon=True)
        if start:
            self._thread.start()

    def _changed(self, published: bool, entry: Entry) -> None:
        """Slot-table listener (its lock held): queue the change, never wait."""
        if len(self._queue) >= QUEUE_LIMIT:
            self._dirty = True
            self._queue.clear()
        else:
            self._queue.append((published, entry.key, entry.slot, entry.seq))
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.config.lease_s / 3)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.step()

    def step(self) -> bool:
        """Send what is queued (or reconcile) and renew the lease; False if Redis failed."""
        try:
            if self._dirty:
                self._reconcile()
            while self._queue:
                self._send_queued()
            if time.monotonic() - self._renewed >= self.config.lease_s / 3:
                pipe = self._index.pipeline()
                self._republish(pipe)
                self._renew(pipe, existing=True)
                if not pipe.execute()[-1]:
                    log.warning("cluster index: this host's lease was gone; publishing everything again")
                    self._reconcile()
        except FAILURES as exc:
            self._dirty = True  # what was taken from the queue is lost: reconcile next time
            self.stats.add("peer.publish_errors")
            if not self._failing:
                log.warning("cluster index %s: cannot publish (%s); retrying every %.1f s",
                            shown(self.config.index_url), exc, self.config.index_backoff_s)
            self._failing = True
            self._stop.wait(self.config.index_backoff_s)
            return False
        if self._failing:
            log.warning("cluster index %s: publishing again", shown(self.config.index_url))
            self._failing = False
        return True

    def _location(self, slot: int, seq: int) -> bytes | None:
        group, local = self.disk.table.groups.of(slot)
        layout = self.disk.devices.layouts[group]
        if layout is None:
            return None
        return Location(self.generation, group, layout.sb.device_id[:DEVICE_ID_BYTES], local, seq).pack()

    def _send_queued(self) -> None:
        pipe = self._index.pipeline()
        published = self.keys.published(self.host_id)
        sent = 0
        while self._queue and sent < _BATCH:
            add, key, slot, seq = self._queue.popleft()
            location = self._location(slot, seq) if add else None
            if location is not None:
                pipe.hset(self.keys.chunk(key), self.host_id, location)
                pipe.sadd(published, key)
            else:
                pipe.hdel(self.keys.chunk(key), self.host_id)
                pipe.srem(published, key)
            sent += 1
        self._renew(pipe, existing=True)
        if not pipe.execute()[-1]:
            self._dirty = True  # the lease was gone: so may the entries be (reconciled next)
        self.sent += sent
        self.stats.add("peer.published", sent)

    def _reconcile(self) -> None:
        """Make this host's part of the index what its slot table holds now."""
        with self.disk.table.lock:  # no change slips between the snapshot and the queue
            self._dirty = False
            self._queue.clear()
            entries = self.disk.table.entries()
        mine = {e.key: location for e in entries if (location := self._location(e.slot, e.seq))}
        published = self.keys.published(self.host_id)
        gone = [key for key in self._index.client.sscan_iter(published, count=10000) if key not in mine]
        pipe = self._index.pipeline()
        for i, key in enumerate(gone):
            pipe.hdel(self.keys.chunk(key), self.host_id)
            pipe.srem(published, key)
            if i % _BATCH == _BATCH - 1:
                pipe.execute()
        for i, (key, location) in enumerate(mine.items()):
            pipe.hset(self.keys.chunk(key), self.host_id, location)
            pipe.sadd(published, key)
            if i % _BATCH == _BATCH - 1:
                pipe.execute()
        self._renew(pipe)
        pipe.execute()
        self.sent += 1
        self.stats.add("peer.reconciles")
        log.info("cluster index: %d chunks published, %d withdrawn", len(mine), len(gone))

    def _republish(self, pipe: Any) -> None:
        """Queue this renewal's share of the entries sent again (all every `republish_s`).
        Each is taken under the table's lock as it is now; a change after that is queued,
        so it is sent after this and the index ends as the table is."""
        if not self.config.republish_s:
            return
        with self.disk.table.lock:
            table = self.disk.table
            if not self._round:
                self._round = list(table.index)
            share = max(1, math.ceil(len(table) * self.config.lease_s / 3 / self.config.republish_s))
            current = [(key, table.entry(slot)) for key in self._round[-share:]
                       if (slot := table.find(key)) is not None]
            del self._round[-share:]
        published = self.keys.published(self.host_id)
        for key, entry in current:
            if entry is not None and (location := self._location(entry.slot, entry.seq)) is not None:
                pipe.hset(self.keys.chunk(key), self.host_id, location)
                pipe.sadd(published, key)
        self.stats.add("peer.republished", len(current))

    def _renew(self, pipe: Any, existing: bool = False) -> None:
        """Queue the lease's renewal; `existing`: only if it is still there (its result is
        then None when it was gone: the index lost this host's state)."""
        pipe.set(self.keys.lease(self.host_id), self.generation.to_bytes(8, "little"),
                 px=int(self.config.lease_s * 1000), xx=existing)
        self._renewed = time.monotonic()

    def close(self, withdraw: bool = True) -> None:
        """Stop the thread; `withdraw` (a clean stop) ends the lease at once, so peers stop
        reading this host's devices now rather than when the lease would have run out."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(self.config.lease_s)
        with self.disk.table.lock:
            self.disk.table.listeners.remove(self._changed)
        if withdraw:
            try:
                self._index.client.delete(self.keys.lease(self.host_id))
            except FAILURES as exc:
                log.warning("cluster index: lease not withdrawn (%s); it expires in %.0f s", exc,
                            self.config.lease_s)
        self._index.close()
