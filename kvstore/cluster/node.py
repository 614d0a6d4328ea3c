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
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
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
from kvstore.tiers.slots import Entry

RECENT_S = 1.0  # how long an index answer is reused
RECENT_MISS_S = 0.02  # how long an answer that a key is nowhere is reused
RECENT_LIMIT = 1 << 16  # answers kept


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
                                 promoted=peer_copies.add)
        self._lock = threading.Lock()
        self._recent: OrderedDict[bytes, tuple[float, list[PeerHit] | None]] = OrderedDict()
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

    def lookup(self, keys: Sequence[bytes], local_tier: Callable[[bytes], str | None]) -> list[str]:
        """The tiers of the leading run of `keys` (the part of a prompt the local tiers
        did not hold): local where they hold a chunk, else 'peer'."""
        located = self.readable(keys)
        tiers = []
        for key in keys:
            tier = local_tier(key) or ("peer" if key in located else None)
            if tier is None:
                break
            tiers.append(tier)
        return tiers

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

    def _left_dram(self, published: bool, entry: Entry) -> None:
        """DRAM table listener, after the fact: a chunk read from a peer again since it
        left DRAM is in the table once more and keeps its mark."""
        if not published and self.dram is not None and entry.key not in self.dram.table:
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
        if self.publisher is not None:
            self.publisher.close(withdraw)
        self.devices.close()
        self.index.close()
