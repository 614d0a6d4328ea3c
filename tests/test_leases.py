"""One-copy loads: the shared DRAM tier, pins held across requests, and their release on every path."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from engine_harness import stop_service

from connectors.plan import Transfer
from connectors.worker_side import WorkerCore
from engine_plugin.layout import PagedKVLayout
from kvstore.config.store import load_config
from kvstore.format.errors import KVStoreError
from kvstore.format.record import record_bytes
from kvstore.service.client import StoreClient
from kvstore.store import leases
from kvstore.store.tiered import TieredStore
from kvstore.tiers.dram import DramTier

CHUNK = 64 * 1024
SLOTS = 8  # DRAM slots of the service below; its windows hold 16 chunks


def _keys(first: int, count: int) -> list[bytes]:
    return [bytes([i]) * 16 for i in range(first, first + count)]


@pytest.fixture
def config(tmp_path):
    raw = {"tiers": {"host": {"capacity": SLOTS * record_bytes(CHUNK)}},
           "service": {"socket": str(tmp_path / "kvstore.sock"), "staging": "1MiB"}}
    yield raw
    stop_service(raw)


def _put(client: StoreClient, keys: list[bytes]) -> list[bool]:
    for slot, key in enumerate(keys):
        client.slot(slot)[:] = key[:1] * CHUNK
    return client.put(keys, range(len(keys)))


def test_a_client_reads_pinned_chunks_from_the_tier_and_cannot_write_it(config):
    client = StoreClient(load_config(config), CHUNK)
    try:
        assert client.tier is not None and client.tier.view.readonly
        keys = _keys(1, 3)
        assert _put(client, keys) == [True] * 3
        lease, offsets = client.pin([*keys, b"\xee" * 16])
        assert offsets[3] == -1
        assert [bytes(client.tier_payload(o)) for o in offsets[:3]] == [k[:1] * CHUNK for k in keys]
        with pytest.raises(TypeError):
            client.tier.view[offsets[0]] = 0
        client.unpin([lease])
        with pytest.raises(KVStoreError, match="more than its window"):
            client.pin(_keys(1, 3) * 6)
    finally:
        client.close()


def test_the_shared_tier_refuses_writable_maps():
    tier = DramTier(4 * record_bytes(CHUNK), record_bytes(CHUNK), shared=True)
    shared = tier.share()
    assert shared is not None
    fd, nbytes, _ = shared
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError):
            os.write(fd, b"x")
        mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ).close()
    finally:
        os.close(fd)
        tier.close()


def test_a_pinned_slot_is_never_evicted_or_reused_until_released():
    with TieredStore({"tiers": {"host": {"capacity": 4 * record_bytes(CHUNK)}}}, CHUNK) as store:
        first = _keys(1, 4)
        assert store.put_many(first, [k[:1] * CHUNK for k in first]) == [True] * 4
        lease = leases.pin_resident(store, first[:2])
        assert store.dram is not None
        pinned = [store.dram.slab.view[o : o + CHUNK] for o in lease.offsets]
        for wave in (_keys(10, 4), _keys(20, 4)):  # every unpinned slot is taken, twice over
            store.put_many(wave, [k[:1] * CHUNK for k in wave])
        assert store.lookup(first[:2]).tiers == ("host", "host")
        assert [bytes(view) for view in pinned] == [k[:1] * CHUNK for k in first[:2]]
        leases.release(store, lease)
        leases.release(store, lease)  # a second release does nothing
        wave = _keys(30, 4)
        assert store.put_many(wave, [k[:1] * CHUNK for k in wave]) == [True] * 4
        assert store.lookup(first[:1]).count == 0


_PINNER = """
import json, sys, time
from kvstore.config.store import load_config
from kvstore.service.client import StoreClient
client = StoreClient(load_config(json.loads(sys.argv[1])), int(sys.argv[2]))
lease, offsets = client.pin([bytes([i]) * 16 for i in range(1, 9)])
print(sum(o >= 0 for o in offsets), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("leaves", ["killed", "closed"])
def test_the_service_releases_the_pins_of_a_client_that_leaves_holding_them(config, leaves):
    client = StoreClient(load_config(config), CHUNK)
    try:
        assert _put(client, _keys(1, SLOTS)) == [True] * SLOTS
        if leaves == "killed":
            child = subprocess.Popen([sys.executable, "-c", _PINNER, json.dumps(config), str(CHUNK)],
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
            assert child.stdout is not None and child.stdout.readline().strip() == str(SLOTS)
        else:
            holder = StoreClient(load_config(config), CHUNK)
            assert holder.pin(_keys(1, SLOTS))[1].count(-1) == 0
        assert _put(client, _keys(20, 1)) == [False]  # every DRAM slot is pinned, and no disk
        if leaves == "killed":
            child.send_signal(signal.SIGKILL)
            child.wait()
        else:
            holder.close()
        for _ in range(100):  # the service notices the closed connection on its own thread
            if _put(client, _keys(20, 1)) == [True]:
                break
        assert client.residency(_keys(20, 1)) == (1, 1, False)
    finally:
        client.close()


@pytest.mark.parametrize("share", ["own-user", "off"])
def test_a_load_copies_from_the_tier_or_through_the_window_into_descending_blocks(config, share):
    config = {**config, "service": {**config["service"], "share_dram": share}}
    caches = {"layer": torch.zeros(16, 2, 16, 64, dtype=torch.float16)}  # 4 KiB per block
    layout = PagedKVLayout(caches, 16, 16)
    payload = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
    writer = StoreClient(load_config(config), CHUNK)
    try:
        assert (writer.tier is None) == (share == "off")
        writer.slot(0)[:] = payload.tobytes()
        assert writer.put([b"k" * 16], [0]) == [True]
    finally:
        writer.close()
    worker = WorkerCore(layout, 0, lambda: StoreClient(load_config(config), CHUNK), load_async=False)
    try:
        worker.start_loads([Transfer("r", ((b"k" * 16, b"m" * 16),), (None,),
                                     (tuple(range(15, -1, -1)), tuple(range(16))))], load_async=False)
        assert worker.take_failed_blocks() == set(range(16))  # the second chunk is a miss
    finally:
        worker.close()
    loaded = caches["layer"].view(torch.uint8).numpy().reshape(16, -1)
    assert np.array_equal(loaded[::-1].reshape(-1), payload)
