"""This host's disk-tier chunks into the cluster index, from one background thread.

The slot table tells a listener of every publish and unpublish (in its order); the
listener only appends to a bounded queue, so the data path never waits on Redis. The
thread sends the queue in pipelines (HSET/SADD, HDEL/SREM) and renews the lease, in a
command of its own, at least every `lease_s`/3. On a Redis Cluster each shard's part
goes on its own (connection.py), so a shard that is down costs only the writes routed
to it, which are sent again at the next step, never the lease's renewal or the other
shards' writes. When more is lost (the queue or the writes to send again overflowed,
one Redis failed, the lease was gone when renewed (Redis restarted or was flushed), or
at start, when the index recovered from the devices was never sent), the thread
reconciles instead: it compares the set of keys this host has published with its slot
table and sends the difference, so the index converges on what the devices hold
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

from kvstore.cluster.connection import FAILURES, MALFORMED, Command, IndexConnection
from kvstore.cluster.index import DEVICE_ID_BYTES, IndexKeys, Location
from kvstore.cluster.lease import HostIdInUse, HostLease
from kvstore.config.store import ClusterConfig
from kvstore.format.secrets import masked_url
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.slots import Change, Entry
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
        self.generation = int.from_bytes(os.urandom(8), "little")
        # No backoff: the lease's renewal goes through it too, and must be tried at every step.
        self._index = IndexConnection(config.index_url, config.lease_s / 3, tls=config.index_tls)
        self.keys = IndexKeys(config.key_prefix, self._index.cluster)
        self.lease = HostLease(config, self._index, self.keys, self.generation, stats)
        self._claim_at_start()
        self._queue: deque[tuple[bool, bytes, int, int]] = deque()
        self._dirty = True  # the recovered index has not been sent yet
        self._wake = threading.Event()
        self._stepping = threading.Lock()
        self._stop = threading.Event()
        self._renewed = 0.0
        self._failing = False
        self._refused_seen = False  # a refused write was logged as a warning (later ones at debug)
        self._error: BaseException | None = None  # this step's first failure, for the log
        self._retry: list[Command] = []  # writes a shard failed: sent again at the next step
        self._reconcile_after = 0.0  # a reconcile that could not read this host's set waits
        self._round: list[bytes] = []  # this republish round's keys not yet sent again
        self.sent = 0  # updates (and reconciles) that reached the index: tests wait on it
        disk.table.subscribe(self._changed)
        self._thread = threading.Thread(target=self._loop, name="kvstore-index", daemon=True)
        if start:
            self._thread.start()

    def _claim_at_start(self) -> None:
        """Another live host with this host_id refuses the start (HostIdInUse); an index
        that does not answer only defers the claim to the thread's first step."""
        try:
            self.lease.claim()
        except HostIdInUse:
            self._index.close()
            raise
        except FAILURES as exc:
            log.warning("cluster index %s: host_id %s's lease not claimed at start (%s); claimed when "
                        "the index answers", masked_url(self.config.index_url), self.host_id, exc)

    def _changed(self, change: Change, entry: Entry) -> None:
        """Slot-table listener (in the table's order): queue the change, never wait."""
        if len(self._queue) >= QUEUE_LIMIT:
            self._dirty = True
            self._queue.clear()
        else:
            self._queue.append((change is Change.STORED, entry.key, entry.slot, entry.seq))
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set() and not self.lease.refused:
            self._wake.wait(self.config.lease_s / 3)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.step()
            except Exception:  # a fault past the index's (a bug): the thread, and the lease, live on
                self._dirty = True
                self.stats.add("peer.publish_errors")
                log.exception("cluster index: a publishing step failed; reconciling at the next")
                self._stop.wait(self.config.index_backoff_s)

    def step(self) -> bool:
        """Renew the lease, send what is queued (or reconcile) and, at a renewal, this
        round's share of the republish; False if the index (or one of its shards) failed."""
        with self._stepping:  # the thread's, or a caller's (tests, a flush) waiting for it
            self._error = None
            try:
                now = time.monotonic()
                due = now - self._renewed >= self.config.lease_s / 3
                ok = self._renew() if due or self._dirty else True
                if self._dirty and now >= self._reconcile_after:
                    ok = self._reconcile() and ok
                elif due:
                    ok = self._republish() and ok
                if self._retry:
                    retry, self._retry = self._retry, []
                    ok = self._send(retry) and ok
                while self._queue:
                    ok = self._send_queued() and ok
            except FAILURES as exc:  # one instance failed, or the cluster's slot map is not read yet
                self._dirty = True  # what was taken from the queue is lost: reconcile next time
                self._error, ok = exc, False
            if not ok:
                self.stats.add("peer.publish_errors")
                if not self._failing:
                    log.warning("cluster index %s: cannot publish (%s); retrying every %.1f s",
                                masked_url(self.config.index_url), self._error, self.config.index_backoff_s)
                self._failing = True
                self._stop.wait(self.config.index_backoff_s)
                return False
            if self._failing:
                log.warning("cluster index %s: publishing again", masked_url(self.config.index_url))
                self._failing = False
            return True

    def _send(self, commands: list[Command]) -> bool:
        """Send `commands` (in batches, each shard its part); False if any failed. Those
        are sent again at the next step (a shard down costs only its own writes, again),
        or, past QUEUE_LIMIT of them, a reconcile follows; a command Redis refused (a key
        of the wrong type: another user of the same Redis, or a hostile one) is that
        entry's loss, counted (`peer.publish_refused`), never sent again. The lease is
        renewed between batches when due: a long send (a reconcile of 10^5 chunks, a
        shard that hangs each batch to its deadline) never outlasts it."""
        ok = True
        refused: list[BaseException] = []
        for start in range(0, len(commands), 2 * _BATCH):
            if start and time.monotonic() - self._renewed >= self.config.lease_s / 3:
                ok = self._renew() and ok
            batch = commands[start : start + 2 * _BATCH]
            for command, answer in zip(batch, self._index.run(batch), strict=True):
                if isinstance(answer, MALFORMED):
                    refused.append(answer)
                elif isinstance(answer, BaseException):
                    self._error, ok = self._error or answer, False
                    self._retry.append(command)
        if refused:
            self.stats.add("peer.publish_refused", len(refused))
            log.log(logging.DEBUG if self._refused_seen else logging.WARNING,
                    "cluster index: %d writes refused (%s); their chunks are not published",
                    len(refused), refused[0])
            self._refused_seen = True
        if len(self._retry) > QUEUE_LIMIT:
            self._dirty, self._retry = True, []
        return ok

    def _location(self, slot: int, seq: int) -> bytes | None:
        group, local = self.disk.table.groups.of(slot)
        layout = self.disk.devices.layouts[group]
        if layout is None:
            return None
        return Location(self.generation, group, layout.sb.device_id[:DEVICE_ID_BYTES], local, seq).pack()

    def _send_queued(self) -> bool:
        commands: list[Command] = []
        sent = 0
        while self._queue and sent < _BATCH:
            add, key, slot, seq = self._queue.popleft()
            location = self._location(slot, seq) if add else None
            commands += (self.keys.withdraw(self.host_id, key) if location is None
                         else self.keys.put(self.host_id, key, location))
            sent += 1
        ok = self._send(commands)
        self.sent += sent
        self.stats.add("peer.published", sent)
        return ok

    def _reconcile(self) -> bool:
        """Make this host's part of the index what its slot table holds now (as far as the
        shards that answer allow: while one does not, the next step reconciles again)."""
        with self.disk.table.lock:  # no change slips between the snapshot and the queue
            self._dirty = False
            self._queue.clear()
            self._retry = []
            entries = self.disk.table.entries()
        mine = {e.key: location for e in entries if (location := self._location(e.slot, e.seq))}
        published = self.keys.published(self.host_id)
        try:
            gone = [key for key in self._index.client.sscan_iter(published, count=10000) if key not in mine]
        except FAILURES as exc:  # the set's shard is down: withdraw nothing now, publish the rest,
            self._error, gone = exc, []  # and reconcile again after lease_s (not at every step)
            self._dirty = True
            self._reconcile_after = time.monotonic() + self.config.lease_s
        commands = [c for key in gone for c in self.keys.withdraw(self.host_id, key)]
        commands += [c for key, location in mine.items() for c in self.keys.put(self.host_id, key, location)]
        ok = self._send(commands) and not self._dirty
        self.sent += 1
        self.stats.add("peer.reconciles")
        log.info("cluster index: %d chunks published, %d withdrawn%s", len(mine), len(gone),
                 "" if ok else " (a shard failed: again at the next step)")
        return ok

    def _republish(self) -> bool:
        """Send this renewal's share of the entries again (all every `republish_s`). Each
        is taken under the table's lock as it is now; a change after that is queued, so it
        is sent after this and the index ends as the table is."""
        if not self.config.republish_s:
            return True
        with self.disk.table.lock:
            table = self.disk.table
            if not self._round:
                self._round = list(table.index)
            share = max(1, math.ceil(len(table) * self.config.lease_s / 3 / self.config.republish_s))
            current = [(key, table.entry(slot)) for key in self._round[-share:]
                       if (slot := table.find(key)) is not None]
            del self._round[-share:]
        commands = [c for key, entry in current
                    if entry is not None and (location := self._location(entry.slot, entry.seq)) is not None
                    for c in self.keys.put(self.host_id, key, location)]
        self.stats.add("peer.republished", len(commands) // 2)
        return self._send(commands)

    def _renew(self) -> bool:
        """Renew the lease, alone (its shard answers whichever others do not; lease.py).
        When it was gone the index lost this host's state: everything is published again."""
        renewed = self.lease.renew()
        if renewed is None:
            self._dirty, self._reconcile_after = True, 0.0
        elif not renewed:
            self._error = self.lease.error
            return False
        self._renewed = time.monotonic()
        return True

    def close(self, withdraw: bool = True) -> None:
        """Stop the thread; `withdraw` (a clean stop) ends the lease at once, so peers stop
        reading this host's devices now rather than when the lease would have run out."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(self.config.lease_s)
        self.disk.table.unsubscribe(self._changed)
        self.lease.close(withdraw)
        self._index.close()
