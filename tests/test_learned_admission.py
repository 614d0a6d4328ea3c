"""Learned disk admission, the write budget and the clairvoyant bound: their parts on
hand-made events, and whole replays of small made-up traces (seconds each)."""

from __future__ import annotations

import fcntl
import json
import math
import os
import random
import signal
import stat
import time
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.services import service_config, stop_service

from bench.sim.replay import Replayer
from bench.support.trace import read_passes
from kvstore.cli import main as cli_main
from kvstore.config.store import load_config
from kvstore.format.errors import ConfigError, KVStoreError
from kvstore.format.units import parse_write_budget
from kvstore.service import protocol as P
from kvstore.service.client import StoreClient
from kvstore.tiers.admission import THRESHOLD, TinyLFU, Tuning
from kvstore.tiers.chain_history import ChainHistory
from kvstore.tiers.policy import ChainMemory, TierPolicy
from kvstore.tiers.return_rates import BUCKETS, EVERYONE, RequestEnd, ReturnRates
from kvstore.tiers.slots import Change
from kvstore.tiers.write_budget import DAY_S, WriteBudget

BLOCK = 4  # tokens per block; with 1 byte per token a chunk is 4 bytes
SHORT, LONG = RequestEnd(answer_tokens=20), RequestEnd(answer_tokens=600)


def keys(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}{i}".encode().ljust(16, b".") for i in range(count)]


# -- return rates ------------------------------------------------------------------------


def trained(rates: ReturnRates) -> ReturnRates:
    """Chunks of short answers leave DRAM and come back; chunks of long answers leave and do
    not; then every departure has been out a whole ramp."""
    for i in range(40):
        back, gone = keys(f"b{i}-", 2), keys(f"g{i}-", 2)
        rates.finished(back, SHORT)
        rates.finished(gone, LONG)
        for key in back + gone:
            rates.left(key, now=10.0 * i)
        rates.named(back, now=10.0 * i + 5)
    rates.named([], now=400.0 + rates.ramp_s)
    return rates


def test_a_bucket_whose_chunks_come_back_is_told_from_one_whose_chunks_do_not():
    """Once departures have been out a whole ramp, the rates tell short answers' chunks
    (they came back) from long answers' (they did not)."""
    rates = trained(ReturnRates(capacity=1 << 12))
    short, long = keys("new-short", 1), keys("new-long", 1)
    rates.finished(short, SHORT)
    rates.finished(long, LONG)
    assert rates.rate_of(short[0]) > 0.8 and rates.rate_of(long[0]) < 0.1
    came_back = keys("b0-", 1)[0]  # a bucket of its own, with nothing yet
    assert rates.rate_of(came_back) == pytest.approx(rates.overall())
    assert rates.rate(rates.bucket_of(b"never seen".ljust(16))) == pytest.approx(rates.overall())


def test_a_chains_last_chunk_is_learned_apart_from_the_rest():
    """A next turn reuses a chain but often not its last chunk: that chunk has a bucket of
    its own, so the rest of the chain is not refused for it (one bucket for all three
    would rate each chunk about 2/3)."""
    rates = ReturnRates(capacity=1 << 12)
    for i in range(40):
        chain = keys(f"c{i}-", 3)
        rates.finished(chain, SHORT)
        for key in chain:
            rates.left(key, now=10.0 * i)
        rates.named(chain[:2], now=10.0 * i + 5)
    rates.named([], now=400.0 + rates.ramp_s)
    new = keys("new", 3)
    rates.finished(new, SHORT)
    assert rates.rate_of(new[0]) > 0.8 and rates.rate_of(new[1]) > 0.8 and rates.rate_of(new[2]) < 0.1


def test_a_shared_chunk_that_leaves_dram_late_is_learned_apart():
    """A chunk named before that leaves DRAM long after it was last named (its conversation
    has likely ended) is a departure of a bucket of its own, whatever its request's; the
    same chunk leaving soon after it was named keeps its request's bucket."""
    rates = ReturnRates(capacity=1 << 12)
    for i in range(80):  # one chunk at a time: each named, out of DRAM 10 s or 200 s later
        chunk, start = keys(f"s{i}-", 1), 1000.0 * i
        for _ in range(2):  # named by a second request: a shared chunk
            rates.finished(chunk, SHORT)
        rates.named(chunk, now=start)
        late = i % 4 == 0
        rates.left(chunk[0], now=start + (200.0 if late else 10.0))
        if not late:
            rates.named(chunk, now=start + 15)  # back soon; the late ones never
    rates.named([], now=80_000.0 + rates.ramp_s)
    new = keys("new", 1)
    for _ in range(2):
        rates.finished(new, SHORT)
    now = 90_000.0 + rates.ramp_s
    rates.named(new, now=now)
    assert rates.bucket_of(new[0], now + 5) != rates.bucket_of(new[0], now + 400)
    assert rates.rate_of(new[0], now + 5) > 0.8 and rates.rate_of(new[0], now + 400) < 0.1


def test_what_was_learned_is_restored_whole_by_a_later_process():
    """A restart keeps the per-bucket counts (as JSON, no key in them): the new process
    tells the buckets apart at once, where one from cold admits everything."""
    state = json.loads(json.dumps(trained(ReturnRates(1 << 12)).state()))
    assert not any(isinstance(v, str) for v in state.values())  # counts only, no keys
    restarted, cold = ReturnRates(1 << 12), ReturnRates(1 << 12)
    restarted.restore(state)
    assert restarted.state() == state
    for rates in (restarted, cold):
        rates.finished(keys("short", 1), SHORT)
        rates.finished(keys("long", 1), LONG)
    assert restarted.rate_of(keys("short", 1)[0]) > 0.8 and restarted.rate_of(keys("long", 1)[0]) < 0.1
    assert cold.rate_of(keys("long", 1)[0]) == 1.0  # before anything is learned nothing is refused


def damaged(state: dict) -> list[object]:
    """A stored state changed in each way a damaged, foreign or older file could be."""
    return [None, [], "state", {**state, "version": 0}, {**state, "version": 2},
            {**state, "tallies": state["tallies"] + 1}, {**state, "extra": 1},
            {k: v for k, v in state.items() if k != "delay"}, {**state, "returns": state["returns"][:-1]},
            {**state, "settled": [-1.0] * state["tallies"]}, {**state, "chains": [math.inf, 0.0]},
            {**state, "delay": [True, 1.0]}, {**state, "returns": ["1"] * state["tallies"]},
            {**state, "refused": [1e300, 0.0]}, {k: v for k, v in state.items() if k != "age"},
            {**state, "age": [math.nan, 1.0]}, {k: v for k, v in state.items() if k != "refused"}]


@given(st.data())
def test_a_stored_state_is_taken_whole_or_refused_whole(data):
    good = trained(ReturnRates(1 << 10)).state()
    value = data.draw(st.one_of(st.sampled_from(damaged(good)), st.recursive(
        st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12)))
    rates = ReturnRates(64)
    before = rates.state()
    with pytest.raises(ValueError):
        rates.restore(value)
    assert rates.state() == before


def test_a_departure_counts_in_proportion_to_its_time_out():
    """No return can have been seen of a chunk that just left: it weighs nothing yet, so a
    bucket is not taken for one that never returns while its returns are on their way."""
    rates = ReturnRates(capacity=256)
    chains = [keys(f"c{i}-", 8) for i in range(16)]  # 16 requests' chains: evidence the prior gives way to
    for chain in chains:
        rates.finished(chain, LONG)
        for key in chain:
            rates.left(key, now=0.0)
    bucket = rates.bucket_of(chains[0][0])
    assert rates.rate(bucket, now=0.0) == pytest.approx(1.0)  # out for no time: the prior (1)
    ramp = rates.ramp_s
    half = rates.rate(bucket, now=ramp / 2)
    assert 1.0 > half > rates.rate(bucket, now=2 * ramp) and rates.rate(bucket, now=2 * ramp) < 0.5
    rates.named([], now=2 * ramp)  # moved out of the ramp: the same
    assert rates.rate(bucket) == pytest.approx(rates.rate(bucket, now=2 * ramp))


def test_what_the_rates_remember_is_bounded():
    rates = ReturnRates(capacity=32)
    for i in range(2000):
        chunk = keys(f"k{i}-", 1)
        rates.finished(chunk, SHORT)
        rates.left(chunk[0], now=float(i))
        if i % 3 == 0:
            rates.named(chunk, now=i + 0.5)
        rates.inferred(keys(f"p{i}-", 1), RequestEnd(None), 1)
    assert len(rates._label) <= 32 and len(rates._departed) <= 32 and len(rates._guessed) <= 32
    assert len(rates._came_back) <= 32 and len(rates._young) <= 33 and len(rates._named_at) <= 32
    assert sum(rates.tallies.settled[:BUCKETS]) < 2 * 32 + 2000 / 32  # halved as they grow


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_a_request_end_takes_only_finite_idle_times(idle):
    if math.isfinite(idle) and 0 <= idle <= 1e9:
        assert RequestEnd(10, 1, idle).bucket() > 0
    else:
        with pytest.raises(ValueError):
            RequestEnd(10, 1, idle)


def test_the_protocol_refuses_a_finish_that_is_not_a_number_or_out_of_range():
    ok = msgspec.msgpack.encode({"type": "finished", "ranks": [[b"k" * 16]], "answer_tokens": 5,
                                 "turn": 2, "idle_s": 3.5})
    assert P.REQUEST.decode(ok) == P.Finished([[b"k" * 16]], 5, 2, 3.5)
    assert P.REQUEST.decode(msgspec.msgpack.encode({"type": "finished", "ranks": []})).answer_tokens is None
    for field, value in (("idle_s", float("nan")), ("idle_s", float("inf")), ("idle_s", -1.0),
                         ("answer_tokens", -1), ("answer_tokens", 1 << 40), ("turn", True),
                         ("turn", 2.5), ("idle_s", "soon")):
        frame = msgspec.msgpack.encode({"type": "finished", "ranks": [], field: value})
        with pytest.raises(msgspec.ValidationError):
            P.REQUEST.decode(frame)


def test_a_next_turn_continues_the_chain_its_keys_hold():
    history = ChainHistory(capacity=4)
    first = keys("a", 3)
    assert history.arrived(first, 0.0) == (0, None)
    history.ended(first[-1:], 0, now=5.0)
    assert history.arrived([*first, *keys("b", 2)], 65.0) == (1, 60.0)
    assert history.arrived(keys("z", 3), 65.0) == (0, None)
    for i in range(10):
        history.ended(keys(f"x{i}", 1), 0, now=70.0)
    assert history.arrived([*first, *keys("b", 2)], 80.0) == (0, None)  # forgotten: bounded


# -- the policy ----------------------------------------------------------------------------


def learned(threshold: float = 0.3, budget: int | None = None,
            loss: float = 0.0) -> tuple[TierPolicy, list[float]]:
    """A `learned` policy on a clock of the test's; its threshold `threshold` alone unless `loss`."""
    clock = [0.0]
    policy = TierPolicy(admission="learned", tuning=Tuning(threshold, loss))
    policy.clock = lambda: clock[0]
    policy.set_budget(budget, write_bytes=1)
    return policy, clock


def test_admits_changes_nothing_however_often_a_victim_scan_asks():
    policy, clock = learned(budget=1000)
    chain = keys("c", 4)
    policy.finished(chain, LONG)
    for key in chain:
        policy.left_dram(key, on_disk=False)
    clock[0] = 50.0
    before = policy.describe(), [policy.refusal(key) for key in chain]
    for _ in range(1000):
        for key in chain:
            policy.admits(key)
    assert (policy.describe(), [policy.refusal(key) for key in chain]) == before


def test_a_threshold_change_keeps_what_was_learned():
    policy, clock = learned()
    chains = [keys(f"c{i}-", 4) for i in range(16)]
    for chain in chains:
        policy.finished(chain, LONG)
        for key in chain:
            policy.left_dram(key, on_disk=False)
    chain = chains[0]
    clock[0] = 3600.0  # out for an hour, none came back
    assert not policy.admits(chain[0])
    policy.set_admission("learned", tuning=Tuning(threshold=0.0, loss=0.0))
    assert policy.admits(chain[0]) and policy.tuning.threshold == 0.0
    policy.set_admission("learned", tuning=Tuning(threshold=0.9))
    assert not policy.admits(chain[0])


def test_tinylfu_is_sized_from_the_tiers():
    policy = TierPolicy(admission="tinylfu")
    policy.set_capacity(dram_chunks=1000, stored_chunks=300_000)
    assert isinstance(policy._admission, TinyLFU) and policy._admission.width >= 300_000
    policy.set_capacity(dram_chunks=10, stored_chunks=1 << 40)
    assert policy._admission.width <= 1 << 22  # bounded however large the tiers


def test_families_start_where_chains_sharing_a_prefix_diverge():
    """Every request starts with the same system prompt S1 S2: the first chunk names no
    family; each conversation is one from the chunk where it left the others."""
    chains = ChainMemory()
    system, a, b = keys("s", 2), keys("a", 3), keys("b", 2)
    assert chains.record(system + a, None) == system[0]  # the first: nothing diverged yet
    assert chains.record(system + b, None) == b[0]  # S2 now has two children: b starts a family
    assert chains.record(system + a + keys("a-next", 1), None) == a[0]  # so does a, seen again
    assert chains.record(keys("a-next", 1) + keys("a-more", 1), None) == a[0]  # a later part, alone
    assert chains.depth(b[1], None) == 3


# -- the write budget ------------------------------------------------------------------------


@given(st.lists(st.tuples(st.floats(0, 3 * DAY_S), st.integers(1, 50)), min_size=1, max_size=200))
def test_no_24_hours_write_more_than_the_budget(claims):
    """Whenever and however much is asked, what is granted in any 24 hours stays within it."""
    budget = WriteBudget(bytes_per_day=1000, write_bytes=7, now=0.0)
    granted: list[tuple[float, int]] = []
    for at, chunks in sorted(claims):
        got = budget.claim(chunks, at)
        assert 0 <= got <= chunks
        granted.append((at, got * 7))
    for start, _ in granted:
        assert sum(b for at, b in granted if start <= at < start + DAY_S) <= 1000


def test_a_write_that_did_not_land_gives_its_allowance_back():
    budget = WriteBudget(bytes_per_day=24 * 10, write_bytes=1, now=0.0)  # 10 held at most
    assert budget.claim(4, 0.0) == 4 and budget.left(0.0) == 6
    budget.refund(3, 0.0)
    assert budget.left(0.0) == 9 and budget.written == 1
    assert budget.claim(100, 0.0) == 9 and not budget.room(0.0)


def test_the_budget_threshold_refuses_the_least_likely_first():
    """Chunks offered at return rates 0.1, 0.5 and 0.9 alike, three times faster than the
    allowance accrues: the threshold rises past 0.1, and past 0.5 as the allowance drains."""
    budget = WriteBudget(bytes_per_day=int(DAY_S), write_bytes=1, now=0.0)  # ~1 byte a second
    for second in range(600):
        for rate in (0.1, 0.5, 0.9):
            budget.offered(rate, float(second))
    assert 0.1 < budget.threshold(600.0) <= 0.9
    budget.claim(10 ** 9, 600.0)  # drained
    assert budget.threshold(600.0) > 0.9


def test_write_budgets_take_sizes_and_drive_writes_per_day():
    assert parse_write_budget("2TiB", 10) == 2 << 40
    assert parse_write_budget("0.5 dwpd", 4 << 40) == 2 << 40
    with pytest.raises(ValueError, match="write budget"):
        parse_write_budget("lots", 1)
    config = load_config({"tiers": {"dram": {"capacity": "1GiB"}}, "disk_write_budget": "0.3 DWPD"})
    assert config.disk_write_budget == "0.3 dwpd" and config.disk_admission == "learned"
    plain = load_config({"tiers": {"dram": {"capacity": "1GiB"}}})
    assert plain.disk_admission == "all" and plain.disk_admission_threshold == THRESHOLD
    assert load_config({"tiers": {"dram": {"capacity": "1GiB"}}, "disk_write_budget": "1TiB",
                        "disk_admission": "all"}).disk_admission == "all"  # a cap on `all`, as asked
    with pytest.raises(ConfigError, match="disk_write_budget"):
        load_config({"tiers": {"dram": {"capacity": "1GiB"}}, "disk_write_budget": "often"})
    with pytest.raises(ConfigError, match="write_through"):
        load_config({"tiers": {"dram": {"capacity": "1GiB"}}, "disk_write_budget": "1TiB",
                     "write_policy": "write_through", "disk_admission": "all"})
    with pytest.raises(ConfigError, match="disk_admission_threshold"):
        load_config({"tiers": {"dram": {"capacity": "1GiB"}}, "disk_admission_threshold": 1.5})


# -- replays of small made-up traces ---------------------------------------------------------


def returning_trace(path, conversations: int = 400, seed: int = 0, gap_s: float = 1.0) -> str:
    """One new conversation every `gap_s` seconds on a context of its own (4 blocks); a third
    come back once, 5-10 minutes later (past DRAM), and those answered briefly; the others
    answered at length and never came back. How a request ended says whether it returns."""
    rng = random.Random(seed)
    rows = []
    for i in range(conversations):
        context = [10 * i + j for j in range(4)]
        back = rng.random() < 1 / 3
        rows.append({"timestamp": int(i * gap_s * 1000), "input_length": 4 * BLOCK + 1,
                     "output_length": 20 if back else 600, "hash_ids": context})
        if back:
            at = i * gap_s + rng.uniform(300, 600)
            rows.append({"timestamp": int(at * 1000), "input_length": 5 * BLOCK + 1,
                         "output_length": 600, "hash_ids": [*context, 10 * i + 9]})
    rows.sort(key=lambda row: row["timestamp"])
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def replay(capsys, trace: str, *options: str) -> dict:
    """`kvstore replay` with DRAM of 20 chunks over a disk that never fills; its JSON."""
    out = trace + ".json"
    assert cli_main(["replay", trace, "--tier", f"dram={20 * BLOCK}", "--tier", f"disk={1 << 20}",
                     "--kv-bytes-per-token", "1", "--block-tokens", str(BLOCK), "--json", out,
                     *options]) == 0
    capsys.readouterr()
    with open(out) as f:
        return json.load(f)


def test_learned_admission_writes_what_comes_back_against_the_bound(tmp_path, capsys):
    """Done when, on a small trace: in the steady state (a pass before the one measured),
    `learned` writes at most half of `all`'s bytes for at most 0.01 of hit ratio, and at least
    70% of the oracle's saving; the oracle writes only what is read again and loses nothing."""
    trace = returning_trace(tmp_path / "t.jsonl")
    oracle = replay(capsys, trace, "--admission", "oracle", "--passes", "2")
    assert oracle["disk_bytes_written_never_read"] == 0 and oracle["disk_bytes_written"] > 0
    result = replay(capsys, trace, "--admission", "learned", "--passes", "2")
    bound = result["bound"]
    assert bound["oracle_hit_ratio_lost"] == 0
    assert bound["oracle_disk_bytes_written"] == oracle["disk_bytes_written"]
    assert bound["of_all_written"] <= 0.5 and bound["hit_ratio_lost"] <= 0.01
    assert bound["of_oracle_saving"] >= 0.7
    info = result["admission_info"]
    assert info["policy"] == "learned" and info["loss_budget"] == 0.01 and info["threshold"] > 0
    everything = replay(capsys, trace, "--passes", "2")
    assert everything["hit_ratio"] - result["hit_ratio"] == pytest.approx(bound["hit_ratio_lost"])
    assert bound["all_disk_hit_ratio"] == pytest.approx(everything["tiers"][1]["hit_ratio"])
    assert bound["all_disk_hit_ratio"] > 0


def test_the_answer_rule_refuses_what_long_answers_held(tmp_path, capsys):
    """`--admission answer-rule` (bench/sim/replay.py's rules, for docs/replay.md): on this
    trace an answer's length says whether its conversation comes back, so refusing every
    chunk whose latest request answered at length writes what the oracle writes and loses
    nothing; with its threshold past every answer it refuses nothing, as `all`."""
    trace = returning_trace(tmp_path / "t.jsonl")
    rule = replay(capsys, trace, "--admission", "answer-rule")
    assert rule["admission_refused"] > 0 and rule["bound"]["hit_ratio_lost"] == 0, rule["bound"]
    assert rule["disk_bytes_written"] == rule["bound"]["oracle_disk_bytes_written"] > 0
    none = replay(capsys, trace, "--admission", "answer-rule", "--answer-tokens", "601")
    assert none["admission_refused"] == 0 and none["bound"]["of_all_written"] == 1


def test_the_answer_rule_can_keep_what_earlier_requests_held(tmp_path, capsys):
    """Requests on 20 shared system prompts (4 blocks each: more than DRAM holds), each with
    a question of its own, all answered at length: by the answer alone every chunk leaving
    DRAM is refused, the prompts' disk hits with them; `--answer-first-only` keeps what an
    earlier request held (the prompts: all but their first departures) and refuses the rest
    (no question comes back)."""
    rows = [{"timestamp": i * 1000, "input_length": 6 * BLOCK + 1, "output_length": 600,
             "hash_ids": [*(100 * (i % 20) + j for j in range(4)), 10_000 + 2 * i, 10_001 + 2 * i]}
            for i in range(400)]
    trace = tmp_path / "shared.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    plain = replay(capsys, str(trace), "--admission", "answer-rule")["bound"]
    first = replay(capsys, str(trace), "--admission", "answer-rule", "--answer-first-only")["bound"]
    assert 0 < plain["all_disk_hit_ratio"] == pytest.approx(plain["hit_ratio_lost"]), plain
    assert first["hit_ratio_lost"] < plain["hit_ratio_lost"] / 2 and first["of_all_written"] < 0.5, first


def test_without_reported_ends_learned_admission_knows_less_and_loses_no_more(tmp_path, capsys):
    """On this trace only how a request ended (its answer's length) says whether it comes
    back. With no end reported (`--request-ends inferred`, as from SGLang's and LMCache's
    backends) the service's inferred ends know turns and idle times, not answers: it writes
    most of what `all` writes, and still loses nothing."""
    trace = returning_trace(tmp_path / "t.jsonl")
    told = replay(capsys, trace, "--admission", "learned", "--passes", "2")["bound"]
    inferred = replay(capsys, trace, "--admission", "learned", "--passes", "2", "--request-ends", "inferred")
    assert told["of_all_written"] < 0.5 < inferred["bound"]["of_all_written"]
    assert inferred["bound"]["hit_ratio_lost"] <= 0.01


def test_a_write_budget_is_never_exceeded_in_a_simulated_day(tmp_path, capsys):
    """Two days of conversations, one a minute: `all` writes about 25,000 bytes a day and
    `learned` about 7,400; a budget of 6,000 keeps every 24 hours at or under it, the chunks
    likely to come back written first (a budget on `all` writes whatever leaves DRAM first)."""
    trace = returning_trace(tmp_path / "t.jsonl", conversations=2880, gap_s=60.0)
    unbounded = replay(capsys, trace, "--admission", "learned", "--no-bound")
    assert unbounded["disk_bytes_written_max_day"] > 6000  # so the budget binds
    capped = replay(capsys, trace, "--write-budget", "6000", "--no-bound")
    assert 0 < capped["disk_bytes_written_max_day"] <= 6000 and capped["trace_seconds"] > 1.5 * 86400
    assert capped["admission_info"]["budget_bytes_per_day"] == 6000 and capped["budget_refused"] > 0
    assert capped["admission"] == "learned"  # what a budget defaults to
    plain = replay(capsys, trace, "--write-budget", "6000", "--admission", "all", "--no-bound")
    assert plain["disk_bytes_written_max_day"] <= 6000
    assert capped["hit_ratio"] > plain["hit_ratio"] + 0.05  # the budget spent on what comes back


def test_passes_are_other_traffic_of_the_same_kind(tmp_path):
    trace = returning_trace(tmp_path / "t.jsonl", conversations=50)
    first, last = read_passes(trace, BLOCK, passes=2)
    assert len(first) == len(last)
    assert not {k for r in first for k in r.keys} & {k for r in last for k in r.keys}
    assert min(r.arrival_s for r in last) > max(r.arrival_s for r in first)
    shapes = read_passes("synthetic:returning", BLOCK, limit=100, passes=2)
    assert [len(r.keys) for r in shapes[0]] != [len(r.keys) for r in shapes[1]]  # another seed
    with pytest.raises(KVStoreError, match="at least 1"):
        read_passes(trace, BLOCK, passes=0)


def test_the_replay_counts_refusals_once_per_chunk_that_leaves(tmp_path):
    """Refusals are counted from the DRAM table's events, not by asking the policy: as many
    as chunks that left DRAM with no disk copy."""
    trace = returning_trace(tmp_path / "t.jsonl", conversations=200)
    policy = TierPolicy(admission="second-touch", chunk_tokens=BLOCK)
    replayer = Replayer([("dram", 20 * BLOCK), ("disk", 1 << 20)], 1, BLOCK, policy=policy)
    dropped = []
    replayer.tiers[0].table.subscribe(
        lambda change, entry: dropped.append(entry.key) if change is Change.EVICTED and entry.key not in
        replayer.tiers[1] else None)
    (requests,) = read_passes(trace, BLOCK)
    result = replayer.run(requests)
    assert result["admission_refused"] == len(dropped) > 0


# -- the service keeps what was learned across restarts --------------------------------------


def test_the_service_keeps_what_was_learned_across_a_restart(tmp_path, disk_dir):
    """Written 0600 beside the socket when the service stops, handed to the next one's
    store; a damaged file is counted and the service learns from cold, never fails."""
    config = {**service_config(tmp_path, dram="4MiB", disk_dir=disk_dir, disk="16MiB", io={"timeout_s": 0.5}),
              "disk_admission": "learned"}
    saved = tmp_path / "kvstore.sock.learned"
    trained_state = trained(ReturnRates(1 << 12)).state()

    def restart() -> dict[str, int]:
        """Start the service (its store made by a worker's hello), read its counters, stop it."""
        worker = StoreClient(load_config(config), 64 * 1024)
        try:
            return worker.info()["counters"]
        finally:
            worker.close()
            stop_service(config)

    try:
        restart()
        assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600
        assert json.loads(saved.read_text())["tallies"] == trained_state["tallies"]
        saved.write_text(json.dumps(trained_state))
        assert "admission.learned_refused" not in restart()
        assert json.loads(saved.read_text()) == trained_state  # restored, then written back unchanged
        saved.write_text('{"version": 1, "buckets": "many"')
        assert restart()["admission.learned_refused"] == 1
        assert json.loads(saved.read_text())["returns"] != trained_state["returns"]  # learning from cold
    finally:
        stop_service(config)


def test_a_killed_service_is_followed_by_one_that_starts_from_what_it_had_learned(tmp_path, disk_dir):
    """While it runs, the service writes what it learned every `service.learned_save_s`: a
    successor of one killed outright (SIGKILL: no clean stop, no close) starts from that,
    where it would otherwise start from cold (no file was ever written by a clean stop)."""
    config = {**service_config(tmp_path, dram="1MiB", disk_dir=disk_dir, disk="16MiB", io={"timeout_s": 5.0},
                               learned_save_s=0.2), "disk_admission": "learned"}
    saved = tmp_path / "kvstore.sock.learned"
    chunks = keys("chain-", 48)  # DRAM holds 16: each wave of 8 pushes older ones out to disk

    def returns() -> float:
        """The returns counted in the file (0 before there is one)."""
        return json.loads(saved.read_text())["returns"][EVERYONE] if saved.exists() else 0.0

    try:
        pid, learned = learn(config, chunks, returns)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        with open(tmp_path / "kvstore.sock.lock") as lock:  # held until its last thread has exited
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the killed service's threads did not exit"
                    time.sleep(0.05)
        worker = StoreClient(load_config(config), 64 * 1024)  # a new service, its store made
        try:
            assert worker.info()["service_pid"] != pid
            assert "admission.learned_refused" not in worker.info()["counters"]
        finally:
            worker.close()
    finally:
        stop_service(config)
    assert returns() >= learned  # restored, then written back at the clean stop


def learn(config: dict, chunks: list[bytes], returns: Callable[[], float]) -> tuple[int, float]:
    """Chunks of short answers pushed out of DRAM and put again, until the service's file
    counts their returns: the service's pid, and the returns counted."""
    worker = StoreClient(load_config(config), 64 * 1024)
    try:
        pid = worker.info()["service_pid"]
        for start in range(0, len(chunks), 8):
            worker.finished([chunks[start:start + 8]], SHORT)
            assert worker.put(chunks[start:start + 8], list(range(8))) == [True] * 8
        assert worker.put(chunks[:8], list(range(8))) == [True] * 8  # they had left DRAM: back
        deadline = time.monotonic() + 30
        while returns() < 8:
            assert time.monotonic() < deadline, f"no file with the returns written: {returns()}"
            time.sleep(0.1)
        return pid, returns()
    finally:
        worker.close()
