"""Trace replay through kvstore's real slot tables, checked against hand-computed hits."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from support import faults
from support.traces import BLOCK, write_trace

from bench.sim.replay import Replayer, parse_tier
from bench.support.trace import block_keys, read_trace
from kvstore.cli import main as cli_main
from kvstore.format.errors import ConfigError, KVStoreError
from kvstore.format.record import record_bytes
from kvstore.store.tiered import TieredStore
from kvstore.tiers.admission import Tuning
from kvstore.tiers.policy import TierPolicy
from kvstore.tiers.return_rates import RequestEnd


def test_two_tier_lru_matches_the_hand_computed_run(tmp_path):
    """dram holds 3 chunks, disk 4. A = ids [1, 2], B = ids [3, 4], each prompt 9 tokens.

    R1 A: miss, dram {A1 A2}.            R2 A: 2 dram hits.
    R3 B: miss; storing B2 writes the oldest leaf A2 down to disk and takes its slot:
          dram {A1 B1 B2}, disk {A2}.
    R4 A: A1 from dram, A2 from disk; promoting A2 writes leaf B2 down to disk (A1 was
          touched) and takes its slot.
    """
    trace = write_trace(tmp_path / "t.jsonl", [([1, 2], 9), ([1, 2], 9), ([3, 4], 9), ([1, 2], 9)])
    replayer = Replayer([("dram", 12), ("disk", 16)], kv_bytes_per_token=1, block_tokens=BLOCK)
    requests = list(read_trace(trace, BLOCK))
    hits = [replayer.serve(r) for r in requests]
    assert hits == [[], [0, 0], [], [0, 1]]
    result = replayer.result()
    dram, disk = result["tiers"]
    assert result["prompt_tokens"] == 36
    assert (dram["hit_tokens"], disk["hit_tokens"]) == (12, 4)
    assert result["hit_ratio"] == pytest.approx(16 / 36)
    assert (dram["evictions"], disk["evictions"]) == (2, 0)
    assert (dram["bytes_written"], disk["bytes_written"]) == (5 * 4, 2 * 4)
    assert (dram["bytes_read"], disk["bytes_read"]) == (3 * 4, 1 * 4)
    assert set(replayer.tiers[0].table.index) == set(block_keys([1, 2])) | {block_keys([3, 4])[0]}


def test_a_prompt_always_computes_its_last_token(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [([1, 2], 8), ([1, 2], 8)])
    replayer = Replayer([("dram", 64)], kv_bytes_per_token=1, block_tokens=BLOCK)
    result = replayer.run(read_trace(trace, BLOCK))
    assert result["tiers"][0]["hit_tokens"] == BLOCK  # 8 tokens = 2 blocks, but one token is computed


def test_partial_last_block_is_never_stored(tmp_path):
    (request,) = read_trace(write_trace(tmp_path / "t.jsonl", [([1, 2, 3], 10)]), BLOCK)
    assert request.keys == block_keys([1, 2])


def test_shared_prefix_ids_share_keys_and_diverge_after():
    a, b = block_keys([7, 8, 9]), block_keys([7, 8, 10])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert block_keys([8])[0] != a[1]  # a block's key depends on the blocks before it


def test_cli_writes_json_and_plot(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", [([1, 2], 9)] * 3)
    out = tmp_path / "r.json"
    assert cli_main(["replay", trace, "--tier", "dram=16", "--tier", "disk=64",
                     "--kv-bytes-per-token", "1", "--block-tokens", str(BLOCK),
                     "--sweep", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["hit_ratio"] == pytest.approx(16 / 27)
    assert [t["name"] for t in result["tiers"]] == ["dram", "disk"]
    assert {"capacity_bytes", "hit_ratio", "bytes_read", "bytes_written", "evictions"} <= set(
        result["tiers"][0])
    assert len(result["sweep"]) > 3 and out.with_suffix(".png").stat().st_size > 1000
    assert (result["admission"], result["eviction"]) == ("all", "lru")
    assert result["disk_bytes_written"] == result["tiers"][1]["bytes_written"]
    assert result["disk_bytes_read"] == result["tiers"][1]["bytes_read"]
    assert {"disk_bytes_written_per_byte_read", "disk_bytes_written_never_read", "admission_refused",
            "recompute_cost", "recompute_cost_no_cache"} <= set(result)
    printed = capsys.readouterr().out
    assert "hit ratio" in printed and "written per byte read" in printed and "never read" in printed
    assert cli_main(["replay", trace, "--tier", "dram=4", "--tier", "disk=64", "--kv-bytes-per-token", "1",
                     "--block-tokens", str(BLOCK), "--admission", "second-touch", "--eviction", "cost",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["admission"], result["eviction"]) == ("second-touch", "cost")
    assert result["admission_refused"] == 1
    # R1: its first chunk, seen once, is refused when its second takes the one DRAM slot; R2
    # recomputes the first (seen twice now: the second goes down for it), R3 promotes the
    # second (the first goes down): two writes where `all` makes them at R1 and R3.
    assert result["disk_bytes_written"] == 2 * BLOCK


def test_synthetic_shapes_are_repeatable_and_named():
    agent = list(read_trace("synthetic:agent", BLOCK, limit=50))
    assert agent == list(read_trace("synthetic:agent", BLOCK, limit=50)) and len(agent) == 50
    assert [r.arrival_s for r in agent] == sorted(r.arrival_s for r in agent)
    chat = list(read_trace("synthetic:multi-turn", BLOCK, limit=200))
    continued = sum(any(b.keys[: len(a.keys)] == a.keys for a in chat[:i]) for i, b in enumerate(chat))
    assert continued > 20  # next turns extend earlier prompts
    with pytest.raises(KVStoreError, match="shapes: multi-turn, agent"):
        list(read_trace("synthetic:batch"))


def test_host_is_read_as_the_dram_tier(tmp_path):
    """`--tier host=SIZE`, the DRAM tier's old name, still names the DRAM tier: a memory
    tier below the top (nothing refused, not counted as disk) that --ttft knows."""
    assert parse_tier("host=64GiB") == ("dram", 64 << 30)
    trace = write_trace(tmp_path / "t.jsonl", [([1, 2, 3, 4], 2049)] * 4)
    out = tmp_path / "r.json"
    assert cli_main(["replay", trace, "--tier", "gpu=1GiB", "--tier", "host=64GiB", "--ttft",
                     "--block-tokens", "512", "--json", str(out)]) == 0
    assert [r["config"] for r in json.loads(out.read_text())["ttft"]] == ["no cache", "gpu", "gpu + dram"]


def test_bad_tier_and_bad_trace_are_named(tmp_path):
    with pytest.raises(ConfigError, match="NAME=SIZE"):
        parse_tier("host")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(KVStoreError, match=r"bad\.jsonl:1: not a Mooncake trace line"):
        list(read_trace(bad))


def test_ttft_compares_each_added_tier(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [([1, 2, 3, 4], 2049)] * 4)
    out = tmp_path / "r.json"
    assert cli_main(["replay", trace, "--tier", "gpu=1GiB", "--tier", "dram=64GiB", "--ttft",
                     "--block-tokens", "512", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["ttft"]
    assert [r["config"] for r in rows] == ["no cache", "gpu", "gpu + dram"]
    assert rows[1]["ttft_p50_s"] < rows[0]["ttft_p50_s"]  # repeats hit: less to compute
    assert cli_main(["replay", trace, "--tier", "tape=1TiB", "--ttft"]) == 2  # named on stderr


@pytest.mark.parametrize("policy", [
    TierPolicy(chunk_tokens=BLOCK), TierPolicy(admission="second-touch", chunk_tokens=BLOCK),
    TierPolicy(admission="tinylfu", chunk_tokens=BLOCK),
    TierPolicy(admission="predicted", chunk_tokens=BLOCK), TierPolicy(eviction="cost", chunk_tokens=BLOCK),
    TierPolicy(promote_on_hit=False, chunk_tokens=BLOCK),
    TierPolicy(admission="learned", tuning=Tuning(threshold=0.6), chunk_tokens=BLOCK)],
    ids=["default", "second-touch", "tinylfu", "predicted", "cost", "no-promote", "learned"])
def test_the_replay_and_a_real_store_agree_chunk_for_chunk(tmp_path, disk_dir, policy):
    """The same small trace through the replay and through a TieredStore (DRAM 4 chunks,
    disk 10, no background threads; each request: lookup, prefetch, get, put): every
    request's hits come from the same tiers, and both end holding the same chunks in
    each tier."""
    rng = random.Random(3)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 5))] for _ in range(6)]
    rows = []
    for _ in range(200):
        ids = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(0, 3))]
        rows.append((ids, len(ids) * BLOCK + rng.randrange(0, BLOCK)))
    requests = list(read_trace(write_trace(tmp_path / "t.jsonl", rows), BLOCK))

    chunk = 4096
    slot = record_bytes(chunk)
    config = {"tiers": {"dram": {"capacity": 4 * slot},
                        "disk": [{"path": disk_dir, "capacity": 3 * 4096 + 10 * slot}]},
              "promote_on_hit": policy.promote_on_hit, "disk_admission": policy.admission,
              "disk_admission_threshold": policy.tuning.threshold, "disk_admission_loss": policy.tuning.loss,
              "eviction": policy.eviction, "chunk_tokens": BLOCK,
              "io": {"engine": "threads", "queue_depth": 16}}  # a batch holds a request
    replayer = Replayer([("dram", 4 * BLOCK), ("disk", 10 * BLOCK)], kv_bytes_per_token=1,
                        block_tokens=BLOCK, policy=policy)
    payload = np.zeros(chunk, np.uint8)
    with TieredStore(config, chunk, background=False) as store:
        assert store.probe.capacity("disk") == 10
        faults.policy_clock(store, replayer.policy.clock)  # the trace's time, for `learned` too
        tell = replayer.policy.finished  # requests that end tell the store what they tell the replay

        def finished(keys: list[bytes], end: RequestEnd) -> None:
            tell(keys, end)
            store.finished([keys], end)

        replayer.policy.finished = finished  # type: ignore[method-assign]
        for request in requests:
            replayed = replayer.serve(request)  # first: it hears of the requests that ended before
            keys = list(request.keys)
            usable = min(len(keys), (request.input_tokens - 1) // BLOCK)
            found = store.lookup(keys[:usable])
            if policy.promote_on_hit:  # what the connector's prefetch does on arrival
                store.prefetch(keys[: found.count])
            assert store.get_many(keys[: found.count], [np.empty(chunk, np.uint8)] * found.count) == \
                [True] * found.count
            store.put_many(keys, [payload] * len(keys))
            assert [("dram", "disk")[t] for t in replayed] == list(found.tiers)
        assert store.probe.keys("dram") == set(replayer.tiers[0].table.index)
        assert store.probe.keys("disk") == set(replayer.tiers[1].table.index)
        counters = store.stats.snapshot()
        assert counters.get("dram.evictions", 0) > 10  # the tiers were full
        result = replayer.result()
        assert result["disk_bytes_written"] == replayer.tiers[1].stats.bytes_written > 0
        assert counters["disk.bytes_written"] == record_bytes(chunk) * (
            result["disk_bytes_written"] // BLOCK)  # the same chunks went down
        if policy.admission == "all":
            assert result["admission_refused"] == counters.get("disk.admission_refused", 0) == 0
        else:
            assert result["admission_refused"] == counters["disk.admission_refused"] > 0


def test_admission_and_write_counts_are_the_disk_tiers_alone(tmp_path):
    """gpu over dram over disk, second-touch: a gpu victim always goes down to dram (only the
    disk refuses), and disk_bytes_* count the disk's traffic, not dram's. A, B, C, A, D, A
    with one slot per memory tier: A reaches the disk only once seen twice."""
    trace = write_trace(tmp_path / "t.jsonl", [([i], BLOCK + 1) for i in (1, 2, 3, 1, 4, 1, 5, 6, 1)])
    replayer = Replayer([("gpu", BLOCK), ("dram", BLOCK), ("disk", 8 * BLOCK)], kv_bytes_per_token=1,
                        block_tokens=BLOCK, policy=TierPolicy(admission="second-touch", chunk_tokens=BLOCK))
    result = replayer.run(read_trace(trace, BLOCK))
    dram, disk = replayer.tiers[1].stats, replayer.tiers[2].stats
    assert dram.bytes_written > disk.bytes_written > 0  # every gpu victim went to dram
    assert result["disk_bytes_written"] == disk.bytes_written
    assert result["disk_bytes_read"] == disk.bytes_read > 0
    assert result["disk_bytes_written_per_byte_read"] == disk.bytes_written / disk.bytes_read
    assert 0 <= result["disk_bytes_written_never_read"] < disk.bytes_written
