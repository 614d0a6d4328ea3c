"""`kvstore replay --hosts N`: a shared array against private islands, checked against
real clustered TieredStores (a real redis-server between them) chunk for chunk."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from support.traces import BLOCK, write_trace

import kvstore.cluster.node
from bench.sim.cluster_replay import Cluster, replay_cluster, route
from bench.support.trace import read_trace
from bench.support.trace_tile import main as trace_tile
from bench.support.trace_tile import tile
from kvstore.cli import main as cli_main
from kvstore.format.errors import ConfigError
from kvstore.format.record import record_bytes
from kvstore.store.tiered import TieredStore


def shared_prefix_trace(path, seed: int = 3, requests: int = 200) -> str:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 5))] for _ in range(6)]
    rows = []
    for _ in range(requests):
        ids = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(0, 3))]
        rows.append((ids, len(ids) * BLOCK + rng.randrange(0, BLOCK)))
    return write_trace(path, rows)


def test_the_cli_reports_both_ratios(tmp_path, capsys):
    trace = shared_prefix_trace(tmp_path / "t.jsonl")
    out = tmp_path / "r.json"
    assert cli_main(["replay", trace, "--tier", "dram=8", "--tier", "disk=48", "--hosts", "3",
                     "--routing", "random", "--kv-bytes-per-token", "1", "--block-tokens", str(BLOCK),
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["hosts"] == 3 and result["routing"] == "random"
    assert [t["name"] for t in result["tiers"]] == ["dram", "disk", "peer"]
    assert [t["name"] for t in result["private_tiers"]] == ["dram", "disk"]
    assert result["tiers"][1]["capacity_bytes"] == 48  # the array, in three parts of 16
    assert result["hit_ratio"] > result["private_hit_ratio"] > 0  # the others' parts add hits
    assert result["tiers"][2]["hit_tokens"] > 0
    assert sum(result["requests_per_host"]) == result["requests"] == 200
    assert "shared array" in capsys.readouterr().out


def test_one_host_is_its_own_island_and_prefix_routing_keeps_prefixes_home(tmp_path):
    trace = shared_prefix_trace(tmp_path / "t.jsonl")
    options = {"kv_bytes_per_token": 1, "block_tokens": BLOCK}
    alone = replay_cluster(trace, [("dram", 8), ("disk", 48)], 1, "random", **options)
    assert alone["hit_ratio"] == alone["private_hit_ratio"]
    prefix = replay_cluster(trace, [("dram", 8), ("disk", 48)], 3, "prefix", **options)
    assert prefix["tiers"][2]["hit_tokens"] == 0  # every request of a prefix on one host
    assert prefix["hit_ratio"] == prefix["private_hit_ratio"]
    routed = list(route(read_trace(trace, BLOCK), 3, "prefix", 0))
    homes: dict[bytes, int] = {}
    for host, request in routed:
        assert homes.setdefault(request.keys[0], host) == host


def test_bad_cluster_arguments_are_named(tmp_path):
    trace = shared_prefix_trace(tmp_path / "t.jsonl", requests=2)
    with pytest.raises(ConfigError, match="a tier per host and the array last"):
        replay_cluster(trace, [("disk", 48)], 2, "random", kv_bytes_per_token=1, block_tokens=BLOCK)
    assert cli_main(["replay", trace, "--tier", "dram=8", "--tier", "disk=48", "--hosts", "2",
                     "--sweep"]) == 2


def test_the_cluster_replay_and_real_clustered_stores_agree_chunk_for_chunk(tmp_path, disk_dir,
                                                                            redis_server,
                                                                            monkeypatch):
    """Two hosts (DRAM 4 chunks, their parts of the array 10 each), requests routed at
    random, through the replay and through two TieredStores sharing a redis-server (each
    request: lookup, prefetch, get, then a put past the stored run, as the connector
    saves): every request's hits come from the same tiers, and every
    host ends holding the same chunks in each tier."""
    monkeypatch.setattr(kvstore.cluster.node, "RECENT_S", 0.0)  # every lookup asks the index
    monkeypatch.setattr(kvstore.cluster.node, "RECENT_MISS_S", 0.0)
    requests = list(read_trace(shared_prefix_trace(tmp_path / "t.jsonl"), BLOCK))
    chunk = 4096
    slot = record_bytes(chunk)

    def config(me: int) -> dict:
        other = 1 - me
        return {"tiers": {"dram": {"capacity": 4 * slot},
                          "disk": [{"path": f"{disk_dir}/h{me}", "capacity": 3 * 4096 + 10 * slot}]},
                "io": {"engine": "threads", "queue_depth": 16},
                "cluster": {"host_id": f"h{me}", "index_url": redis_server.url, "index_deadline_s": 5,
                            "peers": [{"host_id": f"h{other}",
                                       "disk": [{"path": f"{disk_dir}/h{other}",
                                                 "capacity": 3 * 4096 + 10 * slot}]}]}}

    cluster = Cluster([("dram", 4 * BLOCK), ("disk", 20 * BLOCK)], 2, True, 1, BLOCK, True)
    stores = [TieredStore(config(0), chunk, background=False)]
    stores.append(TieredStore(config(1), chunk, background=False))
    stores[0].step()  # host 1's device exists now: host 0 opens it
    payload = np.zeros(chunk, np.uint8)
    try:
        peer_hits = 0
        for host, request in route(requests, 2, "random", 0):
            store = stores[host]
            keys = list(request.keys)
            usable = min(len(keys), (request.input_tokens - 1) // BLOCK)
            stored = store.lookup(keys).count
            found = store.lookup(keys[:usable])
            store.prefetch(keys[: found.count])
            assert store.get_many(keys[: found.count], [np.empty(chunk, np.uint8)] * found.count) == \
                [True] * found.count
            if stored < len(keys):  # what the connector saves: past the stored run
                store.put_many(keys[stored:], [payload] * (len(keys) - stored),
                               parent=keys[stored - 1] if stored else None)
            for each in stores:
                each.step()  # the index thread's work, now
            replayed = cluster.hosts[host].serve(request)
            assert [("dram", "disk", "peer")[t] for t in replayed] == list(found.tiers)
            peer_hits += found.tiers.count("peer")
        for store, replayer in zip(stores, cluster.hosts, strict=True):
            assert store.probe.keys("dram") == set(replayer.tiers[0].table.index)
            assert store.probe.keys("disk") == set(replayer.tiers[1].table.index)
        assert peer_hits > 20 and stores[0].stats.snapshot()["peer.hits"] > 0
    finally:
        for store in stores:
            store.close()


def test_a_tiled_trace_is_k_tenants_that_share_no_block(tmp_path, capsys):
    trace = shared_prefix_trace(tmp_path / "t.jsonl", requests=50)
    rows = [json.loads(line) for line in Path(trace).read_text().splitlines()]
    assert trace_tile([trace, str(tmp_path / "x.jsonl"), "--copies", "3"]) == 0
    tiled = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert len(tiled) == 3 * len(rows)
    assert [r["timestamp"] for r in tiled] == sorted(r["timestamp"] for r in tiled)
    blocks = {i for r in rows for i in r["hash_ids"]}
    assert len({i for r in tiled for i in r["hash_ids"]}) == 3 * len(blocks)
    assert sorted(r["input_length"] for r in tiled) == sorted(3 * [r["input_length"] for r in rows])
    assert "150 requests" in capsys.readouterr().out
    with pytest.raises(ValueError, match="at least 1"):
        tile(trace, 0)
    (tmp_path / "shuffled.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [rows[1], rows[0]]))
    with pytest.raises(ValueError, match=r"request 2 arrives at .* before request 1.*arrival order"):
        tile(tmp_path / "shuffled.jsonl", 2)
