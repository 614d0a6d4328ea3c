"""Trace replay through kvstore's real slot tables, checked against hand-computed hits."""

from __future__ import annotations

import json

import pytest

from bench.replay import Replayer, parse_tier
from bench.trace import block_keys, read_trace
from kvstore.cli import main as cli_main
from kvstore.errors import ConfigError, KVStoreError

BLOCK = 4  # tokens per block; with 1 byte per token a chunk is 4 bytes


def write_trace(path, rows) -> str:
    with open(path, "w") as f:
        for i, (ids, length) in enumerate(rows):
            f.write(json.dumps({"timestamp": i * 1000, "input_length": length, "output_length": 1,
                                "hash_ids": ids}) + "\n")
    return str(path)


def test_two_tier_lru_matches_the_hand_computed_run(tmp_path):
    """host holds 3 chunks, disk 4. A = ids [1, 2], B = ids [3, 4], each prompt 9 tokens.

    R1 A: miss, host {A1 A2}.            R2 A: 2 host hits.
    R3 B: miss; storing B2 evicts the oldest leaf A2 to disk: host {A1 B1 B2}, disk {A2}.
    R4 A: A1 from host, A2 from disk; promoting A2 evicts leaf B2 to disk (A1 was touched).
    """
    trace = write_trace(tmp_path / "t.jsonl", [([1, 2], 9), ([1, 2], 9), ([3, 4], 9), ([1, 2], 9)])
    replayer = Replayer([("host", 12), ("disk", 16)], kv_bytes_per_token=1, block_tokens=BLOCK)
    requests = list(read_trace(trace, BLOCK))
    hits = [replayer.serve(r) for r in requests]
    assert hits == [[], [0, 0], [], [0, 1]]
    result = replayer.result()
    host, disk = result["tiers"]
    assert result["prompt_tokens"] == 36
    assert (host["hit_tokens"], disk["hit_tokens"]) == (12, 4)
    assert result["hit_ratio"] == pytest.approx(16 / 36)
    assert (host["evictions"], disk["evictions"]) == (2, 0)
    assert (host["bytes_written"], disk["bytes_written"]) == (5 * 4, 2 * 4)
    assert (host["bytes_read"], disk["bytes_read"]) == (3 * 4, 1 * 4)
    assert set(replayer.tiers[0].table.index) == set(block_keys([1, 2])) | {block_keys([3, 4])[0]}


def test_a_prompt_always_computes_its_last_token(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [([1, 2], 8), ([1, 2], 8)])
    replayer = Replayer([("host", 64)], kv_bytes_per_token=1, block_tokens=BLOCK)
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
    assert cli_main(["replay", trace, "--tier", "host=16", "--tier", "disk=64",
                     "--kv-bytes-per-token", "1", "--block-tokens", str(BLOCK),
                     "--sweep", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["hit_ratio"] == pytest.approx(16 / 27)
    assert [t["name"] for t in result["tiers"]] == ["host", "disk"]
    assert {"capacity_bytes", "hit_ratio", "bytes_read", "bytes_written", "evictions"} <= set(
        result["tiers"][0])
    assert len(result["sweep"]) > 3 and out.with_suffix(".png").stat().st_size > 1000
    assert "hit ratio" in capsys.readouterr().out


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
    assert cli_main(["replay", trace, "--tier", "gpu=1GiB", "--tier", "host=64GiB", "--ttft",
                     "--block-tokens", "512", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["ttft"]
    assert [r["config"] for r in rows] == ["no cache", "gpu", "gpu + host"]
    assert rows[1]["ttft_p50_s"] < rows[0]["ttft_p50_s"]  # repeats hit: less to compute
    assert cli_main(["replay", trace, "--tier", "tape=1TiB", "--ttft"]) == 2  # named on stderr
