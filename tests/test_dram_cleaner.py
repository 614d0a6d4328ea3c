"""The DRAM cleaner: DRAM's coldest chunks written down ahead, so a put's victim is clean
and a put never writes another chunk to disk on its caller's thread."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from support.cluster import wait_for
from support.stores import CHUNK_BYTES, direct_io_dir, disk_config, make_keys, make_payloads, read_back

from kvstore.config.store import load_config
from kvstore.datapath.cleaner import MOST_CHUNKS, clean_depth
from kvstore.devices.health import IN_SERVICE
from kvstore.format.record import record_bytes
from kvstore.io.faulty import Fault
from kvstore.store.tiered import TieredStore

SLOT = record_bytes(CHUNK_BYTES)
DRAM_SLOTS = 16  # the cleaner keeps a quarter clean: the 4 coldest


def _counted(store, name: str) -> int:
    return store.stats.snapshot().get(name, 0)


def _fill(store, keys, payloads) -> None:
    for key, payload in zip(keys, payloads, strict=True):  # one chain each: LRU in this order
        assert store.put_many([key], [payload]) == [True]


def test_puts_take_the_slots_the_cleaner_wrote_down_while_the_disk_takes_no_write(
        disk_dir, faulty, store_factory):
    store = store_factory(disk_config(disk_dir, 64 * SLOT, dram=DRAM_SLOTS * SLOT), engine=faulty)
    keys, payloads = make_keys(DRAM_SLOTS + 4), make_payloads(DRAM_SLOTS + 4)
    _fill(store, keys[:DRAM_SLOTS], payloads[:DRAM_SLOTS])
    wait_for(lambda: _counted(store, "dram.cleaned") >= 4, 10, "the 4 coldest chunks written down")
    faulty.add(Fault("hang", reads=False, writes=True))  # from now on no write returns
    try:
        # Each put evicts one of the chunks cleaned ahead: none waits on the stuck disk.
        assert store.put_many(keys[DRAM_SLOTS:], payloads[DRAM_SLOTS:]) == [True] * 4
        assert _counted(store, "dram.demoted") == 0
        assert store.probe.keys("dram") == set(keys[4:])  # the 4 least recently used went, as without
        ok, outs = read_back(store, keys[:4])  # the evicted ones, from their disk copies
        assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads[:4], strict=True))
    finally:
        faulty.clear()
        faulty.release()


def test_the_window_is_bounded_in_chunks_whatever_their_size():
    """Each pass walks the window under the DRAM lock: small chunks under the 1 GiB default
    (4,096 of 256 KiB) would make every pass hold it for a millisecond."""
    dram = {"tiers": {"dram": {"capacity": "64GiB"}}}
    assert clean_depth(load_config(dram), 32 << 20, 2048) == 32  # put_inflight / chunk
    assert clean_depth(load_config(dram), 256 << 10, 1 << 18) == MOST_CHUNKS
    assert clean_depth(load_config({**dram, "dram_clean_ahead": "8GiB"}), 256 << 10, 1 << 18) == MOST_CHUNKS
    assert clean_depth(load_config({**dram, "dram_clean_ahead": "8GiB"}), 32 << 20, 2048) == 256
    assert clean_depth(load_config(dram), 32 << 20, 16) == 4  # a quarter of a small tier


def test_where_the_cleaner_is_behind_a_put_writes_no_other_chunk_down(disk_dir, faulty, store_factory):
    """The cleaner's write held: no victim left is on disk. A put then writes no other
    chunk down on its caller's thread (no DEMOTE): its own chunks go straight to disk, and
    DRAM keeps what it holds until the cleaner has written it."""
    config = disk_config(disk_dir, 64 * SLOT, dram=DRAM_SLOTS * SLOT)
    config["io"]["timeout_s"] = 60  # the held write outlives no deadline on a busy machine
    store = store_factory(config, engine=faulty)
    sent = threading.Event()
    held = faulty.add(Fault("late", reads=False, writes=True, match=lambda _request: sent.set() or True))
    keys, payloads = make_keys(DRAM_SLOTS + 4), make_payloads(DRAM_SLOTS + 4)
    _fill(store, keys[:DRAM_SLOTS], payloads[:DRAM_SLOTS])
    assert sent.wait(10)  # the cleaner's first write is held: it has fallen behind
    faulty.clear()  # other writes go through
    assert store.put_many(keys[DRAM_SLOTS:], payloads[DRAM_SLOTS:]) == [True] * 4
    assert _counted(store, "dram.demoted") == 0 and _counted(store, "put.straight_to_disk") == 4
    assert store.probe.keys("dram") == set(keys[:DRAM_SLOTS])
    assert set(keys[DRAM_SLOTS:]) <= store.probe.keys("disk")
    held.land()
    ok, outs = read_back(store, keys)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))


def test_a_put_passes_over_unwritten_chunks_only_near_the_cold_end(disk_dir, faulty, store_factory):
    """The cleaner behind (its next write held), the only chunks on disk are hot ones (read
    again since it wrote them): a put looks for a takeable slot only among the next 2 x the
    window to go, so it goes to disk rather than evict a hot chunk (and the walk under the
    DRAM lock stays short)."""
    config = disk_config(disk_dir, 64 * SLOT, dram=DRAM_SLOTS * SLOT)
    config["io"]["timeout_s"] = 60  # the held write outlives no deadline on a busy machine
    store = store_factory(config, engine=faulty)
    keys, payloads = make_keys(DRAM_SLOTS + 1), make_payloads(DRAM_SLOTS + 1)
    _fill(store, keys[:DRAM_SLOTS], payloads[:DRAM_SLOTS])
    wait_for(lambda: _counted(store, "dram.cleaned") >= 4, 10, "the 4 coldest chunks written down")
    held = faulty.add(Fault("late", reads=False, writes=True,  # the cleaner's next write, whenever
                            match=lambda _request: threading.current_thread().name == "kvstore-dram-cleaner"))
    assert all(read_back(store, keys[:4])[0])  # now the hottest: the window's 4 are not written
    assert store.put_many(keys[-1:], payloads[-1:]) == [True]
    assert _counted(store, "put.straight_to_disk") == 1 and _counted(store, "dram.demoted") == 0
    assert set(keys[:4]) <= store.probe.keys("dram")  # the hot ones, on disk too, stayed
    faulty.clear()
    held.land()


def test_with_no_disk_device_in_service_dram_goes_on_taking_new_chunks(disk_dir, faulty, store_factory):
    """A dead disk: nowhere to write a victim, so it is dropped (as with no disk tier), not
    kept for a write that cannot happen, which froze DRAM with what it held when the disk
    died and failed every put after."""
    store = store_factory(disk_config(disk_dir, 64 * SLOT, dram=DRAM_SLOTS * SLOT), engine=faulty)
    faulty.add(Fault("error", reads=True, writes=True))
    keys, payloads = make_keys(3 * DRAM_SLOTS), make_payloads(3 * DRAM_SLOTS)
    for key, payload in zip(keys[:DRAM_SLOTS + 4], payloads[:DRAM_SLOTS + 4], strict=True):
        store.put_many([key], [payload])  # the cleaner's and these puts' writes fail
    wait_for(lambda: _counted(store, "disk.trips") >= 1, 10, "the device out of service")
    # A cleaner pass under way at the trip pins its chunks until its writes have failed: a
    # put meanwhile would pass over them and evict a chunk put just before instead.
    wait_for(lambda: store.probe.pinned() == 0, 10, "the cleaner's last pass over")
    fresh, fresh_payloads = keys[-DRAM_SLOTS:], payloads[-DRAM_SLOTS:]
    stored = [store.put_many([k], [p])[0] for k, p in zip(fresh, fresh_payloads, strict=True)]
    assert stored == [True] * DRAM_SLOTS
    assert store.probe.keys("dram") == set(fresh)
    ok, outs = read_back(store, fresh)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, fresh_payloads, strict=True))
    dropped = _counted(store, "dram.dropped_no_device")
    assert dropped >= DRAM_SLOTS
    assert store.delete(fresh[:2]) == 2
    assert _counted(store, "dram.dropped_no_device") == dropped  # a delete is no drop
    faulty.clear()


def test_a_device_back_in_service_gets_what_dram_took_meanwhile_written_down(disk_dir, faulty, store_factory):
    """Puts while the disk was out dropped their victims unwritten, so DRAM comes back
    holding only chunks not on disk, and nothing else wakes the cleaner: no pass of it
    failed (reads tripped the device), and a put that finds no takeable slot goes to disk
    and publishes nothing in DRAM. Such a put wakes it."""
    config = disk_config(disk_dir, 64 * SLOT, dram=DRAM_SLOTS * SLOT)
    config["io"].update(timeout_s=60, breaker_cooldown_s=0.5)
    store = store_factory(config, engine=faulty)
    keys, payloads = make_keys(2 * DRAM_SLOTS + 4), make_payloads(2 * DRAM_SLOTS + 4)
    _fill(store, keys[:DRAM_SLOTS], payloads[:DRAM_SLOTS])
    wait_for(lambda: _counted(store, "dram.cleaned") >= 4, 10, "the 4 coldest chunks written down")
    _fill(store, keys[DRAM_SLOTS:DRAM_SLOTS + 4], payloads[DRAM_SLOTS:DRAM_SLOTS + 4])  # the 4 written go
    assert not set(keys[:4]) & store.probe.keys("dram")
    # The next 4 written before the trip: a write in flight at it would fail, and the failed
    # pass's retry (after 0.5 s) could then wake the cleaner once the device is back.
    wait_for(lambda: _counted(store, "dram.cleaned") >= 8, 10, "the next 4 coldest written down")
    faulty.add(Fault("error", reads=True, writes=False))
    for key in keys[:4]:
        assert read_back(store, [key])[0] == [False]  # a fault each: the breaker trips
    wait_for(lambda: store.probe.devices()[0].state != IN_SERVICE, 10, "the device out of service")
    _fill(store, keys[DRAM_SLOTS + 4:], payloads[DRAM_SLOTS + 4:])  # DRAM: these, none on disk
    faulty.clear()
    wait_for(lambda: store.probe.devices()[0].state == IN_SERVICE, 20, "the device back in service")
    cleaned, more = _counted(store, "dram.cleaned"), make_keys(1, seed=7)
    assert store.put_many(more, make_payloads(1, seed=7)) == [True]
    assert _counted(store, "put.straight_to_disk") >= 1
    wait_for(lambda: _counted(store, "dram.cleaned") >= cleaned + 4, 10, "DRAM's coldest written down")


def test_a_failed_cleaner_pass_is_tried_again_with_no_publish_to_wake_it(disk_dir, faulty, store_factory):
    """Writes fail for a while, then work (a fault short of tripping the device): the
    cleaner tries again after its pause, whether or not anything is put meanwhile."""
    config = disk_config(disk_dir, 64 * SLOT, dram=DRAM_SLOTS * SLOT)
    config["io"].update(timeout_s=0.5, breaker_threshold=1 << 20)  # its pause: one deadline
    store = store_factory(config, engine=faulty)
    faulty.add(Fault("error", reads=False, writes=True))
    keys, payloads = make_keys(DRAM_SLOTS), make_payloads(DRAM_SLOTS)
    _fill(store, keys, payloads)
    failed = faulty.injected
    wait_for(lambda: faulty.injected > failed, 10, "the cleaner trying again")
    faulty.clear()
    wait_for(lambda: _counted(store, "dram.cleaned") >= 4, 10, "the cleaner's next pass")
    assert _counted(store, "disk.trips") == 0


def test_with_no_cleaner_a_put_writes_its_victim_down_itself(disk_dir, store_factory):
    store = store_factory(disk_config(disk_dir, 64 * SLOT, dram=DRAM_SLOTS * SLOT, dram_clean_ahead=0))
    keys, payloads = make_keys(DRAM_SLOTS + 2), make_payloads(DRAM_SLOTS + 2)
    _fill(store, keys, payloads)  # the 2 last puts find every victim dirty
    assert _counted(store, "dram.demoted") == 2 and _counted(store, "dram.cleaned") == 0
    assert store.probe.keys("disk") == set(keys[:2])  # the least recently used, as before
    assert all(read_back(store, keys)[0])


def test_the_cleaner_writes_only_what_the_disk_admits(disk_dir, store_factory):
    store = store_factory(disk_config(disk_dir, 64 * SLOT, dram=DRAM_SLOTS * SLOT,
                                      disk_admission="second-touch"))
    keys, payloads = make_keys(DRAM_SLOTS), make_payloads(DRAM_SLOTS)
    store.put_many([keys[0], keys[2]], [payloads[0], payloads[2]])
    store.delete([keys[0], keys[2]])  # seen once already: the next put is their second
    assert _counted(store, "disk.admission_refused") == 0  # deleted, not evicted: nothing refused
    _fill(store, keys, payloads)  # DRAM full; of the 4 coldest, keys 0 and 2 are admitted
    wait_for(lambda: _counted(store, "dram.cleaned") >= 2, 10, "the two admitted chunks written")
    on_disk = store.probe.keys("disk")
    assert {keys[0], keys[2]} <= on_disk
    assert not on_disk & set(keys[1:2] + keys[3:])


def test_a_chunk_deleted_while_the_cleaner_writes_it_does_not_come_back(disk_dir, faulty, store_factory):
    config = disk_config(disk_dir, 64 * SLOT, dram=DRAM_SLOTS * SLOT)
    config["io"]["timeout_s"] = 60  # the held write outlives no deadline on a busy machine
    store = store_factory(config, engine=faulty)
    sent = threading.Event()
    held = faulty.add(Fault("late", reads=False, writes=True, match=lambda _request: sent.set() or True))
    keys, payloads = make_keys(DRAM_SLOTS), make_payloads(DRAM_SLOTS)
    _fill(store, keys, payloads)  # the cleaner starts writing the 4 coldest; they land when told
    assert sent.wait(10)
    removed: list[int] = []
    deleting = threading.Thread(target=lambda: removed.append(store.delete(keys[:1])))  # a purge
    deleting.start()
    wait_for(lambda: keys[0] not in store.probe.keys("dram"), 10, "the chunk out of DRAM")
    assert deleting.is_alive()  # the delete waits for the copy being written
    held.land()
    deleting.join(10)
    assert removed == [1]
    wait_for(lambda: _counted(store, "dram.cleaned") >= 3, 10, "the other three written down")
    assert keys[0] not in store.probe.keys("disk") and not store.contains(keys[0])
    assert _counted(store, "disk.deleted_while_written") == 1
    faulty.clear()
    store.close()
    reopened = store_factory(config)
    assert not reopened.contains(keys[0]) and all(reopened.contains(k) for k in keys[1:])


def test_a_victim_deleted_while_a_put_writes_it_down_does_not_come_back(disk_dir, faulty, store_factory):
    """With no cleaner a put writes its victim down itself (DEMOTE); a purge of that victim
    meanwhile wins: the put's chunk goes elsewhere, and the victim is nowhere."""
    config = disk_config(disk_dir, 64 * SLOT, dram=DRAM_SLOTS * SLOT, dram_clean_ahead=0)
    config["io"]["timeout_s"] = 60  # the held write outlives no deadline on a busy machine
    store = store_factory(config, engine=faulty)
    keys, payloads = make_keys(DRAM_SLOTS + 1), make_payloads(DRAM_SLOTS + 1)
    _fill(store, keys[:DRAM_SLOTS], payloads[:DRAM_SLOTS])  # free slots: nothing written yet
    sent = threading.Event()
    held = faulty.add(Fault("late", reads=False, writes=True, match=lambda _request: sent.set() or True))
    stored: list[list[bool]] = []
    putting = threading.Thread(target=lambda: stored.append(store.put_many(keys[-1:], payloads[-1:])))
    putting.start()
    assert sent.wait(10)  # the put is writing its victim, the least recently used chunk, down
    removed: list[int] = []
    deleting = threading.Thread(target=lambda: removed.append(store.delete(keys[:1])))
    deleting.start()
    wait_for(lambda: keys[0] not in store.probe.keys("dram"), 10, "the victim out of DRAM")
    assert deleting.is_alive() and putting.is_alive()  # the delete waits for the copy being written
    held.land()
    deleting.join(10)
    putting.join(10)
    assert removed == [1] and stored == [[True]]
    assert not store.contains(keys[0]) and keys[0] not in store.probe.keys("disk")
    assert _counted(store, "disk.deleted_while_written") == 1 and _counted(store, "dram.demoted") == 0
    ok, outs = read_back(store, keys[-1:])
    assert ok == [True] and np.array_equal(outs[0], payloads[-1])
    faulty.clear()
    store.close()
    reopened = store_factory(config)
    assert not reopened.contains(keys[0]) and reopened.contains(keys[-1])


def test_a_disk_that_fails_every_write_costs_the_cleaner_a_pass_per_deadline_not_a_spin(
        disk_dir, faulty, store_factory):
    store = store_factory(disk_config(disk_dir, 64 * SLOT, dram=DRAM_SLOTS * SLOT), engine=faulty)
    faulty.add(Fault("error", reads=False, writes=True))
    keys, payloads = make_keys(DRAM_SLOTS), make_payloads(DRAM_SLOTS)
    _fill(store, keys, payloads)
    wait_for(lambda: faulty.injected > 0, 10, "the cleaner's first write")
    time.sleep(1.0)  # a spinning cleaner would try thousands of writes meanwhile
    tries = faulty.injected + _counted(store, "disk.write_dropped")  # dropped: the device tripped out
    assert tries <= 2 * DRAM_SLOTS  # one pass (the next after the 5 s deadline)
    assert _counted(store, "dram.cleaned") == 0 and store.probe.keys("dram") == set(keys)
    faulty.clear()


class CleanedStore(RuleBasedStateMachine):
    """Puts, gets, deletes and restarts of a store whose cleaner runs beside them, in any
    order: every chunk stored and not deleted since reads back as it was stored, and a
    deleted one never comes back, before or after a restart."""

    KEYS, PAYLOADS = make_keys(40), make_payloads(40)

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="kvstore-cleaner-")
        self.config = disk_config(direct_io_dir(Path(self.directory)), 64 * SLOT, dram=8 * SLOT)
        self.store = TieredStore(self.config, CHUNK_BYTES)
        self.stored: set[int] = set()
        self.deleted: set[int] = set()

    @rule(first=st.integers(0, 39), count=st.integers(1, 4))
    def put(self, first: int, count: int) -> None:
        chosen = range(first, min(first + count, 40))
        done = self.store.put_many([self.KEYS[i] for i in chosen], [self.PAYLOADS[i] for i in chosen])
        assert done == [True] * len(chosen)  # DRAM or disk: never full here
        self.stored |= set(chosen)
        self.deleted -= set(chosen)

    @rule(chosen=st.lists(st.integers(0, 39), min_size=1, max_size=4, unique=True))
    def get(self, chosen: list[int]) -> None:
        ok, outs = read_back(self.store, [self.KEYS[i] for i in chosen])
        for i, found, out in zip(chosen, ok, outs, strict=True):
            if i in self.stored:
                assert found and np.array_equal(out, self.PAYLOADS[i]), f"chunk {i} lost or wrong"
            elif i in self.deleted:
                assert not found, f"deleted chunk {i} came back"

    @rule(chosen=st.lists(st.integers(0, 39), min_size=1, max_size=4, unique=True))
    def delete(self, chosen: list[int]) -> None:
        self.store.delete([self.KEYS[i] for i in chosen])
        self.stored -= set(chosen)
        self.deleted |= set(chosen)

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = TieredStore(self.config, CHUNK_BYTES)

    @invariant()
    def deleted_chunks_are_nowhere(self) -> None:
        assert not any(self.store.contains(self.KEYS[i]) for i in self.deleted)

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)


TestCleanedStore = CleanedStore.TestCase
TestCleanedStore.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
