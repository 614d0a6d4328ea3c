"""TieredStore: the store's API over the DRAM and disk tiers, as engines' requests use it.

Chunks enter DRAM (`put_many`); DRAM victims are written down to disk before their
slot is reused; disk hits are promoted back into DRAM. This module checks input at the
API edge (edge.py) and sequences the parts it holds (`parts`, parts.py: built in order,
released once); each concern has its own home:
  store/reads.py         a get's order: DRAM hits copied out, then disk, then peers; prefetch
  store/writes.py        a put's order: DRAM slots (victims written down first) or disk
  tiers/policy.py        where chunks go and when they move (shared with the trace replay)
  datapath/placement.py  DRAM slots for new records, victims written down first
  datapath/reader.py     disk reads: destination, verification, promotion (landing.py)
  datapath/flusher.py    chunks going down to disk (victims, write-through, direct puts)
  tiers/slots.py         each tier's slots, pins and reservations (own lock per tier)
  tiers/recover.py       the disk index at start; the checkpoint at a clean close
  cluster/               other hosts' chunks on a shared array (only with `cluster` configured)
  store/probe.py         where chunks are, read without moving them (`store.probe`)
  store/admin.py         what the service's owner does to the store: purge, reload (`store.admin`)
Copies and I/O run outside every lock, on pinned or reserved slots.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.config.store import StoreConfig, load_config
from kvstore.format.errors import ShapeError
from kvstore.format.record import RecordEncoder
from kvstore.io import IoEngine
from kvstore.io.aligned import AlignedBuffer
from kvstore.io.regions import Region
from kvstore.store.admin import StoreAdmin
from kvstore.store.edge import check_keys, chunk_views
from kvstore.store.leases import SharedDram
from kvstore.store.parts import StoreParts
from kvstore.store.probe import StoreProbe
from kvstore.store.put_bound import PutBound
from kvstore.store.reads import Reads
from kvstore.store.writes import Writes
from kvstore.tiers.return_rates import RequestEnd
from kvstore.tiers.slots import Change

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lookup:
    """How many leading chunks are present, and the tier ('dram', 'disk', 'nvmeof' or 'peer':
    another host's device on a shared array) of each."""

    count: int
    tiers: tuple[str, ...]

    @property
    def resident(self) -> int:
        """Leading chunks already in DRAM: what a get serves without touching a device."""
        return next((i for i, tier in enumerate(self.tiers) if tier != "dram"), self.count)


class TieredStore:
    """The store as a request reaches it (an engine's, through the service; a test's or a
    bench's in-process): find chunks, read and prefetch them, store and delete them; and
    the store's life (`step`, `flush`, `close`). It holds its parts (`parts`: tiers,
    reader, flusher, placement, cluster node...) rather than is them, and only
    kvstore/store/ reads `parts` (a house rule). Three faces beside it serve other callers:
    `shared_dram` is the DRAM tier as engines that map it see it (its descriptor, leases on
    its slots: store/leases.py), `probe` says where chunks are without moving them (tests,
    tools: store/probe.py), and `admin` is what the service's owner does to the store
    (purge, a reload's policy, learned admission's state: store/admin.py). `stats` and
    `regions` are the parts' counters and the memory reads may land in, for the service.
    Invariants: input is checked before anything is reserved (edge.py); every get and put
    touches its chain before and after, so a request never evicts its own prefix; a put
    past `put_inflight` bytes under way is refused, not queued; a read buffer is freed
    only once no late read may land in it."""

    def __init__(
        self,
        config: StoreConfig | dict[str, Any] | str,
        chunk_bytes: int,
        *,
        namespace: bytes = bytes(16),
        dtype: str = "uint8",
        shape: tuple[int, ...] = (),
        engine: IoEngine | None = None,
        background: bool = True,
    ) -> None:
        """`background` False starts no threads (tests, benches): no DRAM cleaner (a put
        writes its victims down itself), write-through copies are written by `flush()`,
        and devices checked and the cluster index sent by `step()`."""
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ShapeError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
        self.encoder = RecordEncoder(namespace, dtype, shape)
        self.chunk_bytes = chunk_bytes
        self._read_buffers: list[tuple[Region, AlignedBuffer]] = []
        self.parts = StoreParts(load_config(config), chunk_bytes, engine, background)
        self.stats, self.regions = self.parts.stats, self.parts.regions
        self.probe = StoreProbe(self.parts)
        self.admin = StoreAdmin(self.parts, self.delete)
        self._seq = itertools.count(self.parts.recovery.max_seq + 1)
        self._reads = Reads(self.parts)
        self.shared_dram = SharedDram(self.parts, self._reads)
        self._writes = Writes(self.parts, self.encoder)
        self._put_bound = PutBound(self.parts.config.put_inflight, chunk_bytes, self.stats)

    # -- queries -------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], await_s: float = 0.0, uid: int | None = None) -> Lookup:
        """Leading chunks present, and where. A chunk moving down is published below
        before it leaves DRAM, so a lookup racing it still finds it. With a cluster, what
        the local tiers lack is looked for at the peers (one index read), and awaited there
        for `await_s` on behalf of `uid` (a request held for it: cluster/node.py)."""
        keys = check_keys(keys)
        dram, cluster = self.parts.dram, self.parts.cluster
        in_dram = dram.table.index if dram is not None else {}
        tiers = []
        for key in keys:
            tier = "dram" if key in in_dram else self.parts.local_tier(key)  # DRAM first, inline: hot
            if tier is None:
                break
            tiers.append(tier)
        if cluster is not None and len(tiers) < len(keys):
            tiers += cluster.lookup(keys[len(tiers) :], self.parts.local_tier, await_s, uid)
        return Lookup(len(tiers), tuple(tiers))

    def contains(self, key: bytes) -> bool:
        return self.lookup([key]).count == 1

    def watch(self, listener: Callable[[bool, bytes, str], None]) -> None:
        """Tell `listener(stored?, key, tier)` of every chunk published in or removed from a
        local tier from now on, `tier` named as `lookup` names it ('dram', 'disk', 'nvmeof').
        It runs outside the tiers' locks, in each tier's order (tiers/slots.py `subscribe`)."""
        dram, disk = self.parts.dram, self.parts.disk
        if dram is not None:
            dram.table.subscribe(lambda change, entry: listener(change is Change.STORED, entry.key, "dram"))
        if disk is not None:
            disk.table.subscribe(lambda change, entry: listener(change is Change.STORED, entry.key,
                                                                disk.kind_of(entry.slot)))

    # -- reads ---------------------------------------------------------------------

    def buffers(self, count: int) -> list[memoryview]:
        """`count` chunk buffers a disk read lands in directly (no bounce copy): page
        aligned, huge pages where the kernel gives them. While a read into them that missed
        its deadline may still land, a get into them is refused: take new ones, or wait."""
        buffer = AlignedBuffer(count * self.chunk_bytes)
        self._read_buffers.append((self.regions.add(buffer.address, buffer.nbytes, buffer), buffer))
        return [buffer.view[i * self.chunk_bytes : (i + 1) * self.chunk_bytes] for i in range(count)]

    def get_many(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        """Read chunks into caller buffers; result i tells whether out[i] holds chunk i.

        A False entry is a miss (absent, or did not verify): out[i] is then
        unspecified and the caller must recompute that chunk.
        """
        keys = check_keys(keys)
        views = chunk_views(outs, len(keys), self.chunk_bytes, writable=True, regions=self.regions)
        return self._reads.get(keys, views)

    def prefetch(self, keys: Sequence[bytes]) -> int:
        """Promote the leading run of `keys` that is on disk into DRAM, ahead of the get
        that will want it (a request waiting to be scheduled); chunks already in DRAM
        are touched so eviction keeps them. Returns chunks promoted."""
        return self._reads.prefetch(check_keys(keys))

    # -- writes --------------------------------------------------------------------

    def put_many(self, keys: Sequence[bytes], payloads: Sequence[Any],
                 parent: bytes | None = None, namespace: bytes | None = None) -> list[bool]:
        """Store chunks of one chain (head first); result i: chunk i is now stored.

        `parent` is the key of the chunk before keys[0] (None for a prompt's first
        chunk); `namespace` the digest of the namespace they were keyed in, which their
        headers carry (None: the store's), so `admin.purge` can find them. Keys already
        present are kept, not rewritten (content addressing). Chunks past the bytes of puts
        under way (`put_inflight`, store/put_bound.py) are refused at once: False.
        """
        keys = check_keys(keys)
        for named in (parent, namespace):
            if named is not None:
                check_keys([named])
        views = chunk_views(payloads, len(keys), self.chunk_bytes, writable=False)
        with self._put_bound.take(len(keys)) as granted:
            taken = keys[:granted]
            self.parts.touch(taken)  # first: storing this prompt's chunks never evicts its own
            stored = self._writes.put(taken, views[:granted], parent, next(self._seq), namespace)
            self.parts.touch(taken)  # again: new chunks join their chain tail-older-than-head
        return stored + [False] * (len(keys) - granted)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove chunks from every tier (on disk too, so a restart does not revive them).
        Returns the records removed."""
        return self._writes.delete(check_keys(keys))

    def finished(self, ranks: Sequence[Sequence[bytes]], end: RequestEnd) -> None:
        """A request that stored or read these chunks (one chain per tensor-parallel rank)
        ended so: what `learned` disk admission learns from (tiers/return_rates.py)."""
        for keys in ranks:
            self.parts.policy.finished(check_keys(keys), end)

    # -- housekeeping ----------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """Tiers, capacities, counters and what recovery found, as `kvstore info` prints."""
        return self.parts.info()

    def step(self) -> bool:
        """One round of the background threads' work, for a store made with `background`
        False: this host's devices checked (out of and back into service), peers' devices
        looked for, what changed sent to the cluster index. False if the index failed."""
        parts = self.parts
        if parts.monitor is not None:
            parts.monitor.check_once()
        if parts.cluster is None:
            return True
        parts.cluster.devices.check_once()
        return parts.cluster.publisher.step() if parts.cluster.publisher is not None else True

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait for queued write-through copies to reach disk."""
        flusher = self.parts.flusher
        return flusher.flush(timeout_s) if flusher else True

    def close(self, crash: bool = False) -> None:
        """Drain write-through, write DRAM-only chunks down, checkpoint, release everything
        (DRAM does not survive the process; the disk does, so a restarted service still
        serves them). `crash` True: stop as kill -9 would (tests of recovery)."""
        self.parts.close(crash)
        for region, buffer in self._read_buffers:
            region.close(buffer.close)  # once no late read may land in it
        self._read_buffers.clear()

    def simulate_crash(self) -> None:
        """Stop the way kill -9 would, for tests of recovery: nothing drained, written
        down or checkpointed (the superblocks stay dirty, the cluster lease runs out); only
        descriptors and memory are released."""
        self.close(crash=True)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
