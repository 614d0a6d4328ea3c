"""Host memory a CUDA worker copies from, registered with the driver (cudaHostRegister)
so host-to-device copies from it are DMAs, and unregistered (cudaHostUnregister) before
it is unmapped: a client's window, and the service's DRAM tier, which only the loading
client maps. A worker that reconnects drops its old client; the old registration goes
with it (else the driver keeps pinning pages of a mapping that is gone, and a new map
at the same address cannot be registered)."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from kvstore.format.record import record_bytes
from kvstore.service.client_memory import ClientMemory

log = logging.getLogger("vllm.kvstore")
REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the pages are mapped read-only
PIECE_BYTES = 1 << 30  # a large tier is registered in pieces of about this size, each a short call


class HostRegistration:
    """The ranges registered for one client. Each keeps its memory object alive, so its
    pages stay mapped until `release()` has unregistered them."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, Any]] = []  # (address, the memory it lies in)
        self._lock = threading.Lock()
        self._released = False
        self.thread: threading.Thread | None = None  # the tier's registration, off the serving path

    def register(self, memory: Any, *, read_only: bool = False, piece_bytes: int = 0) -> bool:
        """Register `memory` (anything with `address` and `nbytes`), in pieces of
        `piece_bytes` (0: whole; a copy must not span two pieces). False where the driver
        refused, or the registration was released meanwhile (copies then go through the
        driver's bounce buffers: slower, still right)."""
        cudart = torch.cuda.cudart()
        flags = REGISTER_READ_ONLY if read_only else 0
        step = piece_bytes or memory.nbytes
        for start in range(0, memory.nbytes, step):
            with self._lock:
                if self._released:
                    return False
                address = memory.address + start
                if int(cudart.cudaHostRegister(address, min(step, memory.nbytes - start), flags)) != 0:
                    return False
                self._ranges.append((address, memory))
        return True

    @property
    def ranges(self) -> int:
        """How many ranges are registered now."""
        with self._lock:
            return len(self._ranges)

    def release(self) -> None:
        """Unregister every range (a registration still running stops at its next piece)."""
        with self._lock:
            self._released = True
            ranges, self._ranges = self._ranges, []
        try:
            cudart = torch.cuda.cudart()
            for address, _ in ranges:
                cudart.cudaHostUnregister(address)
        except Exception as exc:  # at interpreter exit the CUDA runtime may be gone already
            log.debug("kvstore: CUDA host memory not unregistered (%s)", exc)


def register_for_dma(memory: ClientMemory) -> HostRegistration:
    """Make host-to-device copies from a client's window and, where it mapped it, the
    DRAM tier DMAs: the window at once (small), the tier in pieces of whole slots on a
    thread of its own, off the serving path (a large tier takes seconds; loads copy
    through the driver's bounce buffers meanwhile, and a refusal there never reaches
    the engine's CUDA error state). Released when the memory is closed (with its client)
    or collected."""
    registration = HostRegistration()
    memory.before_unmap.append(weakref.finalize(memory, registration.release))
    if not torch.cuda.is_available():
        return registration
    if memory.window is not None:
        registration.register(memory.window)
    tier, chunk_bytes = memory.tier, memory.chunk_bytes
    if tier is None or chunk_bytes is None:
        return registration
    slot_bytes = record_bytes(chunk_bytes)  # a load reads within one slot: pieces hold whole slots
    piece_bytes = max(1, PIECE_BYTES // slot_bytes) * slot_bytes

    def register() -> None:
        done = registration.register(tier, read_only=True, piece_bytes=piece_bytes)
        (log.info if done else log.warning)(
            "kvstore: %s the %d-byte DRAM tier for host-to-device DMA", "registered" if done
            else "the CUDA driver did not register", tier.nbytes)

    registration.thread = threading.Thread(target=register, name="kvstore-cuda-register", daemon=True)
    registration.thread.start()
    return registration
