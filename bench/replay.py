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

A host of a cluster (bench/cluster_replay.py, `--hosts`) also reads the bottom tiers of
its peers (`peers`), as kvstore/cluster/ does: after its own tiers, a chunk a peer holds
is a hit; it is promoted as a get promotes (only into a slot whose chunk the tier below
holds), and when it leaves DRAM it is dropped, never written to this host's disk. The
put stores only past the run some host holds, as the connector saves past the stored run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest, read_trace
from kvstore.format.errors import ConfigError
from kvstore.format.units import format_size, parse_size
from kvstore.tiers.admission import ADMISSIONS
from kvstore.tiers.policy import DEFAULT_ADMISSION, EVICTIONS, TierPolicy
from kvstore.tiers.slots import Entry, Fate, Reservation, SlotTable

MEMORY_TIERS = ("gpu", "hbm", "host", "dram")  # tier names that are not disk: nothing refused
_ADMIT_ALL = TierPolicy()  # victim fates between memory tiers: admission is the disk's alone


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


class Replayer:
    def __init__(self, tiers: Sequence[tuple[str, int] | SimTier], kv_bytes_per_token: int,
                 block_tokens: int = MOONCAKE_BLOCK_TOKENS, policy: TierPolicy | None = None,
                 peers: Sequence[SimTier] | None = None) -> None:
        """`peers` (a cluster host; [] for one alone): the bottom tiers of the other hosts."""
        if not tiers:
            raise ConfigError("--tier", None, "give at least one tier, e.g. --tier host=64GiB")
        self.block_tokens = block_tokens
        self.chunk_bytes = kv_bytes_per_token * block_tokens
        self.tiers = [t if isinstance(t, SimTier) else SimTier(*t, self.chunk_bytes) for t in tiers]
        self.policy = policy or TierPolicy(chunk_tokens=block_tokens)
        for tier in self.tiers:
            tier.table.set_eviction(self.policy.make_eviction())
        self.total_tokens = 0
        self.admission_refused = 0  # chunks the disk would not take, dropped from DRAM
        self.recompute_cost = 0.0  # modelled cost of the usable chunks missed (policy.depth_cost)
        self.recompute_cost_no_cache = 0.0  # ... and of every usable chunk
        self._refusing: set[bytes] = set()  # victims the fate just refused the disk
        self.requests = 0
        self.peers = peers
        self.peer_stats = TierStats("peer", sum(p.stats.capacity_bytes for p in peers or ()))
        self._from_peers: set[bytes] = set()  # DRAM copies of chunks read from a peer
        self.tiers[0].table.listeners.append(self._left_top)
        self.disks = {i for i, t in enumerate(self.tiers) if i and t.stats.name not in MEMORY_TIERS}
        self._unread: set[bytes] = set()  # on a disk tier, not read since written there
        self.disk_writes_read = 0  # disk writes read at least once before leaving the disk
        for level in self.disks:
            self.tiers[level].table.listeners.append(self._disk_changed)

    def run(self, requests: Iterable[TraceRequest]) -> dict[str, Any]:
        for request in requests:
            self.serve(request)
        return self.result()

    def serve(self, request: TraceRequest) -> list[int]:
        """Account one request; returns the tier index of each hit block, in order."""
        self.requests += 1
        self.total_tokens += request.input_tokens
        keys = list(request.keys)
        usable = min(len(keys), (request.input_tokens - 1) // self.block_tokens)
        # A cluster host's connector saves past the run stored anywhere; alone, all is put.
        stored = 0 if self.peers is None else next(
            (i for i, key in enumerate(keys) if not self._held(key) and not self._at_peer(key)), len(keys))
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
            if tier in self.disks and key in self._unread:
                self._unread.discard(key)
                self.disk_writes_read += 1
        self.recompute_cost += sum(map(self.policy.depth_cost, range(len(found), usable)))
        self.recompute_cost_no_cache += sum(map(self.policy.depth_cost, range(usable)))
        parents = [None, *keys[:-1]]
        hits = keys[: len(found)]
        if self.policy.promote_on_hit:  # the connector's prefetch on arrival: hits move up
            self.tiers[0].table.touch_chain(hits)
            self._promote(found, keys, parents, "prefetch")
            self._promote_from_peers(self._elsewhere(hits), keys, parents)
        self._touch(hits)  # the get: what the prefetch left below moves up if a slot is clean
        if self.policy.promote_on_hit:
            elsewhere = self._elsewhere(hits)  # what the get will read from peers
            self._promote(found, keys, parents, "get")
            self._promote_from_peers(elsewhere, keys, parents)
        self._touch(hits)
        self.policy.seen(hits)
        put = keys[stored:]  # the put: what no tier holds of it is stored
        new = [i for i in range(stored, len(keys)) if not self._held(keys[i])]
        self.policy.seen(put, keys[stored - 1] if stored else None)
        self._touch(put)
        self._store(0, [keys[i] for i in new], [parents[i] for i in new])
        self._touch(put)
        return found

    def _held(self, key: bytes) -> bool:
        return any(key in tier for tier in self.tiers)

    def _at_peer(self, key: bytes) -> bool:
        return any(key in peer for peer in self.peers or ())

    def _elsewhere(self, hits: list[bytes]) -> list[int]:
        """The hits no local tier holds now: the store reads those from peers."""
        if not self.peers:
            return []
        return [i for i, key in enumerate(hits) if not self._held(key) and self._at_peer(key)]

    def _promote_from_peers(self, up: list[int], keys: list[bytes], parents: list[bytes | None]) -> None:
        """Chunks read from peers move up as a get promotes them (only into a clean slot)."""
        self._store(0, [keys[i] for i in up], [parents[i] for i in up], "get", from_peer=True)

    def _disk_changed(self, published: bool, entry: Entry) -> None:
        """Disk tier listener: a written chunk is unread until a hit reads it."""
        if published:
            self._unread.add(entry.key)
        else:
            self._unread.discard(entry.key)

    def _left_top(self, published: bool, entry: Entry) -> None:
        """Top tier listener: a chunk read from a peer leaves DRAM."""
        if not published:
            self._from_peers.discard(entry.key)

    def _promote(self, found: list[int], keys: list[bytes], parents: list[bytes | None], mode: str) -> None:
        """Move lower-tier hits up; as in the store, they stay pinned below meanwhile (the
        victims written down cannot evict them)."""
        up = [i for i in range(len(found))
              if keys[i] not in self.tiers[0] and any(keys[i] in tier for tier in self.tiers[1:])]
        with ExitStack() as stack:
            for tier in self.tiers[1:]:
                stack.enter_context(tier.table.pinned(keys, up))
            self._store(0, [keys[i] for i in up], [parents[i] for i in up], mode)

    def _touch(self, keys: list[bytes]) -> None:
        for tier in self.tiers:
            tier.table.touch_chain(keys)

    def _store(self, level: int, keys: list[bytes], parents: list[bytes | None],
               mode: str = "put", from_peer: bool = False) -> None:
        """Put chunks in tier `level` in the store's order: slots reserved first (none
        tried after one is refused); victims that must go down first are written below
        (in order), then the chunks are published; a put that found no slot goes one tier
        down, a promotion ("prefetch" or "get") does not."""
        tier = self.tiers[level]
        reserved: list[tuple[bytes, bytes | None, Reservation | None]] = []
        for key, parent in zip(keys, parents, strict=True):
            reservation = None
            if not reserved or reserved[-1][2] is not None:
                reservation = tier.table.reserve(fate=lambda victim: self._fate(level, victim, mode))
            reserved.append((key, parent, reservation))
        refusing, self._refusing = self._refusing, set()
        demoting = [(j, r, r.victim) for j, (_, _, r) in enumerate(reserved)
                    if r is not None and r.victim is not None]
        if demoting:  # the victims go down in one batch, as the store's Flusher.take_over writes them
            entries = [tier.table.entry(r.slot) for _, r, _ in demoting]
            self._store(level + 1, [v for _, _, v in demoting], [e.parent if e else None for e in entries])
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
                if reservation.evicted in refusing:
                    self.admission_refused += 1
            if from_peer:
                self._from_peers.add(key)
            reservation.publish(key, parent, 0)
            tier.stats.bytes_written += self.chunk_bytes
        below = level + 1
        if mode == "put" and below < len(self.tiers):
            if below in self.disks:
                admitted = [(key, parent) for key, parent in down if self.policy.admits(key)]
                self.admission_refused += len(down) - len(admitted)
                down = admitted
            self._store(below, [k for k, _ in down], [p for _, p in down])

    def _fate(self, level: int, key: bytes, mode: str) -> Fate:
        """The store's victim fate (TierPolicy.victim_fate) for tier `level`: a put's and a
        prefetch's victims go down first, a get's promotion passes them over."""
        below = level + 1
        if below >= len(self.tiers):
            return Fate.EVICT
        held = key in self.tiers[below] or key in self._from_peers
        policy = self.policy if below in self.disks else _ADMIT_ALL
        fate = policy.victim_fate(key, held, promotion=mode == "get")
        if fate is Fate.EVICT and not held:
            self._refusing.add(key)
        return fate

    def result(self) -> dict[str, Any]:
        stats = [t.stats for t in self.tiers] + ([self.peer_stats] if self.peers else [])
        for tier in stats:
            tier.hit_ratio = tier.hit_tokens / max(1, self.total_tokens)
        hits = sum(t.hit_tokens for t in stats)
        written = sum(self.tiers[i].stats.bytes_written for i in self.disks)
        read = sum(self.tiers[i].stats.bytes_read for i in self.disks)
        never_read = written - self.disk_writes_read * self.chunk_bytes
        return {"requests": self.requests, "prompt_tokens": self.total_tokens,
                "chunk_bytes": self.chunk_bytes, "hit_ratio": hits / max(1, self.total_tokens),
                "admission": self.policy.admission, "eviction": self.policy.eviction,
                "disk_bytes_written": written, "disk_bytes_read": read,
                "disk_bytes_written_per_byte_read": written / read if read else None,
                "disk_bytes_written_never_read": never_read,
                "admission_refused": self.admission_refused,
                "recompute_cost": self.recompute_cost,
                "recompute_cost_no_cache": self.recompute_cost_no_cache,
                "tiers": [asdict(t) for t in stats]}


def parse_tier(text: str) -> tuple[str, int]:
    name, sep, size = text.partition("=")
    if not sep or not name:
        raise ConfigError("--tier", text, "use NAME=SIZE, e.g. host=64GiB")
    try:
        return name, parse_size(size)
    except ValueError as exc:
        raise ConfigError("--tier", text, str(exc)) from None


SWEEP_FACTORS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="Mooncake-format JSONL trace")
    parser.add_argument("--tier", action="append", default=[], metavar="NAME=SIZE",
                        help="a tier, top first (repeat): e.g. --tier host=64GiB --tier disk=2TiB; "
                             "a tier below the top not named gpu, hbm, host or dram is a disk "
                             "(disk admission applies to it and its writes are counted)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=131072,
                        help="KV bytes one token takes (2 x layers x kv_heads x head_dim x dtype); a "
                             "hybrid model: its full-attention groups' bytes plus each sliding-window "
                             "group's x the share of chunks it stores (the worker logs B/token per "
                             "group; docs/vllm.md)")
    parser.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS)
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--no-promote", action="store_true", help="lower-tier hits stay put")
    parser.add_argument("--admission", choices=tuple(ADMISSIONS), default=DEFAULT_ADMISSION,
                        help="disk admission policy (kvstore/tiers/admission.py; config `disk_admission`)")
    parser.add_argument("--eviction", choices=EVICTIONS, default="lru",
                        help="eviction of every tier: lru, or cost (recompute cost on a recency clock); "
                             "config `eviction`")
    parser.add_argument("--sweep", action="store_true",
                        help="also scale every tier by 1/64 .. 4x and report the hit-ratio curve")
    parser.add_argument("--ttft", action="store_true",
                        help="also estimate TTFT and throughput for no cache, then each tier added")
    parser.add_argument("--hardware", default="h100", help="profile for --ttft: h100, h200, mi300x, rtx4090")
    parser.add_argument("--model", default="llama-3.1-8b",
                        help="for --ttft: a preset (llama-3.1-8b, ...) or a config.json; its KV "
                             "bytes per token replace --kv-bytes-per-token")
    parser.add_argument("--budget", type=int, default=8192, help="scheduler tokens per step (--ttft)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply arrival times (--ttft): >1 spreads a cluster's trace over one GPU")
    parser.add_argument("--hosts", type=int,
                        help="N hosts sharing one array (the last --tier, split N ways) against N "
                             "private islands; other tiers are per host (bench/cluster_replay.py)")
    parser.add_argument("--routing", choices=("random", "prefix"), default="prefix",
                        help="with --hosts: uniform, or by a hash of the first block (a KV-aware router)")
    parser.add_argument("--seed", type=int, default=0, help="with --hosts: the random routing's seed")
    parser.add_argument("--next-turn", choices=("off", "warm", "predict", "oracle"),
                        help="also model what happens when a request ends (bench/next_turn_replay.py) "
                             "and report dram_resident_at_arrival and prefetch_wasted_bytes; `oracle` "
                             "knows when each chunk arrives next (the bound for `predict`)")
    parser.add_argument("--tpot-ms", type=float, default=20.0,
                        help="with --next-turn: a request ends output tokens x this after it arrives")
    parser.add_argument("--json", help="write the results here (a PNG plot goes next to it)")


def run(args: argparse.Namespace) -> int:
    tiers = [parse_tier(t) for t in args.tier]
    if args.hosts is not None:
        from bench.cluster_replay import run as run_cluster

        return run_cluster(args, tiers)
    if args.ttft:
        from bench.ttft_model import model_spec

        args.kv_bytes_per_token = model_spec(args.model).kv_bytes_per_token
    started = time.perf_counter()
    result = _replay(args, tiers)
    result["seconds"] = time.perf_counter() - started
    _print(result)
    if args.sweep:
        result["sweep"] = [{"factor": f, **_replay(args, [(n, int(c * f)) for n, c in tiers])}
                           for f in SWEEP_FACTORS]
        _print_sweep(result["sweep"])
    if args.ttft:
        result["ttft"] = _ttft_rows(args, tiers)
        _print_ttft(result["ttft"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        if args.sweep:
            from bench.plots import PlotUnavailable, plot_sweep

            try:
                print(f"plot: {plot_sweep(result['sweep'], Path(args.json).with_suffix('.png'))}")
            except PlotUnavailable as exc:
                print(exc)
    return 0


def _replay(args: argparse.Namespace, tiers: list[tuple[str, int]]) -> dict[str, Any]:
    replayer: Replayer
    if getattr(args, "next_turn", None):
        from bench.next_turn_replay import NextTurnReplayer

        replayer = NextTurnReplayer(tiers, args.kv_bytes_per_token, args.block_tokens, args.next_turn,
                                    tpot_s=args.tpot_ms / 1000, policy=_policy(args))
        if args.next_turn == "oracle":
            replayer.foresee(read_trace(args.trace, args.block_tokens, args.limit))
    else:
        replayer = Replayer(tiers, args.kv_bytes_per_token, args.block_tokens, policy=_policy(args))
    return replayer.run(read_trace(args.trace, args.block_tokens, args.limit))


def _policy(args: argparse.Namespace) -> TierPolicy:
    return TierPolicy(promote_on_hit=not args.no_promote, admission=args.admission,
                      eviction=args.eviction, chunk_tokens=args.block_tokens)


TIER_PATHS = {"gpu": "hbm", "hbm": "hbm", "host": "dram", "dram": "dram", "disk": "disk",
              "nvme": "disk", "ssd": "disk", "nvmeof": "nvmeof", "fabric": "nvmeof"}


def _ttft_rows(args: argparse.Namespace, tiers: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """One row per configuration: no cache, then the tiers added one at a time, top first."""
    from bench.sched_model import SimRequest, simulate
    from bench.ttft_model import PROFILES, model_spec

    if args.hardware not in PROFILES:
        raise ConfigError("--hardware", args.hardware, f"known: {', '.join(PROFILES)}")
    unknown = [name for name, _ in tiers if name not in TIER_PATHS]
    if unknown:
        raise ConfigError("--tier", unknown[0], f"--ttft needs a known tier kind: {', '.join(TIER_PATHS)}")
    model, hardware = model_spec(args.model), PROFILES[args.hardware]
    rows = []
    for count in range(len(tiers) + 1):
        config = tiers[:count]
        replayer = Replayer(config, args.kv_bytes_per_token, args.block_tokens,
                            policy=_policy(args)) if config else None
        requests = []
        for request in read_trace(args.trace, args.block_tokens, args.limit):
            hits: dict[str, int] = {}
            for tier in replayer.serve(request) if replayer else []:
                hits[config[tier][0]] = hits.get(config[tier][0], 0) + args.block_tokens
            requests.append(SimRequest(request.arrival_s * args.time_scale, request.input_tokens,
                                       max(1, request.output_tokens), hits))
        summary = simulate(requests, model, hardware, {n: TIER_PATHS[n] for n, _ in config}, args.budget)
        rows.append({"config": " + ".join(n for n, _ in config) or "no cache", **summary})
    return rows


def _print_ttft(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'configuration':<28} {'TTFT p50':>10} {'TTFT p90':>10} {'output tok/s':>13}")
    for row in rows:
        print(f"{row['config']:<28} {row['ttft_p50_s']:>9.2f}s {row['ttft_p90_s']:>9.2f}s "
              f"{row['throughput_tokens_per_s']:>13.0f}")


def _print(result: dict[str, Any]) -> None:
    print(f"{result['requests']} requests, {result['prompt_tokens']} prompt tokens, chunk "
          f"{format_size(result['chunk_bytes'])}, {result['seconds']:.1f} s")
    print(f"{'tier':<8} {'capacity':>10} {'hit ratio':>10} {'read':>10} {'written':>10} {'evictions':>10}")
    for tier in result["tiers"]:
        print(f"{tier['name']:<8} {format_size(tier['capacity_bytes']):>10} {tier['hit_ratio']:>10.3f} "
              f"{format_size(tier['bytes_read']):>10} {format_size(tier['bytes_written']):>10} "
              f"{tier['evictions']:>10}")
    print(f"{'all':<8} {'':>10} {result['hit_ratio']:>10.3f}")
    per_read = result["disk_bytes_written_per_byte_read"]
    print(f"admission {result['admission']}, eviction {result['eviction']}: disk "
          f"{format_size(result['disk_bytes_written'])} written ("
          f"{format_size(result['disk_bytes_written_never_read'])} never read), "
          f"{format_size(result['disk_bytes_read'])} read ({'-' if per_read is None else f'{per_read:.2f}'} "
          f"written per byte read), "
          f"{result['admission_refused']} chunks refused; recompute cost "
          f"{result['recompute_cost'] / max(1e-9, result['recompute_cost_no_cache']):.3f} of no cache")
    if "next_turn" in result:
        print(f"next turn {result['next_turn']}: {result['dram_resident_at_arrival']:.3f} of found chunks in "
              f"DRAM at arrival; read ahead {format_size(result['prefetch_read_bytes'])}, wasted "
              f"{format_size(result['prefetch_wasted_bytes'])} ({result['prefetch_wasted_fraction']:.0%})")


def _print_sweep(rows: list[dict[str, Any]]) -> None:
    print("\ncapacity scale   " + "  ".join(f"{t['name']:>10}" for t in rows[0]["tiers"]) + "   hit ratio")
    for row in rows:
        sizes = "  ".join(f"{format_size(t['capacity_bytes']):>10}" for t in row["tiers"])
        print(f"{row['factor']:>14.4g}   {sizes}   {row['hit_ratio']:>9.3f}")
