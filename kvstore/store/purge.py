"""Purge: remove the records of some namespaces from every tier of this host.

Each record's header carries the digest of the namespace its key was made in (an engine's
model, weights, generation, rank, KV cache group and salt: kvstore/format/keys.py). Purge
reads the header of every published record, DRAM ones in place (their slots pinned, the
key checked) and disk ones with one 4 KiB read per slot, SCAN_BATCH at a time, and deletes
the records whose namespace was asked for (TieredStore.delete: the DRAM slot freed, the
disk header zeroed, so a restart does not bring them back). A dry run counts and removes
nothing. Invariants: a record another namespace names is never touched; a record published
while the scan runs is not seen (what an engine still stores under that namespace stays);
a disk header that cannot be read is left and counted (`unread`); a device out of service
cannot be scanned, so it is told the namespaces, and zeroes their records when it comes
back (tiers/availability.py `forget`). The same scan tells the
service which namespaces still hold records (`held`, through StoreProbe.namespaces), so
that it never forgets the description of one it could still be asked to purge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from kvstore.devices.scanner import SCAN_BATCH
from kvstore.format.record import HEADER_BLOCK, HeaderState, parse_header
from kvstore.io.staging import StagingPool
from kvstore.store.parts import StoreParts
from kvstore.tiers.slots import SlotTable


def purge(parts: StoreParts, delete: Callable[[list[bytes]], int], namespaces: set[bytes],
          dry_run: bool) -> dict[str, int]:
    """{"chunks", "bytes", "dram_chunks", "disk_chunks", "unread", "removed"}: the records
    found in each tier (bytes: their payloads, every tier's copy counted) and, unless
    `dry_run`, how many chunks `delete` (the store's) removed."""
    unread = [0]
    if not dry_run and parts.disk is not None:  # a device out of service zeroes them on its return
        parts.disk.availability.forget(namespaces=sorted(namespaces))
    in_dram = [key for key, named in _dram_records(parts) if named in namespaces]
    on_disk = [key for key, named in _disk_records(parts, unread) if named in namespaces]
    keys = list(dict.fromkeys(in_dram + on_disk))
    report = {"chunks": len(keys), "bytes": (len(in_dram) + len(on_disk)) * parts.chunk_bytes,
              "dram_chunks": len(in_dram), "disk_chunks": len(on_disk), "unread": unread[0],
              "removed": 0}
    if not dry_run and keys:
        report["removed"] = delete(keys)
        parts.stats.add("purge.chunks", report["removed"])
    if not dry_run and parts.disk is not None:  # again: a device may have left during the scan
        parts.disk.availability.forget(namespaces=sorted(namespaces))
    return report


def held(parts: StoreParts) -> set[bytes] | None:
    """The namespace digests that the records of every tier name, or None when a disk
    header could not be read (its namespace, and so the answer, is not known). Records
    published after the scan passed their table are not seen."""
    unread = [0]
    found = {named for _, named in _dram_records(parts)}
    found.update(named for _, named in _disk_records(parts, unread))
    return None if unread[0] else found


def _dram_records(parts: StoreParts) -> Iterator[tuple[bytes, bytes]]:
    dram = parts.dram
    if dram is None:
        return iter(())
    return _records(dram.table, lambda slots: [dram.slot_view(slot)[:HEADER_BLOCK] for slot in slots])


def _disk_records(parts: StoreParts, unread: list[int]) -> Iterator[tuple[bytes, bytes]]:
    disk = parts.disk
    if disk is None:
        return
    pool = StagingPool(HEADER_BLOCK, SCAN_BATCH)  # a block a late read holds is not read into again

    def read(slots: list[int]) -> list[memoryview | None]:
        blocks = [pool.acquire() for _ in slots]
        try:
            results = disk.read(slots, [[block] for block in blocks], parts.config.io.timeout_s)
            unread[0] += sum(result != HEADER_BLOCK for result in results)
            return [memoryview(bytes(block.views[0])) if result == HEADER_BLOCK else None
                    for block, result in zip(blocks, results, strict=True)]
        finally:
            for block in blocks:
                block.close()

    try:
        yield from _records(disk.table, read)
    finally:
        pool.close()


def _records(table: SlotTable,
             headers: Callable[[list[int]], list[memoryview | None]]) -> Iterator[tuple[bytes, bytes]]:
    """(key, namespace digest) of the table's published records whose header reads valid;
    each batch's slots pinned while `headers(slots)` reads their header blocks (None: unread)
    and the batch's records are handed on."""
    entries = table.entries()
    for first in range(0, len(entries), SCAN_BATCH):
        keys = [entry.key for entry in entries[first : first + SCAN_BATCH]]
        with table.pinned(keys) as pins:
            slots = [slot for _, slot in pins.hits]
            for (i, _), block in zip(pins.hits, headers(slots), strict=True):
                if block is None:
                    continue
                state, header = parse_header(block)
                if state is HeaderState.VALID and header is not None and header.key == keys[i]:
                    yield keys[i], header.namespace
