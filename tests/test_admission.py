"""Disk admission policies: their decisions on small hand-made traces, and a switch at runtime."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np
import pytest
from support import faults
from support.services import service_config, wait_for_log, write_config
from support.stores import CHUNK_BYTES, make_keys, make_payloads, read_back

from bench.sim.replay import Replayer
from bench.support.trace import block_keys, read_trace
from kvstore.config.runtime import write_private_json
from kvstore.config.store import load_config
from kvstore.format.record import record_bytes
from kvstore.service.client import StoreClient
from kvstore.tiers.admission import Predicted, SecondTouch, TinyLFU, make_admission
from kvstore.tiers.policy import TierPolicy
from kvstore.tiers.return_rates import RequestEnd, ReturnRates

BLOCK = 4  # tokens per block; with 1 byte per token a chunk is 4 bytes


def _trace(tmp_path, ids: list[list[int]]):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": len(row) * BLOCK + 1,
                                        "output_length": 1, "hash_ids": row}) + "\n"
                            for i, row in enumerate(ids)))
    return list(read_trace(path, BLOCK))


def _replay(tmp_path, admission: str, ids: list[list[int]]) -> tuple[list[list[int]], Replayer]:
    """DRAM of one chunk over a disk of eight."""
    replayer = Replayer([("dram", BLOCK), ("disk", 8 * BLOCK)], kv_bytes_per_token=1, block_tokens=BLOCK,
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
    assert result["disk_bytes_read"] == BLOCK and result["disk_bytes_written_per_byte_read"] == 1.0
    assert result["disk_bytes_written_never_read"] == 0  # A was read


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


def test_predicted_everyones_rate_ages_so_recent_families_weigh_most():
    """A family too small for its own rate gets everyone's: halved as it grows, it follows a
    change of traffic (chunks that came back, then chunks that never do) instead of the
    whole history, and its counts stay bounded."""
    policy = Predicted(capacity=16)
    for i in range(200):  # every chunk comes back
        policy.see([b"a%d" % i], b"a%d" % i)
        policy.see([b"a%d" % i], b"a%d" % i)
    assert policy.return_rate(b"new") == 1.0
    for i in range(400):  # now nothing does
        policy.see([b"b%d" % i], b"b%d" % i)
    assert policy.return_rate(b"new") < 0.2
    assert max(policy._total) < 10 * 16


def test_every_named_policy_is_made_alike():
    assert {make_admission(name, 3).name for name in ("all", "second-touch", "tinylfu", "predicted")} == {
        "all", "second-touch", "tinylfu", "predicted"}
    assert make_admission("all").admit(b"never seen")


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
    store = store_factory({"tiers": {"dram": {"capacity": 2 * slot},
                                     "disk": [{"path": disk_dir, "capacity": 32 * slot}]},
                           "io": {"queue_depth": 8, "timeout_s": 5}})
    keys, payloads = make_keys(6, seed=1), make_payloads(6, seed=1)
    for key, payload in zip(keys, payloads, strict=True):
        store.put_many([key], [payload])  # one at a time: each pushes the last out of DRAM
    on_disk = store.probe.keys("disk")
    assert len(on_disk) >= 4
    store.admin.reload_policy({"disk_admission": "second-touch", "eviction": "cost"})
    assert store.probe.keys("disk") == on_disk and faults.eviction_keys(store) == on_disk
    ok, outs = read_back(store, keys)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))
    fresh, fresh_payloads = make_keys(4, seed=2), make_payloads(4, seed=2)
    for key, payload in zip(fresh, fresh_payloads, strict=True):
        store.put_many([key], [payload])
    assert not any(key in store.probe.keys("disk") for key in fresh)
    assert store.stats.snapshot()["disk.admission_refused"] >= 2
    assert on_disk <= store.probe.keys("disk")


def test_a_reload_of_the_loss_budget_and_floor_alone_keeps_the_policy(store_factory):
    store = store_factory({"tiers": {"dram": {"capacity": 4 * record_bytes(CHUNK_BYTES)}},
                           "disk_admission": "learned"})
    store.admin.reload_policy({"disk_admission_loss": 0.05, "disk_admission_threshold": 0.2})
    admission = store.info()["admission"]
    assert admission["policy"] == "learned"
    assert admission["loss_budget"] == 0.05 and admission["threshold_floor"] == 0.2
    store.admin.reload_policy({"disk_write_budget": None})  # nothing of admission named: unchanged
    assert store.info()["admission"]["loss_budget"] == 0.05


def _write_config(path, disk_dir, **changes) -> dict:
    slot = record_bytes(CHUNK_BYTES)
    raw = {**service_config(path.parent, dram=2 * slot, disk_dir=disk_dir, disk=32 * slot,
                            io={"timeout_s": 5, "queue_depth": 8}, socket="run/kv.sock", spawn=False),
           **changes}
    write_config(path, raw)
    return raw


def _put_one_at_a_time(client: StoreClient, keys, payloads) -> None:
    for key, payload in zip(keys, payloads, strict=True):  # each pushes the last out of DRAM
        client.memory.slot(0)[:] = payload.tobytes()
        assert client.put([key], [0]) == [True]


def test_sighup_reload_switches_the_policy_and_keeps_what_the_disk_holds(tmp_path, disk_dir):
    """A real `kvstore serve`: 6 chunks under `all` + LRU (4 go to disk), then the config file
    says second-touch + cost (and a restart-only key) and the service gets SIGHUP: the policy
    changes at once (new one-off chunks are refused: a counter), every chunk that was on disk
    reads back verified; then learned admission, its threshold and a write budget take effect
    the same way (shown by `info`), and a file the running service could not take changes
    nothing."""
    path = tmp_path / "kv.yaml"
    raw = _write_config(path, disk_dir)
    config = load_config(str(path))
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        service = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--config", str(path)],
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_log(log, "listening")
        keys, payloads = make_keys(10, seed=3), make_payloads(10, seed=3)
        client = StoreClient(config, CHUNK_BYTES)
        _put_one_at_a_time(client, keys[:6], payloads[:6])
        info = client.info()
        assert [t["chunks"] for t in info["tiers"]] == [2, 4]  # keys[:4] on disk
        assert info["counters"]["disk.admission_refused"] == 0
        seen = len(log.read_text())
        _write_config(path, disk_dir, disk_admission="second-touch", eviction="cost",
                      service={**raw["service"], "max_clients": 7})
        service.send_signal(signal.SIGHUP)
        reloaded = wait_for_log(log, "reload: disk_admission second-touch, eviction cost", seen)
        assert "reload: service changed: applied only by a restart" in reloaded
        client.close()
        client = StoreClient(load_config(str(path)), CHUNK_BYTES)  # the new file's config is taken
        assert client.info()["tiers"][1]["chunks"] == 4
        for key, payload in zip(keys[:4], payloads[:4], strict=True):  # what was on disk
            assert client.get([key], [1]) == [True]
            assert bytes(client.memory.slot(1)) == payload.tobytes()
        before = client.info()["counters"]["disk.admission_refused"]
        _put_one_at_a_time(client, keys[6:], payloads[6:])
        assert client.info()["counters"]["disk.admission_refused"] >= before + 2  # seen once: refused
        seen = len(log.read_text())
        learning = {"disk_admission": "learned", "disk_admission_threshold": 0.5, "disk_write_budget": "1GiB"}
        learned = _learned_state()  # what an earlier service under `learned` left: the switch starts from it
        write_private_json(str(tmp_path / "run" / "kv.sock.learned"), learned)
        _write_config(path, disk_dir, eviction="cost", **learning)
        service.send_signal(signal.SIGHUP)
        wait_for_log(log, "reload: disk_admission learned, disk_admission_threshold 0.5, disk_write_budget "
                       f"{1 << 30}", seen)
        client.close()
        client = StoreClient(load_config(str(path)), CHUNK_BYTES)
        client.finished([keys[:2]], RequestEnd(answer_tokens=12, turn=1, idle_s=30.0))  # how it ended
        admission = client.info()["admission"]
        assert admission["policy"] == "learned" and admission["threshold"] == 0.5  # its floor: none measured
        assert admission["budget_bytes_per_day"] == 1 << 30
        assert 0 < admission["budget_left_bytes"] <= (1 << 30) / 24  # at most an hour's worth held
        seen = len(log.read_text())
        _write_config(path, disk_dir, disk_admission="tinylfu", write_policy="write_through")
        service.send_signal(signal.SIGHUP)
        assert "disk_admission" in wait_for_log(log, "reload: the config is unchanged", seen)
        client.close()
        running = {**raw, "eviction": "cost", **learning}
        client = StoreClient(load_config(running), CHUNK_BYTES)  # the bad file was not taken
        client.shutdown(timeout_s=60)
        assert service.wait(timeout=30) == 0
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()
    assert "Traceback" not in log.read_text()
    kept = json.loads((tmp_path / "run" / "kv.sock.learned").read_text())
    chains = learned.pop("chains")
    assert kept.pop("chains") == [chains[0] + 1, chains[1] + 2]  # restored, and the request told of
    assert kept == learned


def _learned_state() -> dict:
    """A `learned` state with returns counted: chunks of a short answer left DRAM and came back."""
    rates = ReturnRates(1 << 12)
    back = make_keys(2, seed=9)
    rates.finished(back, RequestEnd(answer_tokens=20))
    for key in back:
        rates.left(key, now=0.0)
    rates.named(back, now=5.0)
    return rates.state()
