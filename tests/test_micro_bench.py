"""Micro-benchmarks of the store's small hot operations: record pack and verify, a
512-key lookup, the slot table's reserve/publish/unpublish on its own and through
put and delete, a DRAM get.

Figures only: pytest-benchmark writes them to .benchmarks/micro.json in the plain
test run (see conftest.py); nothing here asserts a time, only that the timed call
did its job. Each benchmark gets about 0.2 s, so the set stays a few seconds in CI.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from bench.commands.storage_cases import dram_store
from kvstore.format.record import (
    HEADER_BLOCK,
    HeaderState,
    RecordHeader,
    TensorSpec,
    check_record,
    pack_header,
    parse_header,
    payload_checksum,
)
from kvstore.store.tiered import TieredStore
from kvstore.tiers.slots import SlotTable

pytestmark = pytest.mark.benchmark(max_time=0.2, min_rounds=5, warmup=False)


@pytest.fixture
def dram() -> Iterator[list[TieredStore]]:
    """Closes the DRAM stores a benchmark opened."""
    opened: list[TieredStore] = []
    yield opened
    for store in opened:
        store.close()


def _stored(opened: list[TieredStore], chunk_bytes: int, count: int) -> tuple[TieredStore, list[bytes]]:
    store, keys, payloads = dram_store(chunk_bytes, count)
    opened.append(store)
    assert all(store.put_many(keys, payloads))
    return store, keys


def _record(payload_bytes: int) -> tuple[RecordHeader, memoryview, memoryview]:
    payload = memoryview(np.random.default_rng(0).integers(0, 256, payload_bytes, np.uint8))
    header = RecordHeader(key=bytes(range(16)), namespace=bytes(16), parent=bytes(16), seq=7,
                          payload_len=payload_bytes, payload_checksum=payload_checksum(payload),
                          tensor=TensorSpec("bfloat16", (2, 16, 8, 128)))
    block = memoryview(bytearray(HEADER_BLOCK))
    pack_header(header, block)
    return header, block, payload


def test_pack_header(benchmark):
    header, block, _ = _record(4096)
    benchmark(pack_header, header, block)
    assert parse_header(block) == (HeaderState.VALID, header)


@pytest.mark.parametrize("payload_bytes", [256 << 10, 4 << 20], ids=["256KiB", "4MiB"])
def test_check_record(benchmark, payload_bytes):
    header, block, payload = _record(payload_bytes)
    assert benchmark(check_record, block, payload, header.key) == (header, None)


def test_lookup_of_512_keys(benchmark, dram):
    store, keys = _stored(dram, 4096, 512)
    assert benchmark(store.lookup, keys).count == 512


def test_slot_table_reserve_publish_evict(benchmark):
    """A full 1024-slot table: each reservation evicts the least recently used leaf of
    256 chains of four, and publishes a new chunk in its place."""
    table = SlotTable([1024])
    keys = [i.to_bytes(16, "little") for i in range(1 << 20)]
    for chain in range(256):
        for link in range(4):
            key = keys[chain * 4 + link]
            table.reserve().publish(key, keys[chain * 4 + link - 1] if link else None, 0)
    fresh = iter(keys[1024:])

    def churn() -> None:
        reservation = table.reserve()
        assert reservation is not None and reservation.evicted is not None
        reservation.publish(next(fresh), None, 0)

    benchmark(churn)
    assert len(table) == 1024


def test_put_and_delete_64_chunks(benchmark, dram):
    """Each round reserves and publishes 64 DRAM slots, then unpublishes and frees them."""
    store, keys, payloads = dram_store(4096, 64)
    dram.append(store)

    def put_and_delete() -> int:
        store.put_many(keys, payloads)
        return store.delete(keys)

    assert benchmark(put_and_delete) == 64
    assert store.lookup(keys).count == 0


@pytest.mark.parametrize("chunk_bytes", [256 << 10], ids=["256KiB"])
def test_dram_get_of_64_chunks(benchmark, dram, chunk_bytes):
    store, keys = _stored(dram, chunk_bytes, 64)
    outs = [np.empty(chunk_bytes, np.uint8) for _ in keys]
    assert all(benchmark(store.get_many, keys, outs))
