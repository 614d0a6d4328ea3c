"""Disk admission policies: their decisions on small hand-made traces, and a switch at runtime."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import CHUNK_BYTES, make_keys, make_payloads, read_back

from bench.replay import Replayer
from bench.trace import block_keys, read_trace
from kvstore.format.record import record_bytes
from kvstore.tiers.admission import Predicted, SecondTouch, TinyLFU, make_admission
from kvstore.tiers.policy import TierPolicy

BLOCK = 4  # tokens per block; with 1 byte per token a chunk is 4 bytes


def _trace(tmp_path, ids: list[list[int]]):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": len(row) * BLOCK + 1,
                                        "output_length": 1, "hash_ids": row}) + "\n"
                            for i, row in enumerate(ids)))
    return list(read_trace(path, BLOCK))


def _replay(tmp_path, admission: str, ids: list[list[int]]) -> tuple[list[list[int]], Replayer]:
    """DRAM of one chunk over a disk of eight."""
    replayer = Replayer([("host", BLOCK), ("disk", 8 * BLOCK)], kv_bytes_per_token=1, block_tokens=BLOCK,
                        policy=TierPolicy(admission=admission, chunk_tokens=BLOCK))
    return [replayer.serve(request) for request in _trace(tmp_path, ids)], replayer


def test_second_touch_refuses_a_chunk_seen_once_and_admits_it_on_its_ghost_hit(tmp_path):
    """A, B, A, C, A. `all`: B pushes A to disk, the second A is a disk hit. `second-touch`:
    A (seen once) is refused and dropped; the second A is a miss that the ghost list
    remembers (seen twice), so when C pushes it out it goes to disk: the third A hits."""
    ids = [[1], [2], [1], [3], [1]]
    everything, _ = _replay(tmp_path, "all", ids)
    assert everything == [[], [], [1], [], [1]]
    hits, replayer = _replay(tmp_path, "second-touch", ids)
    assert hits == [[], [], [], [], [1]]
    a, b = block_keys([1])[0], block_keys([2])[0]
    assert a in replayer.tiers[1] and b not in replayer.tiers[1]
    result = replayer.result()
    assert result["admission_refused"] == 3  # A, B, then the second A's victim B again
    assert result["disk_bytes_written"] == BLOCK  # A, once
    assert result["disk_bytes_read"] == BLOCK and result["write_amplification"] == 1.0


def test_the_ghost_list_is_bounded_and_forgets_the_least_recently_seen():
    ghost = SecondTouch(capacity=2)
    ghost.see([b"a"], b"a")
    ghost.see([b"b", b"c"], b"b")  # a is forgotten
    ghost.see([b"a", b"c"], b"a")
    assert not ghost.admit(b"a") and ghost.admit(b"c") and not ghost.admit(b"b")


def test_tinylfu_admits_what_it_counted_twice_and_forgets_it_as_counts_age():
    sketch = TinyLFU(capacity=1024)
    sketch.see([b"once"], b"once")
    sketch.see([b"twice"], b"twice")
    sketch.see([b"twice"], b"twice")
    assert not sketch.admit(b"once") and sketch.admit(b"twice")
    for _ in range(10 * sketch.width):  # one period of sightings: every counter is halved
        sketch.see([b"other"], b"other")
    assert sketch.estimate(b"twice") == 1 and not sketch.admit(b"twice")


def test_predicted_admits_a_new_chunk_of_a_family_that_comes_back():
    policy = Predicted()
    for i in range(8):  # family f: every chain is asked for again
        policy.see([b"f", b"f%d" % i], b"f")
        policy.see([b"f", b"f%d" % i], b"f")
    for i in range(8):  # family g: nothing but its head comes back
        policy.see([b"g", b"g%d" % i], b"g")
    policy.see([b"f-new"], b"f")
    policy.see([b"g-new"], b"g")
    # f: 9 of its 10 chunks came back (not the new one, yet); g: 1 of 10
    assert policy.return_rate(b"f") == pytest.approx(0.9) and policy.return_rate(b"g") == pytest.approx(0.1)
    assert policy.admit(b"f-new") and not policy.admit(b"g-new")


def test_an_unknown_policy_is_named():
    with pytest.raises(ValueError, match="second-touch"):
        make_admission("sometimes")
    with pytest.raises(ValueError, match="lru, cost"):
        TierPolicy(eviction="fifo")


def test_write_through_is_never_refused():
    policy = TierPolicy(admission="second-touch", write_through=True)
    assert policy.admits(b"never seen")


def test_a_switched_policy_keeps_what_the_disk_holds(disk_dir, store_factory):
    """Chunks on disk under `all` + LRU stay readable after switching to second-touch + cost;
    a new one-off chunk is then refused."""
    slot = record_bytes(CHUNK_BYTES)
    store = store_factory({"tiers": {"host": {"capacity": 2 * slot},
                                     "disk": [{"path": disk_dir, "capacity": 32 * slot}]},
                           "io": {"queue_depth": 8, "timeout_s": 5}})
    keys, payloads = make_keys(6, seed=1), make_payloads(6, seed=1)
    for key, payload in zip(keys, payloads, strict=True):
        store.put_many([key], [payload])  # one at a time: each pushes the last out of DRAM
    on_disk = set(store.parts.disk.table.index)
    assert len(on_disk) >= 4
    store.parts.switch_policy(admission="second-touch", eviction="cost")
    assert set(store.parts.disk.table.index) == on_disk and set(store.parts.disk.table.eviction) == on_disk
    ok, outs = read_back(store, keys)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))
    fresh, fresh_payloads = make_keys(4, seed=2), make_payloads(4, seed=2)
    for key, payload in zip(fresh, fresh_payloads, strict=True):
        store.put_many([key], [payload])
    assert not any(key in store.parts.disk.table for key in fresh)
    assert store.stats.snapshot()["disk.admission_refused"] >= 2
    assert on_disk <= set(store.parts.disk.table.index)
