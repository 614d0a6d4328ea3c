"""The transfer core's waves (connectors/transfer.py): every key once and in order, none
past half the window, a long load's last quarter a wave of its own; and through a real
service, loads of more pages than the window fill every byte, from DRAM and from disk,
and saves of more pages than the window are one chain."""

from __future__ import annotations

import os
import threading

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from support.cluster import wait_for
from support.records import disk_records
from support.services import counters, service_config, stop_service

from connectors.page_io import service_pages
from connectors.transfer import TAIL_SPLIT, wave_plan
from kvstore.config.store import load_config
from kvstore.format.errors import KVStoreError
from kvstore.format.record import record_bytes
from kvstore.service.client import StoreClient

CHUNK = 64 << 10


@given(st.integers(0, 3000), st.integers(1, 600))
def test_waves_take_every_key_once_in_order(count, half):
    waves = wave_plan(count, half)
    assert [i for wave in waves for i in wave] == list(range(count))
    assert all(0 < len(wave) <= half for wave in waves)
    if count == 0:
        return
    needed = -(-count // half)  # the fewest waves that fit in half the window
    size = -(-count // needed)  # each as long, shared out evenly (the last may be shorter)
    last = count - size * (needed - 1)
    assert [len(wave) for wave in waves[: needed - 1]] == [size] * (needed - 1) and 0 < last <= size
    assert size - last < needed  # even: no wave of a remainder beside whole ones
    if last >= TAIL_SPLIT:  # the last one split: its last quarter on its own
        assert [len(wave) for wave in waves[needed - 1 :]] == [last - last // 4, last // 4]
    else:
        assert len(waves) == needed


def _pages(memory: np.ndarray) -> list[list[tuple[int, int]]]:
    """Each chunk as two segments (the second half first in memory), as a pool's pages are
    pieces in an order of their own."""
    base, half = memory.ctypes.data, CHUNK // 2
    return [[(base + i * CHUNK + half, half), (base + i * CHUNK, half)] for i in range(len(memory) // CHUNK)]


def test_a_load_longer_than_the_window_fills_every_page_from_dram_and_from_disk(tmp_path, disk_dir):
    """Four waves through the mapped tier: four Pins (each giving back the waves copied
    before it) and one Unpin, every byte in place, no pin left held."""
    store = service_config(tmp_path, dram="8MiB", disk_dir=disk_dir, disk="16MiB", staging="2MiB")
    client = StoreClient(load_config(store), CHUNK)
    try:
        half = client.memory.slots // 2
    finally:
        client.close()
    count = 2 * half + max(TAIL_SPLIT, half)  # two whole waves, then one split in two
    assert len(wave_plan(count, half)) == 4
    keys = [i.to_bytes(16, "big") for i in range(1, count + 1)]
    written = np.random.default_rng(3).integers(0, 256, count * CHUNK, dtype=np.uint8)
    for from_disk in (False, True):
        reads, writes = service_pages(store, "config", CHUNK, b"t" * 16)
        try:
            if not from_disk:
                assert all(writes.save(keys, _pages(written)))
            for _ in range(2):  # a second load finds no pin of the first held (they pass the window)
                loaded = np.zeros_like(written)
                before = counters(store)
                assert reads.load(keys, _pages(loaded)) == [True] * count
                assert np.array_equal(loaded, written)
                after = counters(store)
                sent = {kind: after.get(f"requests.{kind}", 0) - before.get(f"requests.{kind}", 0)
                        for kind in ("pin", "unpin", "get")}
                assert sent == {"pin": 4, "unpin": 1, "get": 0}  # each wave's unpin rides on a later pin
            assert counters(store).get("disk.hits", 0) == (count if from_disk else 0)
        finally:
            reads.close()
            writes.close()
            stop_service(store)  # the next pass starts a new service: its DRAM tier is empty


def test_a_save_longer_than_the_window_is_one_chain_in_the_fetches_waves(tmp_path, disk_dir):
    """PageIO's save of more pages than the window (Transfers.store_waves): each wave
    gathered into one half while the other is put, the pages stored as one chain under the
    parent given (each record's parent the page before it, across waves), every byte
    loaded back; the write connection maps no DRAM tier."""
    store = service_config(tmp_path, dram="8MiB", disk_dir=disk_dir, disk="16MiB", staging="1MiB")
    count = 3 * 8 + 5  # waves of half a 16-slot window: several, the last split
    keys = [i.to_bytes(16, "big") for i in range(1, count + 1)]
    written = np.random.default_rng(4).integers(0, 256, count * CHUNK, dtype=np.uint8)
    reads, writes = service_pages(store, "config", CHUNK, b"t" * 16)
    try:
        client = writes.link.get()
        assert client is not None and client.memory.slots == 16 and client.memory.tier is None
        assert all(writes.save(keys, _pages(written), parent=b"p" * 16))
        loaded = np.zeros_like(written)
        assert reads.load(keys, _pages(loaded)) == [True] * count
        assert np.array_equal(loaded, written)
    finally:
        reads.close()
        writes.close()
        stop_service(store)  # DRAM's chunks go down to disk, each with its parent
    parents = {header.key: header.parent for header in disk_records(os.path.join(disk_dir, "disk"))}
    assert [parents[key] for key in keys] == [b"p" * 16, *keys[:-1]]


def test_a_fetch_that_fails_past_the_clients_errors_leaves_no_pin_held(tmp_path, monkeypatch):
    """A wave's pins go back with a later Pin: where that Pin fails with a fault other than
    the service's errors (whether its Unpin was sent or not), the load misses from there,
    no exception reaches the engine, and the connection is dropped with every pin it held,
    so a load after it pins the whole window again."""
    store = service_config(tmp_path, dram="8MiB")
    reads, writes = service_pages(store, "config", CHUNK, b"t" * 16)
    try:
        client = reads.link.get()
        assert client is not None
        count = 3 * (client.memory.slots // 2)  # three whole waves
        keys = [i.to_bytes(16, "big") for i in range(1, count + 1)]
        written = np.random.default_rng(5).integers(0, 256, count * CHUNK, dtype=np.uint8)
        assert all(writes.save(keys, _pages(written)))
        pin, pins = client.pin, []

        def faulty_pin(*args, **kwargs):
            pins.append(args)
            if len(pins) == 3:
                raise ValueError("a reply of the wrong shape")
            return pin(*args, **kwargs)

        monkeypatch.setattr(client, "pin", faulty_pin)
        half = client.memory.slots // 2
        assert reads.load(keys, _pages(np.zeros_like(written))) == [True] * 2 * half + [False] * half
        loaded = np.zeros_like(written)
        wait_for(lambda: reads.load(keys, _pages(loaded)) == [True] * count, 10, "a load on a new connection")
        assert np.array_equal(loaded, written)
    finally:
        reads.close()
        writes.close()
        stop_service(store)


def test_a_failed_fetch_drops_the_connection_only_after_the_copy_under_its_pins(tmp_path, monkeypatch):
    """The next wave's fetch fails while this wave is copied out of the tier: the
    connection, and the pins this copy reads under, stay until the copy ends, so another
    client's puts cannot reuse those slots mid-copy (dropped at once, they could: the copy
    would take another chunk's bytes for these keys)."""
    store = service_config(tmp_path, dram=24 * record_bytes(CHUNK))
    reads, writes = service_pages(store, "config", CHUNK, b"t" * 16)
    filler = StoreClient(load_config(store), CHUNK)
    try:
        client = reads.link.get()
        assert client is not None
        half = client.memory.slots // 2
        keys = [i.to_bytes(16, "big") for i in range(1, 2 * half + 1)]
        written = np.random.default_rng(6).integers(0, 256, 2 * half * CHUNK, dtype=np.uint8)
        assert all(writes.save(keys, _pages(written)))
        pin, failed = client.pin, threading.Event()

        def pin_then_fail(*args, **kwargs):
            if failed.is_set() or args[0][0] != keys[0]:
                failed.set()
                raise KVStoreError("the service's deadline passed")
            return pin(*args, **kwargs)

        copied: dict[int, bytes] = {}

        def copy(wave, fetched):
            if wave.start == 0:
                assert failed.wait(10)  # the next wave's fetch failed meanwhile
                for first in range(0, 24, 4):  # another client turns DRAM over
                    for i in range(4):
                        filler.memory.slot(i)[:] = bytes([200 + i]) * CHUNK
                    filler.put([bytes([250, first + i]) * 8 for i in range(4)], range(4))
            for j, i in enumerate(wave):
                source = fetched.source(client.memory, j)
                if source is not None:
                    copied[i] = bytes(source)

        monkeypatch.setattr(client, "pin", pin_then_fail)
        reads.transfers.fetch_waves(client, keys, copy)
        assert sorted(copied) == list(range(half))  # the first wave only: the rest missed
        for i, data in copied.items():  # a page is its chunk's second half, then its first
            page = written[i * CHUNK : (i + 1) * CHUNK].tobytes()
            assert data == page[CHUNK // 2 :] + page[: CHUNK // 2], i
        assert reads.link.peek() is None  # dropped, once the copy was over
    finally:
        filler.close()
        reads.close()
        writes.close()
        stop_service(store)
