"""Write policies and disk admission: what reaches the disk, and when."""

from __future__ import annotations

import numpy as np
import pytest
from support import faults
from support.stores import CHUNK_BYTES, make_keys, make_payloads, read_back

from kvstore.format.errors import ConfigError
from kvstore.format.record import record_bytes

SLOT = record_bytes(CHUNK_BYTES)


def _config(disk_dir: str, dram_slots: int = 8, **extra) -> dict:
    return {"tiers": {"dram": {"capacity": dram_slots * SLOT},
                      "disk": [{"path": disk_dir, "capacity": 64 * SLOT}]},
            "io": {"queue_depth": 8, "timeout_s": 5}, **extra}


def test_write_back_reaches_disk_only_on_eviction(disk_dir, store_factory):
    store = store_factory(_config(disk_dir))
    keys, payloads = make_keys(4), make_payloads(4)
    assert all(store.put_many(keys, payloads))
    store.flush()
    assert not store.probe.keys("disk") and store.lookup(keys).tiers == ("dram",) * 4


def test_write_through_puts_every_chunk_on_disk_and_keeps_it_in_dram(disk_dir, store_factory):
    store = store_factory(_config(disk_dir, write_policy="write_through"))
    keys, payloads = make_keys(4), make_payloads(4)
    assert all(store.put_many(keys, payloads))
    assert store.flush()
    assert all(k in store.probe.keys("disk") for k in keys)
    assert store.lookup(keys).tiers == ("dram",) * 4  # still served from DRAM
    # A service killed now loses nothing: the disk alone serves every chunk.
    for key in keys:
        faults.lose_from_dram(store, key)
    ok, outs = read_back(store, keys)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))


def test_admission_keeps_one_off_chunks_off_the_disk(disk_dir, store_factory):
    config = _config(disk_dir, dram_slots=4, disk_admission="second-touch")
    store = store_factory(config)
    popular, popular_payloads = make_keys(2, seed=1), make_payloads(2, seed=1)
    store.put_many(popular, popular_payloads)
    read_back(store, popular)  # seen twice: stored once, read once
    one_off, one_off_payloads = make_keys(8, seed=2), make_payloads(8, seed=2)
    # Through the 4 DRAM slots: the one-off chunks, which the disk does not admit, are the
    # victims a put may take at once; the popular ones stay until the cleaner or close writes them.
    store.put_many(one_off, one_off_payloads)
    assert store.stats.snapshot()["disk.admission_refused"] >= 4
    store.close()  # what DRAM holds and the disk admits goes down
    reopened = store_factory(config)
    assert all(reopened.contains(k) for k in popular)
    assert not any(reopened.contains(k) for k in one_off)  # evicted or dropped, never written


def test_bad_write_policy_names_the_field(disk_dir):
    from kvstore.config.store import load_config

    with pytest.raises(ConfigError, match=r"write_policy.*write_back, write_through"):
        load_config(_config(disk_dir, write_policy="always"))
    with pytest.raises(ConfigError, match="disk_min_seen"):
        load_config(_config(disk_dir, disk_min_seen=0))


@pytest.mark.parametrize(("given", "admission"), [
    ({"disk_min_seen": 3}, "second-touch"),  # the meaning it had before `disk_admission`
    ({"disk_min_seen": 1}, "all"),
    ({"disk_min_seen": 3, "disk_admission": "tinylfu"}, "tinylfu"),
    ({}, "all"),
])
def test_disk_min_seen_alone_keeps_admission_on(disk_dir, given, admission):
    from kvstore.config.store import load_config

    config = load_config(_config(disk_dir, **given))
    assert config.disk_admission == admission
