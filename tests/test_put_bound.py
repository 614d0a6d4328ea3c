"""Puts under way are bounded (`put_inflight`, kvstore/store/put_bound.py): past the bound a
put's chunks are refused at once and counted, never queued behind the others' writes."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st
from support.stores import CHUNK_BYTES, disk_config, make_keys, make_payloads, read_back

from kvstore.io.faulty import Fault
from kvstore.store.put_bound import PutBound
from kvstore.tiers.stats import Stats


def test_a_put_past_the_bound_stores_its_leading_chunks_and_refuses_the_rest(disk_dir, store_factory):
    store = store_factory(disk_config(disk_dir, "8MiB", put_inflight=2 * CHUNK_BYTES))
    keys, payloads = make_keys(5), make_payloads(5)
    assert store.put_many(keys, payloads) == [True, True, False, False, False]
    assert store.stats.snapshot()["put.rejected"] == 3
    assert read_back(store, keys[:2])[0] == [True, True]
    assert store.put_many(keys[2:4], payloads[2:4], parent=keys[1]) == [True, True]  # bytes given back


def test_a_put_while_the_bound_is_taken_is_refused_at_once_not_queued(disk_dir, faulty, store_factory):
    """The first put goes straight to a disk whose writes hang (no DRAM tier); a second put
    from another thread, meanwhile, returns refused while the first is still under way."""
    store = store_factory(disk_config(disk_dir, "8MiB", faulty.inner.name, put_inflight=2 * CHUNK_BYTES),
                          engine=faulty)
    hang = faulty.add(Fault("hang", reads=False, writes=True))
    first_keys, second_keys = make_keys(2, seed=1), make_keys(1, seed=2)
    first = threading.Thread(target=store.put_many, args=(first_keys, make_payloads(2, seed=1)))
    first.start()
    try:
        while faulty.injected == 0:  # the first put's writes have reached the disk
            first.join(0.01)
        assert store.put_many(second_keys, make_payloads(1, seed=2)) == [False]
        assert first.is_alive(), "the refusal waited for the hung put"
        assert store.stats.snapshot()["put.rejected"] == 1
    finally:
        hang.remaining = 0
        faulty.release()
        first.join()


@given(st.integers(1, 8), st.lists(st.tuples(st.booleans(), st.integers(0, 10)), max_size=40))
def test_the_bound_never_grants_past_its_limit_and_gives_everything_back(limit_chunks, steps):
    """Puts opening (True, chunks asked) and closing (False) in any order: what is granted
    never passes the limit (one chunk at least when nothing else is under way), each refusal
    is counted, and once all close the whole limit is free again."""
    stats = Stats()
    bound = PutBound(limit_chunks * 4096, 4096, stats)
    open_puts: list = []
    refused = 0
    for opening, asked in steps:
        if opening:
            context = bound.take(asked)
            granted = context.__enter__()
            under_way = sum(g for _, g in open_puts)
            fits = under_way + granted <= limit_chunks or (under_way == 0 and granted <= 1)
            assert granted <= asked and fits
            refused += asked - granted
            open_puts.append((context, granted))
        elif open_puts:
            open_puts.pop(0)[0].__exit__(None, None, None)
    for context, _ in open_puts:
        context.__exit__(None, None, None)
    assert stats.snapshot().get("put.rejected", 0) == refused
    with bound.take(limit_chunks) as granted:
        assert granted == limit_chunks


