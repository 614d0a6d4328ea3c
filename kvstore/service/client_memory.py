"""The memory a data client shares with the service: its window, and the DRAM tier where
the service shares it, as the hello's reply hands them over.

A get fills window slots and a put reads them; a pin points into the tier, mapped
read-only, for the client to copy the payload out itself. The copies run on the
caller's threads, between requests and after them, so this memory is held apart from
the connection (client_connection.py): a dropped connection leaves it mapped for
copies still in flight, and only closing it unmaps it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from kvstore.format.errors import KVStoreError
from kvstore.format.record import HEADER_BLOCK, KEY_OFFSET, read_payload_len
from kvstore.io.memfd import SharedMemory
from kvstore.service import protocol as P
from kvstore.service.window import Window

_Size = Annotated[int, msgspec.Meta(ge=1, le=1 << 50)]


class HelloReply(msgspec.Struct):
    """A hello's reply to a data client (protocol.py): its window's slots, bytes and pages,
    and the DRAM tier's where one is passed."""

    slots: _Size
    window_bytes: _Size
    pages: P.Name
    tier_bytes: _Size | None = None
    tier_pages: P.Name = ""


class ClientMemory:
    """A client's window (`slots` slots of `chunk_bytes`; `slot(n)` is slot n's view) and
    the mapped DRAM tier (`tier`, None where not shared or not asked for; `tier_payload`).

    Invariants: a client without a chunk size (a scheduler's) maps nothing: no window, no
    tier, no slots. Views stay valid until `close()`, which runs every `before_unmap`
    callback once before either map goes (a CUDA worker unregisters the memory from the
    driver there) and leaves nothing mapped.
    """

    def __init__(self, chunk_bytes: int | None = None, window: Window | None = None, slots: int = 0,
                 tier: SharedMemory | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self.window = window
        self.slots = slots
        self.tier = tier
        self.before_unmap: list[Callable[[], object]] = []

    @classmethod
    def from_hello(cls, chunk_bytes: int, reply: Any, take_fd: Callable[[], int | None],
                   map_tier: bool) -> ClientMemory:
        """Map what a hello with `chunk_bytes` brought: `reply` and its descriptors
        (`take_fd`, in order: the window's, then the tier's where `tier_bytes` says it
        came). A tier descriptor is closed unmapped unless `map_tier`. The reply is checked
        before a descriptor is taken: one it refuses stays with the connection, which closes
        it, and slots past the window's end are refused, never views shorter than a chunk."""
        shared: HelloReply = P.reply_as(reply, HelloReply, "a hello")
        if shared.slots * chunk_bytes > shared.window_bytes:
            raise P.ProtocolError(f"a hello answered {shared.slots} slots of {chunk_bytes} bytes in a "
                                  f"{shared.window_bytes}-byte window")
        fd = take_fd()
        if fd is None:
            raise KVStoreError("the service sent no window")
        memory = cls(chunk_bytes, Window.attach(fd, shared.window_bytes, shared.pages), shared.slots)
        tier_fd = take_fd() if shared.tier_bytes is not None else None
        if tier_fd is not None and not map_tier:
            os.close(tier_fd)
        elif tier_fd is not None and shared.tier_bytes is not None:
            try:
                memory.tier = SharedMemory.attach(tier_fd, shared.tier_bytes, shared.tier_pages,
                                                  writable=False)
            except BaseException:
                memory.close()  # the window mapped above goes with the failed hello
                raise
        return memory

    def slot(self, index: int) -> memoryview:
        assert self.window is not None and self.chunk_bytes is not None
        start = index * self.chunk_bytes
        return self.window.view[start : start + self.chunk_bytes]

    def tier_payload(self, offset: int) -> memoryview:
        """A pinned chunk's payload in the mapped DRAM tier (read-only)."""
        assert self.tier is not None and self.chunk_bytes is not None and offset >= 0
        return self.tier.view[offset : offset + self.chunk_bytes]

    def tier_holds(self, offset: int, key: bytes) -> bool:
        """Whether the mapped DRAM tier's record at payload offset `offset` is chunk `key`'s
        (its header's key and payload length): a copy out under another connection's pin
        (a scheduler's lease) is checked so before and after, since that pin goes with that
        connection and this client may map another service's tier since (a restart)."""
        if self.tier is None or self.chunk_bytes is None or offset < HEADER_BLOCK:
            return False
        if offset + self.chunk_bytes > len(self.tier.view):
            return False
        block = self.tier.view[offset - HEADER_BLOCK : offset]
        named = bytes(block[KEY_OFFSET : KEY_OFFSET + len(key)])
        return named == key and read_payload_len(block) == self.chunk_bytes

    def close(self) -> None:
        for callback in self.before_unmap:
            callback()
        self.before_unmap.clear()
        for memory in (self.window, self.tier):
            if memory is not None:
                memory.close()
        self.window = self.tier = None
