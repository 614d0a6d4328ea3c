"""`kvstore replay`: what hit ratio a trace gets from tiers of given sizes.

Each tier is kvstore's own SlotTable (slots, index, prefix-aware LRU), sized in
chunks of `kv_bytes_per_token x block_tokens` bytes, and every decision is the
store's own TierPolicy (kvstore/tiers/policy.py) taken through the same SlotTable calls the
store makes (kvstore/store/tiered.py, flusher.py), so a replay's hits are the store's:
- a request's lookup finds the leading run of its full blocks present in any tier
  (capped so one prompt token is always computed); its chain is touched first;
- hits below the top tier are promoted to the top (promote_on_hit): first as the
  connector's prefetch does on a request's arrival (a victim not yet below is written
  down first), then, for what found no slot, as the get does (only slots whose chunk
  the tier below already holds);
- the put: the rest is stored in the top tier; a victim there goes down one tier
  first unless that tier holds it or, being a disk tier, does not admit it (then it is
  dropped); with no slot free for it, a chunk goes down directly. A disk tier is one
  below the top not named as memory (MEMORY_TIERS): disk admission, as in the store,
  applies only to it, and its writes are the ones counted (`disk_bytes_*`).
tests/test_replay.py checks this against a real TieredStore chunk for chunk.

Time is the trace's: the policy's clock (a write budget's allowance, kvstore/tiers/
write_budget.py) reads the arrival being served. Each request also ends, `tpot_s` a token
after it arrives, and tells the policy how (`learned` admission: its answer's length, and
its turn and idle time from kvstore/tiers/chain_history.py, as the connector works them
out); ends are delivered before the first arrival after them. What leaves the tier above a
disk tier is told to the policy as the store's DRAM table tells it (`left_dram`).
`Clairvoyant` is the bound on any admission: it reads the trace ahead and admits a chunk
only if a later request will read it. `AnswerRule` refuses the chunks of requests whose
answer ran long (thresholds chosen in hindsight): what one or two features could save.

A host of a cluster (bench/sim/cluster_replay.py, `--hosts`) also reads the bottom tiers of
its peers (`peers`), as kvstore/cluster/ does: after its own tiers, a chunk a peer holds
is a hit; it is promoted as a get promotes (only into a slot whose chunk the tier below
holds), and when it leaves DRAM it is dropped, never written to this host's disk. The
put stores only past the run some host holds, as the connector saves past the stored run.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from bench.support.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest
from kvstore.format.errors import ConfigError
from kvstore.format.units import parse_size
from kvstore.tiers.admission import Unlearned
from kvstore.tiers.chain_history import ChainHistory
from kvstore.tiers.policy import TierPolicy
from kvstore.tiers.return_rates import RequestEnd
from kvstore.tiers.slots import Change, Entry, Fate, Reservation, SlotTable

MEMORY_TIERS = ("gpu", "hbm", "dram")  # tier names that are not disk: nothing refused
OLD_NAMES = {"host": "dram"}  # --tier names read as another: `host` was the DRAM tier's
_ADMIT_ALL = TierPolicy()  # victim fates between memory tiers: admission is the disk's alone
DAY_S = 86400.0


@dataclass
class TierStats:
    name: str
    capacity_bytes: int
    hit_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    hit_ratio: float = 0.0


class SimTier:
    """One tier: a SlotTable of whole chunks (no bytes move in a replay)."""

    def __init__(self, name: str, capacity_bytes: int, chunk_bytes: int) -> None:
        self.stats = TierStats(name, capacity_bytes)
        self.chunk_bytes = chunk_bytes
        self.table = SlotTable([max(1, capacity_bytes // chunk_bytes)])

    def __contains__(self, key: bytes) -> bool:
        return key in self.table


class Clairvoyant(Unlearned):
    """The bound on disk admission: a chunk is admitted only if a later request will read
    it (within the part of its prompt a hit may cover), read from the trace ahead."""

    name = "oracle"

    def __init__(self, requests: Sequence[TraceRequest], block_tokens: int,
                 position: Callable[[], int]) -> None:
        """`position()`: the index in `requests` of the request being served."""
        self._uses = _holders(requests, lambda request: request.keys[: _usable(request, block_tokens)])
        self._position = position

    def see(self, keys: Sequence[bytes], family: bytes) -> None:
        pass

    def admit(self, key: bytes) -> bool:
        uses = self._uses.get(key, ())
        return bisect.bisect_right(uses, self._position()) < len(uses)


class AnswerRule(Unlearned):
    """Rules on two features, their thresholds picked knowing the trace (what a causal
    admission could hope for from them alone): a chunk is refused where the latest request
    so far that held it in its prompt answered in `tokens` tokens or more, and, with
    `first_only`, no request before that one held it (a chunk shared with an earlier request
    is kept). The answer's length is known once the request ends (the connector reports it:
    `learned`'s feature), mostly before its chunks leave DRAM."""

    name = "answer-rule"

    def __init__(self, requests: Sequence[TraceRequest], tokens: int, position: Callable[[], int],
                 first_only: bool = False) -> None:
        """`position()`: the index in `requests` of the request being served."""
        self._holders = _holders(requests, lambda request: request.keys)
        self._long = [request.output_tokens >= tokens for request in requests]
        self._position = position
        self._first_only = first_only

    def see(self, keys: Sequence[bytes], family: bytes) -> None:
        pass

    def admit(self, key: bytes) -> bool:
        holders = self._holders.get(key, ())
        latest = bisect.bisect_right(holders, self._position()) - 1  # its index among the holders
        if latest < 0 or (self._first_only and latest > 0):
            return True
        return not self._long[holders[latest]]


def _holders(requests: Sequence[TraceRequest],
             keys_of: Callable[[TraceRequest], Sequence[bytes]]) -> dict[bytes, list[int]]:
    """Each key -> the indices of the requests whose `keys_of` hold it, in order."""
    holders: dict[bytes, list[int]] = {}
    for index, request in enumerate(requests):
        for key in keys_of(request):
            holders.setdefault(key, []).append(index)
    return holders


def _usable(request: TraceRequest, block_tokens: int) -> int:
    """The leading blocks a hit may cover: one prompt token is always computed."""
    return min(len(request.keys), (request.input_tokens - 1) // block_tokens)


class DiskWrites:
    """What the disk tiers were written and read: each write unread until a hit reads it,
    and when each was made (the most written in any 24 hours, against a write budget).
    Subscribed to each disk tier's table; `read` is told of every disk hit."""

    def __init__(self) -> None:
        self.unread: set[bytes] = set()  # on a disk tier, not read since written there
        self.read_back = 0  # disk writes read at least once before leaving the disk
        self.times: list[float] = []  # when each disk write was made
        self.now = 0.0  # the trace's time, kept by the replay

    def changed(self, change: Change, entry: Entry) -> None:
        """Disk tier listener: a written chunk is unread until a hit reads it."""
        if change is Change.STORED:
            self.unread.add(entry.key)
            self.times.append(self.now)
        else:
            self.unread.discard(entry.key)

    def read(self, key: bytes) -> None:
        if key in self.unread:
            self.unread.discard(key)
            self.read_back += 1

    def reset(self) -> None:
        self.unread.clear()
        self.times.clear()
        self.read_back = 0

    def most_in_a_day(self) -> int:
        """The most writes made within any 24 hours (the times are in order)."""
        most, start = 0, 0
        for end, at in enumerate(self.times):
            while at - self.times[start] >= DAY_S:
                start += 1
            most = max(most, end - start + 1)
        return most


class RequestEnds:
    """Requests end `tpot_s` an output token after they arrive and tell the policy how
    (`learned` admission: the answer's length, and the turn and idle time the chain
    history works out, as the connector does); delivered in order of their end. Unless
    `reported` (set it False): then none is told, as SGLang's and LMCache's backends tell
    none, and the policy infers what it can from the puts."""

    def __init__(self, policy: TierPolicy, tpot_s: float) -> None:
        self.policy = policy
        self.tpot_s = tpot_s
        self.reported = True
        self.chains = ChainHistory()
        self._ends: list[tuple[float, int, list[bytes], RequestEnd]] = []  # a heap, by end time
        self._order = itertools.count()

    def arrived(self, request: TraceRequest, keys: list[bytes]) -> None:
        if not self.reported:
            return
        turn, idle = self.chains.arrived(keys, request.arrival_s)
        end = RequestEnd(request.output_tokens, turn, idle)
        heapq.heappush(self._ends, (request.arrival_s + request.output_tokens * self.tpot_s,
                                    next(self._order), keys, end))

    def until(self, now: float) -> Iterator[float]:
        """Deliver the ends due by `now`, yielding each one's time before it is delivered."""
        while self._ends and self._ends[0][0] <= now:
            at, _, keys, end = heapq.heappop(self._ends)
            yield at
            self.chains.ended(keys[-1:], end.turn, at)
            self.policy.finished(keys, end)


class ServeHooks(Protocol):
    """What else happens around each request served (the next-turn read-ahead,
    bench/sim/next_turn_replay.py), with its own counts in the result."""

    def before(self, request: TraceRequest) -> None: ...

    def after(self, request: TraceRequest) -> None: ...

    def reset(self) -> None: ...

    def result(self) -> dict[str, Any]: ...


class SimStore:
    """The tiers and how chunks move between them, as the store moves them: puts down
    the tiers with victims written below first, promotions up, disk admission and the
    write budget asked of the policy, refusals counted as the store's DRAM table counts
    them. No bytes move: each tier is a SlotTable of whole chunks."""

    def __init__(self, tiers: list[SimTier], policy: TierPolicy, chunk_bytes: int) -> None:
        self.tiers = tiers
        self.policy = policy
        self.chunk_bytes = chunk_bytes
        self.disks = {i for i, t in enumerate(tiers) if i and t.stats.name not in MEMORY_TIERS}
        self.admission_refused = 0  # chunks the disk would not take, dropped from DRAM
        self.budget_refused = 0  # chunks refused or not written for the write budget
        self.from_peers: set[bytes] = set()  # DRAM copies of chunks read from a peer
        for tier in tiers:
            tier.table.set_eviction(policy.make_eviction())
        tiers[0].table.subscribe(self._left_top)
        for level in self.disks:
            tiers[level - 1].table.subscribe(self._leaving(level), first=True)  # before _left_top
        above = min(self.disks, default=len(tiers)) - 1  # the tier admission is asked below
        policy.set_capacity(tiers[max(0, above)].table.capacity, sum(t.table.capacity for t in tiers))

    def reset_counts(self) -> None:
        self.admission_refused = self.budget_refused = 0

    def held(self, key: bytes) -> bool:
        """Whether any of this host's tiers holds the chunk."""
        return any(key in tier for tier in self.tiers)

    def _leaving(self, level: int) -> Callable[[Change, Entry], None]:
        """The listener of the tier above disk tier `level`: what is evicted from it is told
        to the policy, and a refusal counted, as the store's DRAM table does (StoreParts)."""
        def left(change: Change, entry: Entry) -> None:
            if change is Change.EVICTED:
                held = entry.key in self.tiers[level] or entry.key in self.from_peers
                reason = self.policy.left_dram(entry.key, on_disk=held)
                self.admission_refused += reason is not None
                self.budget_refused += reason == "budget"
        return left

    def read_ahead(self, chain: list[bytes]) -> list[bytes]:
        """The leading run of `chain` held anywhere, moved into the top tier as the
        connector's prefetch moves it; the keys it brought there."""
        run = next((i for i, key in enumerate(chain) if not self.held(key)), len(chain))
        keys = chain[:run]
        before = {key for key in keys if key in self.tiers[0]}
        found = [next(i for i, t in enumerate(self.tiers) if key in t) for key in keys]
        self.promote(found, keys, [None, *keys[:-1]], "prefetch")
        self.tiers[0].table.touch_chain(keys)
        return [key for key in keys if key not in before and key in self.tiers[0]]

    def _left_top(self, change: Change, entry: Entry) -> None:
        """Top tier listener: a chunk read from a peer leaves DRAM."""
        if change is not Change.STORED:
            self.from_peers.discard(entry.key)

    def promote(self, found: list[int], keys: list[bytes], parents: list[bytes | None], mode: str) -> None:
        """Move lower-tier hits up; as in the store, they stay pinned below meanwhile (the
        victims written down cannot evict them)."""
        up = [i for i in range(len(found))
              if keys[i] not in self.tiers[0] and any(keys[i] in tier for tier in self.tiers[1:])]
        with ExitStack() as stack:
            for tier in self.tiers[1:]:
                stack.enter_context(tier.table.pinned(keys, up))
            self.store(0, [keys[i] for i in up], [parents[i] for i in up], mode)

    def touch(self, keys: list[bytes]) -> None:
        for tier in self.tiers:
            tier.table.touch_chain(keys)

    def store(self, level: int, keys: list[bytes], parents: list[bytes | None],
               mode: str = "put", from_peer: bool = False) -> None:
        """Put chunks in tier `level` in the store's order: slots reserved first (none
        tried after one is refused); victims that must go down first are written below
        (in order), then the chunks are published; a put that found no slot goes one tier
        down, a promotion ("prefetch" or "get") does not."""
        tier = self.tiers[level]
        granted = len(keys)
        if level in self.disks:  # every disk write is claimed from the budget first, as the flusher does
            granted = self.policy.claim_writes(len(keys))
            self.budget_refused += len(keys) - granted
            keys, parents = keys[:granted], parents[:granted]
        reserved: list[tuple[bytes, bytes | None, Reservation | None]] = []
        for key, parent in zip(keys, parents, strict=True):
            reservation = None
            if not reserved or reserved[-1][2] is not None:
                reservation = tier.table.reserve(fate=lambda victim: self._fate(level, victim, mode))
            reserved.append((key, parent, reservation))
        demoting = [(j, r, r.victim) for j, (_, _, r) in enumerate(reserved)
                    if r is not None and r.victim is not None]
        if demoting:  # the victims go down in one batch, as the store's Flusher.take_over writes them
            entries = [tier.table.entry(r.slot) for _, r, _ in demoting]
            self.store(level + 1, [v for _, _, v in demoting], [e.parent if e else None for e in entries])
            for j, reservation, victim in demoting:
                key, parent, _ = reserved[j]
                if victim not in self.tiers[level + 1]:
                    reservation.release()
                    reserved[j] = (key, parent, None)
                elif not reservation.take_over():  # (released by take_over)
                    reserved[j] = (key, parent, None)
        down = []
        for key, parent, reservation in reserved:
            if reservation is None:
                down.append((key, parent))
                continue
            if reservation.evicted is not None:
                tier.stats.evictions += 1
            if from_peer:
                self.from_peers.add(key)
            reservation.publish(key, parent, 0)
            tier.stats.bytes_written += self.chunk_bytes
        if level in self.disks:
            self.policy.settle_writes(granted, [key for key, _, r in reserved if r is not None])
        below = level + 1
        if mode == "put" and below < len(self.tiers):
            if below in self.disks:
                admitted = [(key, parent) for key, parent in down if self.policy.admits(key)]
                self.admission_refused += len(down) - len(admitted)
                self.budget_refused += sum(self.policy.refusal(key) == "budget" for key, _ in down)
                down = admitted
            self.store(below, [k for k, _ in down], [p for _, p in down])

    def _fate(self, level: int, key: bytes, mode: str) -> Fate:
        """The store's victim fate (TierPolicy.victim_fate) for tier `level`: a put's and a
        prefetch's victims go down first, a get's promotion passes them over."""
        below = level + 1
        if below >= len(self.tiers):
            return Fate.EVICT
        held = key in self.tiers[below] or key in self.from_peers
        policy = self.policy if below in self.disks else _ADMIT_ALL
        return policy.victim_fate(key, held, passes_over=mode == "get")


class Replayer:
    def __init__(self, tiers: Sequence[tuple[str, int] | SimTier], kv_bytes_per_token: int,
                 block_tokens: int = MOONCAKE_BLOCK_TOKENS, policy: TierPolicy | None = None,
                 peers: Sequence[SimTier] | None = None, tpot_s: float = 0.02) -> None:
        """`peers` (a cluster host; [] for one alone): the bottom tiers of the other hosts.
        `tpot_s`: a request ends its output tokens x this after it arrives."""
        if not tiers:
            raise ConfigError("--tier", None, "give at least one tier, e.g. --tier dram=64GiB")
        self.block_tokens = block_tokens
        self.chunk_bytes = kv_bytes_per_token * block_tokens
        self.policy = policy or TierPolicy(chunk_tokens=block_tokens)
        self.now = 0.0  # the trace's time: the arrival (or end) being served
        self.policy.clock = lambda: self.now
        self.store = SimStore([t if isinstance(t, SimTier) else SimTier(*t, self.chunk_bytes) for t in tiers],
                              self.policy, self.chunk_bytes)
        self.tiers, self.disks = self.store.tiers, self.store.disks
        self.total_tokens = 0
        self.recompute_cost = 0.0  # modelled cost of the usable chunks missed (policy.depth_cost)
        self.recompute_cost_no_cache = 0.0  # ... and of every usable chunk
        self.requests = 0  # served, counted or not (reset_stats)
        self._counted = (0, 0.0)  # requests served and the trace's time when counting began
        self.peers = peers
        self.peer_stats = TierStats("peer", sum(p.stats.capacity_bytes for p in peers or ()))
        self.disk_writes = DiskWrites()
        for level in self.disks:
            self.tiers[level].table.subscribe(self.disk_writes.changed)
        self.ends = RequestEnds(self.policy, tpot_s)
        self.hooks: list[ServeHooks] = []

    def run(self, requests: Iterable[TraceRequest]) -> dict[str, Any]:
        for request in requests:
            self.serve(request)
        return self.result()

    def reset_stats(self) -> None:
        """Count from here on: the tiers keep what they hold and the policy what it learned
        (after earlier passes of a trace, bench/trace.read_passes)."""
        for tier in self.tiers:
            tier.stats = TierStats(tier.stats.name, tier.stats.capacity_bytes)
        self.peer_stats = TierStats("peer", self.peer_stats.capacity_bytes)
        self.total_tokens = 0
        self.store.reset_counts()
        self.recompute_cost = self.recompute_cost_no_cache = 0.0
        self.disk_writes.reset()
        self._counted = (self.requests, self.now)
        for hook in self.hooks:
            hook.reset()

    def serve(self, request: TraceRequest) -> list[int]:
        """Account one request; returns the tier index of each hit block, in order."""
        for hook in self.hooks:
            hook.before(request)
        found = self._serve(request)
        for hook in self.hooks:
            hook.after(request)
        return found

    def _serve(self, request: TraceRequest) -> list[int]:
        for at in self.ends.until(request.arrival_s):
            self._advance(at)
        self._advance(request.arrival_s)
        self.requests += 1
        self.total_tokens += request.input_tokens
        keys = list(request.keys)
        if self.policy.admission == "learned" and keys:
            self.ends.arrived(request, keys)
        usable = _usable(request, self.block_tokens)
        # A cluster host's connector saves past the run stored anywhere; alone, all is put.
        held = self.store.held
        stored = 0 if self.peers is None else next(
            (i for i, key in enumerate(keys) if not held(key) and not self._at_peer(key)), len(keys))
        found: list[int] = []
        for key in keys[:usable]:
            tier = next((i for i, t in enumerate(self.tiers) if key in t), None)
            if tier is None and self._at_peer(key):
                tier = len(self.tiers)  # the "peer" tier
            if tier is None:
                break
            found.append(tier)
            stats = self.tiers[tier].stats if tier < len(self.tiers) else self.peer_stats
            stats.hit_tokens += self.block_tokens
            stats.bytes_read += self.chunk_bytes
            if tier in self.disks:
                self.disk_writes.read(key)
        self.recompute_cost += sum(map(self.policy.depth_cost, range(len(found), usable)))
        self.recompute_cost_no_cache += sum(map(self.policy.depth_cost, range(usable)))
        parents = [None, *keys[:-1]]
        hits = keys[: len(found)]
        if self.policy.promote_on_hit:  # the connector's prefetch on arrival: hits move up
            self.tiers[0].table.touch_chain(hits)
            self.store.promote(found, keys, parents, "prefetch")
            self._promote_from_peers(self._elsewhere(hits), keys, parents)
        self.store.touch(hits)  # the get: what the prefetch left below moves up if a slot is clean
        if self.policy.promote_on_hit:
            elsewhere = self._elsewhere(hits)  # what the get will read from peers
            self.store.promote(found, keys, parents, "get")
            self._promote_from_peers(elsewhere, keys, parents)
        self.store.touch(hits)
        self.policy.seen(hits, read=True)
        put = keys[stored:]  # the put: what no tier holds of it is stored
        new = [i for i in range(stored, len(keys)) if not self.store.held(keys[i])]
        self.policy.seen(put, keys[stored - 1] if stored else None)
        self.store.touch(put)
        self.store.store(0, [keys[i] for i in new], [parents[i] for i in new])
        self.store.touch(put)
        return found

    def _advance(self, now: float) -> None:
        """The trace's time moves on (never back): the policy's clock and the disk writes' read it."""
        self.now = self.disk_writes.now = max(self.now, now)

    def _at_peer(self, key: bytes) -> bool:
        return any(key in peer for peer in self.peers or ())

    def _elsewhere(self, hits: list[bytes]) -> list[int]:
        """The hits no local tier holds now: the store reads those from peers."""
        if not self.peers:
            return []
        return [i for i, key in enumerate(hits) if not self.store.held(key) and self._at_peer(key)]

    def _promote_from_peers(self, up: list[int], keys: list[bytes], parents: list[bytes | None]) -> None:
        """Chunks read from peers move up as a get promotes them (only into a clean slot)."""
        self.store.store(0, [keys[i] for i in up], [parents[i] for i in up], "get", from_peer=True)

    def result(self) -> dict[str, Any]:
        stats = [t.stats for t in self.tiers] + ([self.peer_stats] if self.peers else [])
        for tier in stats:
            tier.hit_ratio = tier.hit_tokens / max(1, self.total_tokens)
        hits = sum(t.hit_tokens for t in stats)
        written = sum(self.tiers[i].stats.bytes_written for i in self.disks)
        read = sum(self.tiers[i].stats.bytes_read for i in self.disks)
        never_read = written - self.disk_writes.read_back * self.chunk_bytes
        result = {"requests": self.requests - self._counted[0], "prompt_tokens": self.total_tokens,
                "chunk_bytes": self.chunk_bytes, "hit_ratio": hits / max(1, self.total_tokens),
                "admission": self.policy.admission, "eviction": self.policy.eviction,
                "disk_bytes_written": written, "disk_bytes_read": read,
                "disk_bytes_written_per_byte_read": written / read if read else None,
                "disk_bytes_written_never_read": never_read,
                "admission_refused": self.store.admission_refused,
                "budget_refused": self.store.budget_refused,
                "disk_bytes_written_max_day": self.chunk_bytes * self.disk_writes.most_in_a_day(),
                "trace_seconds": self.now - self._counted[1], "admission_info": self.policy.describe(),
                "recompute_cost": self.recompute_cost,
                "recompute_cost_no_cache": self.recompute_cost_no_cache,
                "tiers": [asdict(t) for t in stats]}
        for hook in self.hooks:
            result.update(hook.result())
        return result


def parse_tier(text: str) -> tuple[str, int]:
    """A `--tier NAME=SIZE`; `host` is read as `dram`, its old name."""
    name, sep, size = text.partition("=")
    if not sep or not name:
        raise ConfigError("--tier", text, "use NAME=SIZE, e.g. dram=64GiB")
    try:
        return OLD_NAMES.get(name, name), parse_size(size)
    except ValueError as exc:
        raise ConfigError("--tier", text, str(exc)) from None
