"""The cross-host index on Redis (or Valkey): which host holds which chunk, and where.

Keys, all under `cluster.key_prefix` (P):
  P c:<chunk key>  a hash: one field per host holding the chunk, host id -> Location
  P h:<host id>    a set: the chunk keys that host has published (its own clean-up)
  P l:<host id>    that host's lease, expiring: its generation (8 bytes, random per start),
                   then who holds it (host name, boot id, pid: lease.py)

On a Redis Cluster the chunk keys are `P c:{}<chunk key>` and spread over the shards by
the hash of the whole key (the empty tag `{}` comes first, so a `{...}` inside a raw
chunk key is no tag): a chunk is in every prompt that shares its prefix, so no tag of
one request's chain could name it, and a popular prefix's chunks on one shard would
make that shard the hot one. A lookup is one pipeline per shard, sent at once
(connection.py). The leases are `P l:{P}<host id>`: one hash tag, so one MGET reads
them all. (One instance keeps the plain names.)

Each host writes only its own fields, its own set and its own lease: no value has two
writers and nothing is locked. An entry counts only while its host's lease lives and
names the entry's generation, so a stopped host's entries die with its lease and a
restarted host's old ones with its generation. Entries are hints: whoever reads the
record checks it (peer_reader.py), so a stale entry costs a miss, never wrong KV.

Reads have a short deadline and a backoff: an index that is down or slow makes lookups
local-only at once, and for `index_backoff_s` they do not try it again. On a cluster, a
shard that does not answer in time (its master died or hangs; its replica not yet
promoted) costs only the lookups of its keys (`peer.index_shard_misses`), within the
deadline, and only that shard is skipped for `index_backoff_s`; while the leases' shard is the
one down, the leases last read count for at most `lease_s` more.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.cluster.connection import FAILURES, MALFORMED, Command, IndexConnection
from kvstore.config.store import ClusterConfig
from kvstore.format.secrets import masked_url
from kvstore.tiers.stats import Stats

log = logging.getLogger(__name__)
_LOCATION = struct.Struct("<QH8sIQ")  # generation, device, device id (first 8 bytes), slot, seq
DEVICE_ID_BYTES = 8


@dataclass(frozen=True, slots=True)
class Location:
    """Where a host says a chunk is: its device (position in that host's block tier, and
    the first bytes of its superblock's device id), the slot on it, the record's seq."""

    generation: int
    device: int
    device_id: bytes
    slot: int
    seq: int

    def pack(self) -> bytes:
        return _LOCATION.pack(self.generation, self.device, self.device_id, self.slot, self.seq)

    @staticmethod
    def unpack(raw: bytes) -> Location | None:
        if len(raw) != _LOCATION.size:
            return None
        return Location(*_LOCATION.unpack(raw))


@dataclass(frozen=True, slots=True)
class LeaseHolder:
    """Who holds a host id's lease: the generation its entries carry, and the host name,
    boot id and pid of the service that claimed it (so a second host with the same id
    can be named, and a service's own ended predecessor on this machine recognised)."""

    generation: int
    host: str
    boot: str
    pid: int

    def pack(self) -> bytes:
        return self.generation.to_bytes(8, "little") + f"{self.host}\n{self.boot}\n{self.pid}".encode()

    @staticmethod
    def unpack(raw: object) -> LeaseHolder | None:
        """None where `raw` is not a lease (counted by the reader as malformed)."""
        if not isinstance(raw, bytes) or len(raw) < 8:
            return None
        host, boot, pid = [*raw[8:].decode(errors="replace").split("\n"), "", "", ""][:3]
        return LeaseHolder(int.from_bytes(raw[:8], "little"), host[:200], boot[:64],
                           int(pid) if pid.isascii() and pid.isdigit() and len(pid) < 10 else 0)

    def __str__(self) -> str:
        return f"{self.host or 'an unnamed host'} (pid {self.pid})"


@dataclass(frozen=True, slots=True)
class PeerHit:
    host: str
    location: Location


class IndexKeys:
    """The names of index keys under one prefix; on a Redis Cluster (`cluster`), with the
    hash tags that place them."""

    def __init__(self, prefix: str, cluster: bool) -> None:
        self.prefix = prefix.encode()
        self._chunk = self.prefix + (b"c:{}" if cluster else b"c:")
        self._lease = self.prefix + (b"l:{" + self.prefix + b"}" if cluster else b"l:")

    def chunk(self, key: bytes) -> bytes:
        return self._chunk + key

    def published(self, host: str) -> bytes:
        return self.prefix + b"h:" + host.encode()

    def lease(self, host: str) -> bytes:
        return self._lease + host.encode()

    def put(self, host: str, key: bytes, location: bytes) -> list[Command]:
        """`host`'s entry for chunk `key`, and the key in its set."""
        return [("hset", (self.chunk(key), host, location)), ("sadd", (self.published(host), key))]

    def withdraw(self, host: str, key: bytes) -> list[Command]:
        return [("hdel", (self.chunk(key), host)), ("srem", (self.published(host), key))]


class IndexReader:
    """Batched lookups of chunk keys among the configured peers, within the deadline."""

    def __init__(self, config: ClusterConfig, stats: Stats) -> None:
        self.config = config
        self.stats = stats
        self._index = IndexConnection(config.index_url, config.index_deadline_s, config.index_backoff_s,
                                      config.index_tls)
        self.keys = IndexKeys(config.key_prefix, self._index.cluster)
        self.peers = [peer.host_id for peer in config.peers]
        self._lock = threading.Lock()
        self._skip_until = 0.0
        self._leases: dict[str, tuple[int, float]] = {}  # host -> generation, when it expires
        self.last_error = ""

    def locate(self, keys: Sequence[bytes], backoff: bool = True) -> dict[bytes, list[PeerHit]] | None:
        """For each key some live peer holds, where (one pipeline per shard: the peers'
        leases, an HMGET per key). None: the index is skipped (backing off) or did not
        answer in time; a key whose shard did not answer is left out (a miss). `backoff`
        False: a read off the lookups' path (chunks a held request awaits, node.py), made
        even while lookups skip the index; its failing or answering late does not make
        them skip it (within its deadline all the same)."""
        if not keys or not self.peers:
            return {}
        if backoff and time.monotonic() < self._skip_until:
            self.stats.add("peer.index_skipped")
            return None
        leases = [self.keys.lease(host) for host in self.peers]
        commands: list[Command] = [("mget", (leases,)),
                                   *(("hmget", (self.keys.chunk(key), self.peers)) for key in keys)]
        started = time.monotonic()
        try:
            answers = self._index.run(commands)
        except FAILURES as exc:
            self._fail(str(exc) or type(exc).__name__, backoff)
            return None
        elapsed = time.monotonic() - started
        failed = [a for a in answers if isinstance(a, BaseException) and not isinstance(a, MALFORMED)]
        if len(failed) == len(answers):
            self._fail(str(failed[0]) or type(failed[0]).__name__, backoff)
            return None
        self.stats.observe("peer.index", elapsed)
        # answered, but too late to count on (a cluster's late shards have failed on their own)
        late = elapsed > self.config.index_deadline_s
        if late and not self._index.cluster:
            self._fail(f"answered in {elapsed * 1000:.0f} ms, past the deadline", backoff)
        self.stats.add("peer.index_reads")
        if failed:
            self.stats.add("peer.index_shard_errors")
        elif self.last_error and not late:
            log.warning("cluster index %s answers again", masked_url(self.config.index_url))
            self.last_error = ""
        live = self._live(started, answers[0])
        found: dict[bytes, list[PeerHit]] = {}
        for key, row in zip(keys, answers[1:], strict=True):
            if isinstance(row, BaseException) and not isinstance(row, MALFORMED):
                self.stats.add("peer.index_shard_misses")  # its shard is down: a miss
                continue
            if isinstance(row, MALFORMED) or not isinstance(row, list) or len(row) != len(self.peers):
                self.stats.add("peer.index_malformed")  # not a hash of hosts' entries: a miss
                continue
            hits = []
            for host, raw in zip(self.peers, row, strict=True):
                location = Location.unpack(raw) if isinstance(raw, bytes) else None
                if location is not None and live.get(host) == location.generation:
                    hits.append(PeerHit(host, location))
                elif location is not None:
                    self.stats.add("peer.index_expired")  # no lease, or an older generation
                elif raw is not None:
                    self.stats.add("peer.index_malformed")
            if hits:
                found[key] = hits
        return found

    def _live(self, asked: float, leases: object) -> dict[str, int]:
        """The peers' generations whose leases live. Leases read now replace those
        remembered; while the leases' shard is down, those remembered count for at most
        `lease_s` after they were read (no lease outlives that without a renewal)."""
        with self._lock:
            if isinstance(leases, list):  # else the exception of a shard that did not answer
                holders = [(host, LeaseHolder.unpack(lease))
                           for host, lease in zip(self.peers, leases, strict=True) if lease is not None]
                self._leases = {host: (holder.generation, asked + self.config.lease_s)
                                for host, holder in holders if holder is not None}
                if len(self._leases) < len(holders):
                    self.stats.add("peer.index_malformed", len(holders) - len(self._leases))
            now = time.monotonic()
            return {host: generation for host, (generation, until) in self._leases.items() if until > now}

    def _fail(self, why: str, backoff: bool = True) -> None:
        """Counted and logged; with `backoff`, lookups skip the index for index_backoff_s."""
        with self._lock:
            first = not self.last_error
            self.last_error = why
            if backoff:
                self._skip_until = time.monotonic() + self.config.index_backoff_s
        self.stats.add("peer.index_errors")
        then = (f"lookups are local only for {self.config.index_backoff_s:.1f} s" if backoff
                else "awaited chunks are looked for again")
        (log.warning if first else log.debug)("cluster index %s: %s; %s", masked_url(self.config.index_url),
                                              why, then)

    def close(self) -> None:
        self._index.close()
