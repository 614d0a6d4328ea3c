"""The next-turn predictor: gaps learned from continuations, fetches due before the return,
bounded by how often a family's chains come back, and what it does on a trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.tiers.next_turn import NextTurnPredictor


def chain(conversation: int, turn: int) -> list[bytes]:
    """Turn n of a conversation: its system prompt chunk, then one chunk per turn so far."""
    return [b"system".ljust(16, b".")] + [bytes([conversation, t]) * 8 for t in range(turn + 1)]


def test_a_learned_gap_brings_the_chain_back_lead_s_before_the_next_turn():
    predictor = NextTurnPredictor(lead_s=2.0)
    now = 0.0
    for conversation in range(4):  # conversations whose next turn comes 30 s after a reply
        predictor.arrived(chain(conversation, 0), now)
        predictor.finished(chain(conversation, 0), now + 1)
        predictor.due(now + 1)
        predictor.arrived(chain(conversation, 1), now + 31)
        now += 100
    assert predictor.predicted_gap(chain(9, 0)[0]) == pytest.approx(30.0)
    predictor.finished(chain(9, 0), now)
    assert predictor.due(now + 27) == []
    assert predictor.next_due() == pytest.approx(now + 28)
    assert predictor.due(now + 28) == [(tuple(chain(9, 0)), None)]
    assert predictor.due(now + 29) == []  # fetched once


def test_a_conversation_back_before_its_prediction_cancels_it():
    predictor = NextTurnPredictor(lead_s=1.0, default_gap_s=60.0)
    predictor.finished(chain(1, 0), 0.0)
    predictor.arrived(chain(1, 1), 5.0)
    assert predictor.due(100.0) == [] and predictor.next_due() is None


def test_families_that_rarely_come_back_are_not_read_ahead():
    predictor = NextTurnPredictor(min_return_rate=0.5)
    for i in range(10):  # one-shot requests of one family: never continued
        predictor.finished([b"docs".ljust(16, b"."), bytes([i]) * 16], float(i))
        predictor.due(float(i))
    predictor.finished([b"docs".ljust(16, b"."), b"z" * 16], 20.0)
    assert predictor.return_rate(b"docs".ljust(16, b".")) == 0.0
    assert predictor.due(1000.0) == []


def test_pending_predictions_are_bounded():
    predictor = NextTurnPredictor(max_pending=3, default_gap_s=10.0, lead_s=0.0, min_return_rate=0.0)
    for i in range(5):
        predictor.finished([bytes([i]) * 16], float(i))
    assert [keys[0][0] for keys, _ in predictor.due(100.0)] == [2, 3, 4]  # the oldest went first


def test_a_co_tenants_hints_hold_a_share_and_never_push_out_the_owners_predictions():
    """The service's predictor is every client's: a co-tenant (any uid but the trusted one)
    holds at most a quarter of the pending predictions, its own oldest going first; the
    owner's stay due."""
    predictor = NextTurnPredictor(max_pending=8, default_gap_s=10.0, lead_s=0.0, min_return_rate=0.0,
                                  trusted=0)
    for i in range(4):
        predictor.finished([bytes([i]) * 16], float(i), owner=0)
    for i in range(100):
        predictor.expect([bytes([100 + i]) * 16], 50.0, owner=1000)
    due = sorted((keys[0][0], owner) for keys, owner in predictor.due(100.0))
    assert due == [(0, 0), (1, 0), (2, 0), (3, 0), (198, 1000), (199, 1000)]  # each in its owner's turn


def test_a_co_tenants_chains_that_never_come_back_do_not_stop_predicting_the_owners_new_ones():
    """A new family is predicted by everyone's return rate; only the trusted owner's chains
    make it, so a co-tenant finishing chains that never return cannot pull it down."""
    predictor = NextTurnPredictor(trusted=0, min_return_rate=0.75, default_gap_s=10.0, lead_s=0.0)
    for i in range(50):
        predictor.finished([bytes([i]) * 16, b"t" * 16], float(i), owner=1000)
    predictor.finished([b"o" * 16, b"u" * 16], 60.0, owner=0)
    assert predictor.return_rate(b"n" * 16) == 1.0  # nothing of the owner's seen: as before anything
    assert (b"u" * 16, 0) in [(keys[-1], owner) for keys, owner in predictor.due(100.0)]  # predicted


def test_families_are_remembered_up_to_a_bound_the_least_recently_finished_forgotten():
    """Each chain start is a family: a client that finishes chains of new starts without end
    cannot grow the predictor; a forgotten family's return rate is everyone's again."""
    predictor = NextTurnPredictor(max_families=2, min_return_rate=0.0)
    steady, other = b"s" * 16, b"o" * 16
    for turn in range(4):  # a family that never comes back
        predictor.finished([steady, bytes([turn]) * 16], float(turn))
    assert predictor.return_rate(steady) == 0.0
    for turn in range(4):  # one that always does pulls everyone's up
        predictor.finished([other, bytes([50 + turn]) * 16], 10.0 + turn)
        predictor.arrived([bytes([50 + turn]) * 16, b"n" * 16], 11.0 + turn)
    predictor.finished([b"x" * 16, b"y" * 16], 20.0)  # a third family: `steady` is forgotten
    assert predictor.return_rate(steady) == 4 / 9  # everyone's: 4 of the 9 finished came back
    assert predictor.return_rate(other) == 1.0


TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


@pytest.mark.skipif(not TRACE.exists(), reason="the shared Mooncake trace is not beside the checkout")
def test_on_the_trace_reading_ahead_never_costs_a_hit_and_its_waste_is_counted():
    from bench.sim.next_turn_replay import NextTurnReads
    from bench.sim.replay import Replayer
    from bench.support.trace import read_trace

    results = {}
    for mode in ("off", "warm", "predict", "oracle"):
        replayer = Replayer([("dram", 40 << 30), ("disk", 1 << 40)], 131072, 512)
        reads = NextTurnReads(replayer, mode)
        if mode == "oracle":
            reads.foresee(read_trace(TRACE, 512, limit=1500))
        results[mode] = replayer.run(read_trace(TRACE, 512, limit=1500))
    # The oracle knows each chunk's next arrival: the bound the predictor is measured against.
    assert results["oracle"]["dram_resident_at_arrival"] > results["predict"]["dram_resident_at_arrival"]
    assert results["oracle"]["prefetch_wasted_fraction"] < results["predict"]["prefetch_wasted_fraction"]
    assert results["off"]["prefetch_read_bytes"] == 0
    assert results["predict"]["hit_ratio"] == results["off"]["hit_ratio"]  # read-ahead never loses a hit
    assert results["predict"]["prefetch_read_bytes"] > 0
    assert 0 <= results["predict"]["prefetch_wasted_bytes"] <= results["predict"]["prefetch_read_bytes"]
    assert 0 < results["off"]["dram_resident_at_arrival"] <= 1
