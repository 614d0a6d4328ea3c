"""The device tier: chunk slots in the engine's device memory, filled ahead of loads.

A request's arrival plans a stage of its stored chunks; a worker thread fetches them
from the service (DRAM, or disk if not promoted yet) into its shared-memory window and
copies them into this pool: on CUDA with non-blocking copies from the pinned window
on a dedicated stream, elsewhere (the CPU engine) with the same code on the CPU. A
load then takes a staged chunk with a device-to-device copy into the paged blocks,
and only asks the service for the chunks that were not staged.

Invariants (under the pool's lock): a key maps to at most one slot; a slot is free,
staged (in `_staged`, evictable oldest first) or taken by a load (neither, until
`release`); a staged slot's copy has completed before `take` returns it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict

import torch


class DeviceStagingPool:
    def __init__(self, chunk_bytes: int, capacity_bytes: int, device: torch.device) -> None:
        self.num_slots = capacity_bytes // chunk_bytes
        self.chunk_bytes = chunk_bytes
        self.device = device
        self.buffer = torch.empty((self.num_slots, chunk_bytes), dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._lock = threading.Lock()
        self._staged: OrderedDict[bytes, int] = OrderedDict()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._staged

    def stage(self, keys: list[bytes], sources: list[memoryview]) -> tuple[int, int]:
        """Copy chunks (host memory the caller reuses once this returns) into free slots,
        evicting the oldest unused staged chunks if needed. Returns (chunks staged,
        unused chunks evicted for them)."""
        placed: list[tuple[bytes, int, memoryview]] = []
        evicted = 0
        with self._lock:
            for key, source in zip(keys, sources, strict=True):
                if key in self._staged:
                    continue
                if not self._free and self._staged:
                    _, slot = self._staged.popitem(last=False)
                    self._free.append(slot)
                    evicted += 1
                if not self._free:
                    break  # every slot is taken by a load in progress
                placed.append((key, self._free.pop(), source))
        if not placed:
            return 0, evicted
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for _, slot, source in placed:
                self.buffer[slot].copy_(torch.frombuffer(source, dtype=torch.uint8),
                                        non_blocking=self.stream is not None)
        if self.stream is not None:
            self.stream.synchronize()  # the sources are reused after this returns
        with self._lock:
            for key, slot, _ in placed:
                self._staged[key] = slot
        return len(placed), evicted

    def take(self, key: bytes) -> int | None:
        """The slot holding `key`, now owned by the caller until `release`; None if absent."""
        with self._lock:
            return self._staged.pop(key, None)

    def slot(self, slot: int) -> torch.Tensor:
        return self.buffer[slot]

    def release(self, slot: int) -> None:
        """Give back a taken slot once the caller's copies out of it are issued."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the copy has read it
        with self._lock:
            self._free.append(slot)
