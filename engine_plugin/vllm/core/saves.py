"""Worker saves: chunks copied out of KV blocks into window slots, then written behind.

Saves copy out within their step, since a block may be reused once the step ends: each
chunk's blocks are gathered into a free window slot, and a writer thread hands the slots
to the service (transfer.py: a save's waves are one chain, each wave's parent the previous
wave's last chunk: `chain_parent`), in the waves a fetch takes (`wave_plan`: at most half
the window), so the copy-out of one wave overlaps the write of the previous. A step that
computed more chunks than the window holds waits for slots to come back, at most
`save_window_wait_s` per step (and not at all while the writer is stuck, i.e. since a wait
ran out no slot came back); what does not fit is dropped and counted (`save.dropped`, sent
to the service's counters). A dropped save is only a future miss. Each save is reported
done (stored or given up) by its save_id, in the writer's order, so the scheduler knows
when its chunks stopped being in flight.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from connectors.link import ServiceLink
from connectors.transfer import Transfers, chain_parent, wave_plan
from connectors.worker_threads import unbind
from engine_plugin.vllm.core.kv_layout import KVLayout
from engine_plugin.vllm.core.plan import Transfer
from kvstore.format.errors import KVStoreError
from kvstore.service.client import StoreClient
from kvstore.service.client_types import Stats

log = logging.getLogger("vllm.kvstore.worker")


@dataclass(frozen=True)
class _Write:
    client: StoreClient
    keys: tuple[bytes, ...]
    slots: list[int]
    parent: bytes | None
    namespace: bytes | None  # what the records' headers name (the scheduler's namespace digest)


@dataclass(frozen=True)
class _SaveDone:
    """Queued after a save's writes: the save is over once the writer reaches it."""

    save_id: int
    dropped: int  # chunks that never got a window slot
    client: StoreClient | None  # the saver's client, to report counters through


class SaveHandler:
    def __init__(self, layout: KVLayout, rank: int, make_client: Callable[[], StoreClient], stats: Stats,
                 save_window_wait_s: float) -> None:
        self.layout = layout
        self.rank = rank
        self.stats = stats
        self.save_window_wait_s = save_window_wait_s
        self.link = ServiceLink(make_client)
        self.link.start()
        self.transfers = Transfers(self.link, "save")
        self._lock = threading.Lock()
        # Free slots of one client's window; a new client (after a failure) brings a
        # new window, and slots of the old one are never handed out again.
        self._window_owner: StoreClient | None = None
        self._free_slots: list[int] = []
        self._slot_freed = threading.Condition(self._lock)
        self._stalled = False  # a wait for a slot ran out and no slot has come back since
        self._done_saves: list[int] = []
        self._unreported: Counter[str] = Counter()  # counters not yet sent to the service
        self._writes: queue.Queue[_Write | _SaveDone | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-save", daemon=True)
        self._writer.start()

    def save(self, saves: Sequence[Transfer]) -> None:
        """Copy each chunk out of its blocks into a window slot, queueing the writes in
        waves; wait for slots at most save_window_wait_s in all, then drop the rest.
        Runs on the engine's thread, so it never connects: a save without a connected
        saver is dropped, and the writer thread reconnects (the hello alone may take
        the I/O deadline on a hung service)."""
        client = self.link.peek()
        if client is not None:
            with self._lock:
                if self._window_owner is not client:
                    self._window_owner, self._free_slots = client, list(range(client.memory.slots))
                    self._stalled = False
        deadline = time.monotonic() + self.save_window_wait_s
        for transfer in saves:
            keys = transfer.keys[self.rank]
            namespace = transfer.namespaces[self.rank] if transfer.namespaces else None
            waves = (wave_plan(transfer.num_chunks, max(1, client.memory.slots // 2))
                     if client is not None else [])
            done = 0
            for wave in waves:  # the fetches' waves; a wave short of free slots goes in pieces
                while client is not None and done < wave.stop:
                    slots = self._take_slots(client, wave.stop - done, deadline)
                    if not slots:
                        break
                    for slot, blocks in zip(slots, transfer.blocks[done:], strict=False):
                        self.layout.gather(blocks, client.memory.slot(slot), transfer.group)
                    parent = chain_parent(keys, done, transfer.parents[self.rank])
                    self._writes.put(_Write(client, keys[done : done + len(slots)], slots, parent, namespace))
                    done += len(slots)
                if done < wave.stop:
                    break
            self._writes.put(_SaveDone(transfer.save_id, transfer.num_chunks - done, client))

    def _take_slots(self, client: StoreClient, wanted: int, deadline: float) -> list[int]:
        """Up to `wanted` free slots of `client`'s window (at most half of it), waiting
        for the writer to free some until `deadline`; none past it or while stalled."""
        with self._slot_freed:
            while not self._free_slots and not self._stalled and self._window_owner is client:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._slot_freed.wait(remaining):
                    self._stalled = True
            if self._window_owner is not client:
                return []
            count = min(wanted, len(self._free_slots), max(1, client.memory.slots // 2))
            return [self._free_slots.pop() for _ in range(count)]

    def take_done_saves(self) -> list[int]:
        """save_ids whose writes are over since the last call (for the scheduler)."""
        with self._lock:
            done, self._done_saves = self._done_saves, []
        return done

    def _write_loop(self) -> None:
        unbind()  # off the engine's compute core (worker_threads.py)
        while (item := self._writes.get()) is not None:
            if isinstance(item, _SaveDone):
                self._finish_save(item)
            else:
                self._write(item)

    def _write(self, write: _Write) -> None:
        try:
            stored = self.transfers.store(write.client, write.keys, write.slots, write.parent,
                                          write.namespace)
            self.stats.add("save.chunks", sum(stored))
        except Exception:  # never let a save bug stop the writer: the save is a future miss
            log.exception("kvstore save of %d chunks failed", len(write.keys))
        with self._slot_freed:
            if self._window_owner is write.client:
                self._free_slots.extend(write.slots)
                self._stalled = False
                self._slot_freed.notify_all()

    def _finish_save(self, done: _SaveDone) -> None:
        """Report the save done, count what was dropped, and send pending counters to the
        service (reconnecting the saver if it has no client)."""
        with self._lock:
            self._done_saves.append(done.save_id)
            if done.dropped:
                self.stats.add("save.dropped", done.dropped)
                self._unreported["save.dropped"] += done.dropped
            counters = dict(self._unreported)
        if done.dropped:
            log.warning("kvstore: %d chunks of a save dropped (no save window slot within "
                        "save_window_wait_s=%g s, or no service)", done.dropped, self.save_window_wait_s)
        client = done.client if done.client is not None else self.link.get()
        if counters and client is not None:
            try:
                client.count(counters)
            except KVStoreError as exc:
                log.debug("kvstore: save counters not reported yet (%s)", exc)
            else:
                with self._lock:
                    self._unreported.subtract(counters)
                    self._unreported = +self._unreported

    def close(self) -> bool:
        """Drain queued saves (bounded wait), then release the connection; False if
        already closed."""
        if not self._writer.is_alive():
            return False
        self._writes.put(None)
        self._writer.join(timeout=30)
        self.transfers.close()
        return True
