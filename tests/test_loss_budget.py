"""`learned` admission's threshold tuned to a loss budget (kvstore/tiers/loss_budget.py), moving
both ways on small made-up traces, and request ends the service infers from puts alone
(kvstore/tiers/chain_history.py's InferredEnds) for engines that report none."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.services import service_config, stop_service

from bench.sim.admission_path import ThresholdPath
from bench.sim.replay import Replayer
from bench.support.trace import read_trace
from kvstore.cli import main as cli_main
from kvstore.config.store import load_config
from kvstore.service.client import StoreClient
from kvstore.tiers.admission import Learned, Tuning
from kvstore.tiers.chain_history import SAME_REQUEST_S, InferredEnds
from kvstore.tiers.loss_budget import LOSS, LossBudget
from kvstore.tiers.policy import TierPolicy
from kvstore.tiers.return_rates import ANSWERS, GROUP0, GROUP_ENDS, TURNS, ReturnRates

BLOCK = 4  # tokens per block; with 1 byte per token a chunk is 4 bytes


def keys(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}{i}".encode().ljust(16, b".") for i in range(count)]


def phased_trace(path, quiet: int, returning: int = 0, seed: int = 0) -> str:
    """One conversation a second on a shared 2-block system prompt (a DRAM hit each time)
    and 4 blocks of its own, answered at length: the first `quiet` never come back; the
    `returning` after them, alike until then, come back once 60-120 s later (past DRAM)."""
    rng = random.Random(seed)
    rows = []
    for i in range(quiet + returning):
        own = [100 + 10 * i + j for j in range(4)]
        rows.append({"timestamp": i * 1000, "input_length": 6 * BLOCK + 1, "output_length": 600,
                     "hash_ids": [0, 1, *own]})
        if i >= quiet:
            rows.append({"timestamp": int((i + rng.uniform(60, 120)) * 1000), "input_length": 7 * BLOCK + 1,
                         "output_length": 600, "hash_ids": [0, 1, *own, 100 + 10 * i + 9]})
    rows.sort(key=lambda row: row["timestamp"])
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def threshold_path(trace: str) -> dict:
    """`learned` admission's threshold and measured loss over a replay of `trace` (DRAM of 20
    chunks, a disk that never fills, the default budget)."""
    policy = TierPolicy(admission="learned", chunk_tokens=BLOCK)
    replayer = Replayer([("dram", 20 * BLOCK), ("disk", 1 << 20)], 1, BLOCK, policy=policy)
    ThresholdPath(replayer)
    result = replayer.run(read_trace(trace, BLOCK))
    return {**result["threshold_path"], "refused": result["admission_refused"]}


def at(path: dict, start: float, end: float, series: str = "threshold") -> list[float]:
    return [v for t, v in zip(path["time_s"], path[series], strict=True) if start <= t < end]


def test_the_threshold_rises_from_zero_while_what_it_refuses_does_not_come_back(tmp_path):
    """From cold every chunk is written (as `all`) until departures have been watched; then,
    as the conversations' own chunks never come back and the system prompt's hits go on, the
    threshold rises: their chunks are refused, and no hit is lost for it."""
    path = threshold_path(phased_trace(tmp_path / "t.jsonl", quiet=600))
    assert set(at(path, 0, 60)) == {0.0}  # nothing watched long enough: nothing refused
    assert at(path, 500, 600)[-1] > 0.2 and path["refused"] > 1000
    assert set(path["loss_measured"]) == {0.0} and path["loss_budget"] == LOSS


def test_the_threshold_falls_when_refused_chunks_come_back(tmp_path):
    """The same conversations, then alike ones that come back after a minute or two: what the
    threshold refuses is asked for again, the measured loss goes over the budget and the
    threshold falls back toward 0, admitting them."""
    path = threshold_path(phased_trace(tmp_path / "t.jsonl", quiet=600, returning=600))
    peak = max(at(path, 0, 660))
    assert peak > 0.2
    assert max(at(path, 700, 1400, "loss_measured")) > LOSS
    assert max(at(path, 900, 1400)) < peak / 4


def test_a_refused_chunk_asked_for_again_costs_the_hits_after_it_too():
    """Of a chain named again, the first chunk that left DRAM without a disk copy is a hit
    lost, and so is every departed chunk after it (its prefix broke there); those before it,
    on disk, are not."""
    rates = ReturnRates(capacity=64)
    chain = keys("c", 5)
    for index, key in enumerate(chain):
        rates.left(key, now=0.0, written=index != 2)
    assert rates.named(chain, now=10.0) == (3, 1)  # chunks 2, 3, 4 lost; one refused among them
    assert rates.named(chain, now=20.0) == (0, 0)  # back already: no departure to count


@given(st.lists(st.tuples(st.sampled_from(["stored", "served", "left"]),
                          st.sampled_from([0.0, 0.5, 100.0, 1e4]), st.integers(0, 7), st.booleans()),
                min_size=50, max_size=300),
       st.floats(0, 1))
def test_the_threshold_stays_a_rate_whatever_comes(events, loss):
    """Any order of puts, hits and departures, written or refused, at any times (a clock that
    stands still or jumps hours): the threshold is a rate from 0 to 1, the loss measured a
    share."""
    clock = [0.0]
    admission = Learned(capacity=16)
    admission.clock = lambda: clock[0]
    admission.budget = LossBudget(loss)
    pool = keys("k", 8)
    for kind, step, index, flag in events:
        clock[0] += step
        if kind == "stored":
            admission.stored(pool[index:], pool[index - 1] if flag and index else None)
        elif kind == "served":
            admission.served(pool[: index + 1])
        else:
            admission.left(pool[index], written=flag)
        assert 0.0 <= admission.threshold <= 1.0 and 0.0 <= admission.budget.measured() <= 1.0


# -- request ends inferred from puts -------------------------------------------------------------


def test_a_put_continuing_an_earlier_ones_end_is_its_next_turn():
    """A put whose parent (or one of whose keys) another put ended on continues it: its next
    turn, idle since, if it came later than SAME_REQUEST_S; the same request saving on if
    sooner. A put continuing nothing is a new chain. The answer is never known."""
    ends = InferredEnds(capacity=4)
    first = keys("a", 3)
    end, chunks = ends.put(first, None, now=0.0)
    assert (end.answer_tokens, end.turn, end.idle_s, chunks) == (None, 0, None, 3)
    more = keys("a-more", 2)
    end, chunks = ends.put(more, first[-1], now=SAME_REQUEST_S / 2)  # the same request's next wave
    assert (end.turn, end.idle_s, chunks) == (0, None, 5)
    end, chunks = ends.put(keys("b", 2), more[-1], now=60.0)  # the next turn
    assert (end.turn, end.idle_s, chunks) == (1, 60.0 - SAME_REQUEST_S / 2, 7)
    end, chunks = ends.put([*first, *more, *keys("c", 1)], None, now=120.0)  # a whole chain again
    assert (end.turn, chunks) == (1, 6)
    for i in range(10):
        ends.put(keys(f"x{i}", 1), None, now=130.0)
    assert ends.put(keys("d", 1), first[-1], now=140.0)[0].turn == 0  # forgotten: bounded


def test_puts_alone_tell_a_conversation_that_goes_on_from_one_that_does_not():
    """No request end is reported (SGLang's and LMCache's backends report none): three of
    four conversations are one put never seen again; the fourth reads its chunks back a
    minute later and puts its next turn, and reads that back a minute after. What the
    service infers from the puts tells a next turn's chunks (they come back) from a first
    put's (mostly not), where a chunk with no label would be rated alike."""
    clock = [0.0]
    policy = TierPolicy(admission="learned", tuning=Tuning(threshold=0.5, loss=0.0))
    policy.clock = lambda: clock[0]
    for i in range(40):
        start = 1000.0 * i
        first, turn = keys(f"f{i}-", 4), keys(f"t{i}-", 2)
        clock[0] = start
        policy.seen(first)
        for key in first:
            policy.left_dram(key, on_disk=True)
        if i % 4:
            continue
        clock[0] = start + 60
        policy.seen(first, read=True)
        policy.seen(turn, parent=first[-1])
        for key in [*first, *turn]:
            policy.left_dram(key, on_disk=True)
        clock[0] = start + 120
        policy.seen([*first, *turn], read=True)
    clock[0] = 50_000.0
    first, turn = keys("new-f", 4), keys("new-t", 2)
    policy.seen(first)
    clock[0] += 60
    policy.seen(turn, parent=first[-1])
    assert policy.admits(turn[0]) and not policy.admits(first[0])


def test_the_service_labels_puts_it_has_no_request_end_for(tmp_path, disk_dir):
    """Through a real service, puts alone (chains under parents, as SGLang's backend saves):
    the chunks that leave DRAM and come back are counted in the buckets of an end inferred
    (the answer not known), none in the bucket of chunks no end labels."""
    # No DRAM cleaner: each put writes its victim, so chunks leave DRAM in LRU order however
    # far a cleaner would fall behind these back-to-back puts (a put beside one passes over
    # chunks not yet written, and they would stay).
    config = {**service_config(tmp_path, dram="1MiB", disk_dir=disk_dir, disk="16MiB", io={"timeout_s": 5.0}),
              "disk_admission": "learned", "dram_clean_ahead": 0}
    chains = [keys(f"chain{i}-", 8) for i in range(6)]  # DRAM holds 16: later chains push earlier out
    worker = StoreClient(load_config(config), 64 * 1024)
    try:
        for chain in chains:
            assert worker.put(chain[:4], list(range(4))) == [True] * 4
            assert worker.put(chain[4:], list(range(4)), parent=chain[3]) == [True] * 4
        assert worker.put(chains[0][:4], list(range(4))) == [True] * 4  # back
    finally:
        worker.close()
        stop_service(config)
    returns = json.loads((tmp_path / "kvstore.sock.learned").read_text())["returns"]
    unknown_answer = [GROUP0 + split * GROUP_ENDS + 1 + (ANSWERS - 1) * TURNS + turn
                      for split in range(8) for turn in range(TURNS)]
    assert sum(returns[group] for group in unknown_answer) >= 4
    assert sum(returns[GROUP0 + split * GROUP_ENDS] for split in range(8)) == 0  # no label


def test_a_budget_or_floor_out_of_range_is_refused_naming_it(tmp_path, capsys):
    for threshold, loss in ((0.0, -0.1), (1.5, 0.01), (0.0, float("nan"))):
        with pytest.raises(ValueError, match="loss budget"):
            Tuning(threshold, loss)
    trace = phased_trace(tmp_path / "t.jsonl", quiet=5)
    assert cli_main(["replay", trace, "--tier", "dram=80", "--tier", "disk=1MiB", "--kv-bytes-per-token", "1",
                     "--block-tokens", str(BLOCK), "--admission", "learned", "--admission-loss", "2"]) == 2
    assert "--admission-loss" in capsys.readouterr().err
