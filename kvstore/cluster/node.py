"""This host in the cluster: what TieredStore calls when `cluster` is configured.

- Its disk-tier chunks go into the index (publisher.py).
- `lookup`: after the local tiers, one batched index read (index.py) for the rest of a
  prompt, within the deadline; an entry counts if its host's lease lives and this host
  can read the device it names.
- `read`: those chunks read from the peers' devices and verified (peer_reader.py), and
  promoted into DRAM like disk hits. A copy promoted from a peer is in `peer_copies`:
  when it leaves DRAM it is dropped, not written to this host's disk, so the array
  keeps one copy of a chunk rather than one per host that read it.

Answers are kept for RECENT_S: the scheduler asks about a waiting request at every
step and its load follows its lookup, and neither needs another index round trip. A
miss is kept only RECENT_MISS_S: a consumer waiting for chunks a producer is publishing
right now (prefill/decode handoff, docs/pd.md) sees them within that, not a second
later. A chunk that fails verification is forgotten at once.

`await_chunks` (a lookup's `await_s`): a consumer holds a request until chunks a
producer named are readable (the handoff). While lookups skip the index (its backoff: a
read failed or came late, as it does on a starved CPU), their answers would not change
until the hold ran out; so a thread of its own looks for awaited chunks every
RECENT_MISS_S, past the backoff, until found or their time is up, and what it finds is
remembered like a lookup's answer: the held request's next lookup finds it. It never
runs on a lookup's path. A user other than the service's own holds at most a quarter of
the chunks awaited at once (AWAITED_SHARE), so a co-tenant's awaits cannot cut the
owner's engines' handoffs short.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.cluster.index import IndexReader, PeerHit
from kvstore.cluster.peer_devices import PeerDevices
from kvstore.cluster.peer_reader import PeerReader
from kvstore.cluster.publisher import IndexPublisher
from kvstore.config.store import StoreConfig
from kvstore.datapath.landing import Landings
from kvstore.format.record import record_bytes
from kvstore.format.secrets import masked_url
from kvstore.io.base import IoEngine
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.slots import Change, Entry

log = logging.getLogger(__name__)
RECENT_S = 1.0  # how long an index answer is reused
RECENT_MISS_S = 0.02  # how long an answer that a key is nowhere is reused
RECENT_LIMIT = 1 << 16  # answers kept
AWAITED_LIMIT = 1 << 16  # chunks awaited at once; past it an await is cut short (peer.await_dropped)
AWAITED_SHARE = 4  # a user other than the service's own awaits at most 1/AWAITED_SHARE of them


class ClusterNode:
    def __init__(self, config: StoreConfig, *, disk: DiskTier | None, landings: Landings, engine: IoEngine,
                 peer_copies: set[bytes], background: bool = True) -> None:
        """`peer_copies`: the store's set of DRAM chunks whose disk copy is a peer's (its
        flusher never writes those down); kept here as they enter and leave DRAM."""
        assert config.cluster is not None
        self.config = config.cluster
        self.stats = landings.stats
        self.dram = landings.placement.dram if landings.placement is not None else None
        own = [d.path for d in config.disk] + ([p.path for p in disk.devices.plans if p.path]
                                               if disk is not None else [])
        self.devices = PeerDevices(self.config, own, engine, record_bytes(landings.chunk_bytes), config.io,
                                   start=background)
        try:
            self.index = IndexReader(self.config, self.stats)
            try:  # the publisher claims this host_id's lease: another live host with it refuses the start
                self.publisher = (IndexPublisher(self.config, disk, self.stats, start=background)
                                  if disk else None)
            except BaseException:
                self.index.close()
                raise
        except BaseException:
            self.devices.close()
            raise
        self.reader = PeerReader(self.devices, engine, landings, timeout_s=config.io.timeout_s,
                                 peer_copies=peer_copies)
        self._lock = threading.Lock()
        self._recent: OrderedDict[bytes, tuple[float, list[PeerHit] | None]] = OrderedDict()
        self._awaited: dict[bytes, tuple[float, int]] = {}  # chunk key -> (until when (monotonic), uid)
        self._awaiting: Counter[int] = Counter()  # chunks awaited, by the uid that asked first
        self._await_wake = threading.Event()
        self._closed = threading.Event()
        self._awaiter = threading.Thread(target=self._look_for_awaited, name="kvstore-awaited", daemon=True)
        self._from_peers = peer_copies
        if self.dram is not None:
            self.dram.table.subscribe(self._left_dram)

    # -- queries -------------------------------------------------------------------

    def locate(self, keys: Sequence[bytes]) -> dict[bytes, list[PeerHit]]:
        """Where live peers hold `keys`, from recent answers or one index read."""
        now = time.monotonic()
        found: dict[bytes, list[PeerHit]] = {}
        wanted = []
        with self._lock:
            for key in keys:
                recent = self._recent.get(key)
                if recent is None or now - recent[0] > (RECENT_S if recent[1] else RECENT_MISS_S):
                    wanted.append(key)
                elif recent[1]:
                    found[key] = recent[1]
        if not wanted:
            return found
        answer = self.index.locate(wanted)
        if answer is None:  # index down or late: local only, and not remembered
            return found
        with self._lock:
            for key in wanted:
                self._recent[key] = (now, answer.get(key))
                self._recent.move_to_end(key)
            while len(self._recent) > RECENT_LIMIT:
                self._recent.popitem(last=False)
        found.update(answer)
        return found

    def readable(self, keys: Sequence[bytes]) -> dict[bytes, PeerHit]:
        """For each of `keys` a live peer holds on a device in service here, that entry."""
        found = {}
        for key, hits in self.locate(keys).items():
            hit = next((h for h in hits if not isinstance(self.devices.locate(h.host, h.location), str)),
                       None)
            if hit is not None:
                found[key] = hit
        return found

    def lookup(self, keys: Sequence[bytes], local_tier: Callable[[bytes], str | None],
               await_s: float = 0.0, uid: int | None = None) -> list[str]:
        """The tiers of the leading run of `keys` (the part of a prompt the local tiers
        did not hold): local where they hold a chunk, else 'peer'. With `await_s`, the
        rest is awaited that long for `uid` (`await_chunks`)."""
        located = self.readable(keys)
        tiers = []
        for key in keys:
            tier = local_tier(key) or ("peer" if key in located else None)
            if tier is None:
                break
            tiers.append(tier)
        if await_s > 0 and len(tiers) < len(keys):
            self.await_chunks(keys[len(tiers) :], await_s, uid)
        return tiers

    def await_chunks(self, keys: Sequence[bytes], within_s: float, uid: int | None = None) -> None:
        """A request of `uid` (None: the service's own user) is held until `keys` are
        readable here, for at most `within_s`: look for them off the lookups' path meanwhile
        (the module's docstring). Past the limit, or past its user's share, the rest of an
        await is cut short (counted)."""
        until, dropped = time.monotonic() + within_s, 0
        owner = os.geteuid() if uid is None else uid
        share = AWAITED_LIMIT if owner == os.geteuid() else AWAITED_LIMIT // AWAITED_SHARE
        with self._lock:
            if self._closed.is_set():
                return
            for key in keys:
                known = self._awaited.get(key)
                if known is not None:
                    self._awaited[key] = (max(known[0], until), known[1])
                elif len(self._awaited) < AWAITED_LIMIT and self._awaiting[owner] < share:
                    self._awaited[key] = (until, owner)
                    self._awaiting[owner] += 1
                else:
                    dropped += 1
            if self._awaiter.ident is None:  # started at the first await, once
                self._awaiter.start()
        if dropped:
            self.stats.add("peer.await_dropped", dropped)
        self._await_wake.set()

    def _look_for_awaited(self) -> None:
        """The awaiting thread: one index read of the awaited chunks every RECENT_MISS_S
        while any are awaited; a failing round is logged and the loop goes on."""
        while not self._closed.is_set():
            with self._lock:
                wanted = self._still_awaited(time.monotonic())
                if not wanted:
                    self._await_wake.clear()
            if not wanted:
                self._await_wake.wait()
                continue
            try:
                self._look_for(wanted)
            except Exception:  # awaiting is a hint: lookups go on without it
                log.exception("looking for awaited chunks failed; going on")
            self._closed.wait(RECENT_MISS_S)

    def _still_awaited(self, now: float) -> list[bytes]:
        """Awaited chunks neither found (a recent hit) nor past their time (lock held)."""
        for key, (until, _) in list(self._awaited.items()):
            recent = self._recent.get(key)
            if until <= now or (recent is not None and recent[1] and now - recent[0] <= RECENT_S):
                self._unawait(key)
        return list(self._awaited)

    def _unawait(self, key: bytes) -> None:
        """`key` is no longer awaited (lock held); its user's count goes down with it."""
        entry = self._awaited.pop(key, None)
        if entry is not None:
            self._awaiting[entry[1]] -= 1
            if not self._awaiting[entry[1]]:
                del self._awaiting[entry[1]]

    def _look_for(self, wanted: list[bytes]) -> None:
        """One index read of `wanted` past the backoff; what is found is remembered."""
        now = time.monotonic()
        answer = self.index.locate(wanted, backoff=False)
        with self._lock:
            for key, hits in (answer or {}).items():
                self._recent[key] = (now, hits)
                self._recent.move_to_end(key)
                self._unawait(key)
            while len(self._recent) > RECENT_LIMIT:
                self._recent.popitem(last=False)

    # -- reads -----------------------------------------------------------------------

    def read(self, keys: Sequence[bytes], indices: Sequence[int], outs: Sequence[memoryview] | None,
             promote: bool, ok: list[bool]) -> None:
        """Serve keys[i] for i in `indices` from peers where the index places them."""
        if not indices:
            return
        located = self.readable([keys[i] for i in indices])
        hits = [(i, located[keys[i]]) for i in indices if keys[i] in located]
        self.reader.read(keys, hits, outs, promote, ok)
        with self._lock:
            for i, _ in hits:
                if not ok[i]:
                    self._recent.pop(keys[i], None)  # ask the index again next time

    def _left_dram(self, change: Change, entry: Entry) -> None:
        """DRAM table listener, after the fact: a chunk read from a peer again since it
        left DRAM is in the table once more and keeps its mark."""
        if change is not Change.STORED and self.dram is not None and entry.key not in self.dram.table:
            self._from_peers.discard(entry.key)

    # -- housekeeping ----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        return {"host_id": self.config.host_id, "index_url": masked_url(self.config.index_url),
                "index_error": self.index.last_error,
                "host_id_conflict": self.publisher.lease.refused if self.publisher else "",
                "generation": self.publisher.generation if self.publisher else None,
                "peer_devices": self.devices.describe()}

    def close(self, withdraw: bool = True) -> None:
        """Stop publishing (`withdraw`: end the lease now, a clean stop) and reading."""
        if self.dram is not None:
            self.dram.table.unsubscribe(self._left_dram)
        with self._lock:
            self._closed.set()
        self._await_wake.set()
        if self._awaiter.is_alive():
            self._awaiter.join(timeout=5)
        if self.publisher is not None:
            self.publisher.close(withdraw)
        self.devices.close()
        self.index.close()
