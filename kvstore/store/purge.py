"""Purge: remove the records of some namespaces from every tier of this host.

Each record's header carries the digest of the namespace its key was made in (an engine's
model, weights, generation, rank, KV cache group and salt: kvstore/format/keys.py). Purge
reads the header of every published record, DRAM ones in place (their slots pinned, the
key checked) and disk ones with one 4 KiB read per slot, SCAN_BATCH at a time, and deletes
the records whose namespace was asked for (TieredStore.delete: the DRAM slot freed, the
disk header zeroed, so a restart does not bring them back). A dry run counts and removes
nothing. Invariants: a record another namespace names is never touched; a record published
while the scan runs is not seen (what an engine still stores under that namespace stays);
a disk header that cannot be read is left and counted (`unread`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.devices.scanner import SCAN_BATCH
from kvstore.format.record import HEADER_BLOCK, HeaderState, parse_header
from kvstore.io.aligned import AlignedBuffer
from kvstore.store.parts import StoreParts
from kvstore.tiers.slots import SlotTable

if TYPE_CHECKING:
    from kvstore.store.tiered import TieredStore


def purge(store: TieredStore, namespaces: set[bytes], dry_run: bool) -> dict[str, int]:
    """{"chunks", "bytes", "host_chunks", "disk_chunks", "unread", "removed"}: the records
    found in each tier (bytes: their payloads, every tier's copy counted) and, unless
    `dry_run`, how many were removed."""
    parts = store.parts
    in_dram = _dram_matches(parts, namespaces) if parts.dram is not None else []
    unread = [0]
    on_disk = _disk_matches(parts, namespaces, unread) if parts.disk is not None else []
    keys = list(dict.fromkeys(in_dram + on_disk))
    report = {"chunks": len(keys), "bytes": (len(in_dram) + len(on_disk)) * store.chunk_bytes,
              "host_chunks": len(in_dram), "disk_chunks": len(on_disk), "unread": unread[0],
              "removed": 0}
    if not dry_run and keys:
        report["removed"] = store.delete(keys)
        parts.stats.add("purge.records", report["removed"])
    return report


def _dram_matches(parts: StoreParts, namespaces: set[bytes]) -> list[bytes]:
    dram = parts.dram
    assert dram is not None
    return _matches(dram.table, namespaces,
                    lambda slots: [dram.slot_view(slot)[:HEADER_BLOCK] for slot in slots])


def _disk_matches(parts: StoreParts, namespaces: set[bytes], unread: list[int]) -> list[bytes]:
    disk = parts.disk
    assert disk is not None
    buffer = AlignedBuffer(SCAN_BATCH * HEADER_BLOCK)
    views = [buffer.view[i * HEADER_BLOCK : (i + 1) * HEADER_BLOCK] for i in range(SCAN_BATCH)]

    def read(slots: list[int]) -> list[memoryview | None]:
        results = disk.read(slots, [[views[i]] for i in range(len(slots))], parts.config.io.timeout_s)
        unread[0] += sum(result != HEADER_BLOCK for result in results)
        return [views[i] if result == HEADER_BLOCK else None for i, result in enumerate(results)]

    try:
        return _matches(disk.table, namespaces, read)
    finally:
        views.clear()
        buffer.close()


def _matches(table: SlotTable, namespaces: set[bytes],
             headers: Callable[[list[int]], list[memoryview | None]]) -> list[bytes]:
    """Keys of the table's published records whose header names one of `namespaces`; each
    batch's slots pinned while `headers(slots)` reads their header blocks (None: unread)."""
    entries = table.entries()
    found = []
    for first in range(0, len(entries), SCAN_BATCH):
        keys = [entry.key for entry in entries[first : first + SCAN_BATCH]]
        with table.pinned(keys) as pins:
            slots = [slot for _, slot in pins.hits]
            for (i, _), block in zip(pins.hits, headers(slots), strict=True):
                if block is None:
                    continue
                state, header = parse_header(block)
                if (state is HeaderState.VALID and header is not None and header.key == keys[i]
                        and header.namespace in namespaces):
                    found.append(keys[i])
    return found
