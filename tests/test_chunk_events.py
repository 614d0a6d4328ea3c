"""Chunk events for KV-aware routers: the service's log of chunks entering and leaving
each tier, read through the protocol, and joined with the engine's block hashes."""

from __future__ import annotations

from support.services import service_config, stop_service
from support.stores import make_keys, make_payloads

from engine_plugin.vllm.core.kv_events import ChunkCatalog
from kvstore.config.store import load_config
from kvstore.format.record import record_bytes
from kvstore.service.chunk_events import ChunkEvents
from kvstore.service.client import StoreClient
from kvstore.tiers.slots import Change, SlotTable

CHUNK = 64 * 1024


def test_the_service_reports_each_tier_a_chunk_enters_and_leaves(tmp_path, disk_dir):
    config = service_config(tmp_path, dram=2 * record_bytes(CHUNK), disk_dir=disk_dir, disk="4MiB",
                            socket="kv.sock")
    try:
        client = StoreClient(load_config(config), CHUNK)
        cursor, lost, events = client.events(-1)
        assert (lost, events) == (0, [])
        keys, payloads = make_keys(3), make_payloads(3, chunk_bytes=CHUNK)
        for i, payload in enumerate(payloads):
            client.memory.slot(i)[:] = payload
        assert client.put(keys[:2], [0, 1]) == [True] * 2
        assert client.put(keys[2:], [2], parent=keys[1]) == [True]  # DRAM holds 2: one moves down
        cursor, lost, events = client.events(cursor)
        assert lost == 0
        stored = [(key, medium) for ok, key, medium in events if ok]
        removed = [(key, medium) for ok, key, medium in events if not ok]
        assert {medium for _, medium in stored} == {"kvstore-dram", "kvstore-disk"}
        assert len([1 for _, m in stored if m == "kvstore-dram"]) == 3
        (moved, _), = [(k, m) for k, m in stored if m == "kvstore-disk"]
        assert removed == [(moved, "kvstore-dram")]  # demoted: on disk first, then out of DRAM
        assert client.events(cursor) == (cursor, 0, [])
        assert client.events(cursor + 10**6)[0] == cursor  # a cursor from an earlier service
        client.close()
    finally:
        stop_service(config)


def test_a_reader_that_falls_behind_is_told_how_much_it_lost():
    events, table = ChunkEvents(capacity=2), SlotTable([8])
    table.subscribe(lambda change, entry: events.record(change is Change.STORED, entry.key, "dram"))
    for i in range(5):
        with table.reserve() as reservation:
            reservation.publish(bytes([i]) * 16, None, i)
    cursor, lost, kept = events.since(0)
    assert (cursor, lost) == (5, 3)
    assert [key[0] for _, key, _ in kept] == [3, 4]


def test_the_catalog_names_chunks_by_the_engines_block_hashes():
    catalog = ChunkCatalog(chunk_tokens=4, block_size=2, capacity=2)
    hashes = [f"h{i}".encode() for i in range(5)]  # the last chunk's blocks are not all hashed
    keys = [b"a" * 16, b"b" * 16, b"c" * 16]
    catalog.remember(keys, list(range(12)), hashes)
    first, second = catalog.translate([(True, keys[0], "kvstore-dram"), (False, keys[1], "kvstore-disk"),
                                       (True, keys[2], "kvstore-dram"), (True, b"z" * 16, "kvstore-dram")])
    assert (first.stored, first.medium, first.blocks.block_hashes) == (True, "kvstore-dram", (b"h0", b"h1"))
    assert first.blocks.parent_hash is None and list(first.blocks.token_ids) == [0, 1, 2, 3]
    assert (second.stored, second.blocks.block_hashes, second.blocks.parent_hash) == \
        (False, (b"h2", b"h3"), b"h1")
    assert catalog.unknown == 2  # the unhashed chunk and one never seen
    catalog.remember([b"d" * 16], [0] * 4, [b"x", b"y"])  # capacity 2: the oldest goes
    assert catalog.translate([(True, keys[0], "kvstore-dram")]) == []


def test_a_hybrid_models_chunks_reach_routers_with_their_kv_cache_group():
    """vLLM's BlockStored / BlockRemoved carry the group (index, spec kind, window)."""
    import pytest

    pytest.importorskip("vllm")
    from engine_plugin.vllm.core.groups import KVGroup
    from engine_plugin.vllm.kv_events import RouterEvents

    window = KVGroup(0, "sliding_window", "0:sliding", 256)
    router = RouterEvents.__new__(RouterEvents)  # no service: only the translation is under test
    router.catalog, router.block_size = ChunkCatalog(chunk_tokens=4, block_size=2), 2
    router.catalog.remember([b"a" * 16], list(range(4)), [b"h1", b"h2"], group=window)
    router.catalog.remember([b"b" * 16], list(range(4)), [b"h1", b"h2"])
    stored, removed, plain = router._vllm_events([(True, b"a" * 16, "kvstore-dram"),
                                                  (False, b"a" * 16, "kvstore-dram"),
                                                  (True, b"b" * 16, "kvstore-disk")])
    assert (stored.group_idx, stored.kv_cache_spec_kind, stored.kv_cache_spec_sliding_window) == \
        (0, "sliding_window", 256)
    assert removed.group_idx == 0
    assert (plain.group_idx, plain.kv_cache_spec_kind) == (None, None)
