"""Pages of an engine's host memory moved to and from the service by address.

Engines with a host KV pool of their own (SGLang's HiCache, LMCache's CPU tier) name a
page by its memory: one or more (address, bytes) segments, in order, that together make
one chunk. Chunks move through transfer.py, as the vLLM worker's do. A load copies each
chunk once, straight into those segments: from the service's DRAM tier where this
process maps it (the service pins the chunk's slot; a disk hit is read into a DRAM slot
and hashed as it is copied out, one pass over its bytes, then published for others only
if it verified), otherwise from the window slot the service filled (DRAM copy or O_DIRECT
read, checksummed), in waves of half the window, the next wave's fetch running
while this one is copied. A save gathers the segments into window slots and stores
them as one chain (each page's parent the page before it, across waves; the caller
names the first one's), in the same waves, each gathered into one half of the window
while the wave before it is put (Transfers.store_waves). A wave's copies go to
kvstore's copier in one call: shared out across threads that release the GIL, as the
vLLM client's loads are (engine_plugin/vllm/layout.py). Whatever did not verify, went
missing, or ran past the service deadline is a miss (False), never an exception: the
engine's storage threads must survive a fault.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from connectors.link import ServiceLink
from connectors.transfer import Fetched, Transfers
from kvstore.config.store import load_config
from kvstore.format.errors import ConfigError, KVStoreError
from kvstore.io.copier import copy_checked, copy_many
from kvstore.service.client import StoreClient

log = logging.getLogger("kvstore.page_io")

Segments = Sequence[tuple[int, int]]  # one page: (address, bytes) pieces, concatenated in order


def segments_bytes(page: Segments) -> int:
    return sum(size for _, size in page)


def _memory(address: int, size: int) -> memoryview:
    """`size` bytes of the engine's memory at `address`, as bytes the copier takes."""
    return memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")


def _placed(page: Segments) -> list[tuple[memoryview, int]]:
    """(page segment, where its bytes start in the chunk) for each of the page's segments."""
    placed, at = [], 0
    for address, size in page:
        placed.append((_memory(address, size), at))
        at += size
    return placed


def _pieces(page: Segments, chunk: memoryview) -> list[tuple[memoryview, memoryview]]:
    """(page segment, the chunk's bytes for it) for each of the page's segments, in order."""
    return [(segment, chunk[at : at + len(segment)]) for segment, at in _placed(page)]


class PageIO:
    """One service connection (re-made, rate-limited, after a failure) for pages of
    `chunk_bytes`; callable from several threads (one request at a time goes out)."""

    def __init__(self, make_client: Callable[[], StoreClient], chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.make_client = make_client
        self.link = ServiceLink(make_client)
        self.link.start()
        self.transfers = Transfers(self.link, "pages")
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def another(self) -> PageIO:
        """A connection of its own to the same service, for the same pages: loads on two
        PageIOs run side by side (one's service reads while the other copies)."""
        return PageIO(self.make_client, self.chunk_bytes)

    def present(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the store holds (0 while the service does not answer)."""
        if not keys:
            return 0
        with self._lock:
            client = self.link.get()
            if client is None:
                return 0
            try:
                return client.residency(keys)[0]
            except KVStoreError as exc:
                self.transfers.failed("lookup", exc)
                return 0

    def load(self, keys: Sequence[bytes], pages: Sequence[Segments]) -> list[bool]:
        """Fill pages[i] with chunk keys[i]; False where it missed (nothing trustworthy was
        written there: a chunk is copied in only after it verified). The next wave's
        fetch runs while this wave is copied."""
        self._check(keys, pages)
        done = [False] * len(keys)
        with self._lock:
            client = self.link.get()
            if client is None:
                return done

            def copy(wave: range, fetched: Fetched) -> None:
                found = [(j, i, source) for j, i in enumerate(wave)
                         if (source := fetched.source(client.memory, j)) is not None]
                plain = [(i, source) for j, i, source in found if fetched.check(j) is None]
                checked = [(j, i, source) for j, i, source in found if fetched.check(j) is not None]
                copy_many([pair for i, source in plain for pair in _pieces(pages[i], source)])
                digests = copy_checked([(source, _placed(pages[i])) for _, i, source in checked])
                for i, _ in plain:
                    done[i] = True
                for (j, i, _), digest in zip(checked, digests, strict=True):  # verified as copied
                    done[i] = digest == fetched.check(j)
                    (fetched.good if done[i] else fetched.bad).append(keys[i])

            self.transfers.fetch_waves(client, keys, copy, checks_copies=True)
        return done

    def save(self, keys: Sequence[bytes], pages: Sequence[Segments],
             parent: bytes | None = None, namespace: bytes | None = None) -> list[bool]:
        """Store pages[i] as chunk keys[i], one chain: keys[0]'s parent is `parent` (the
        chunk before them in the engine's sequence; None: they start it), each next
        page's the one before it, across window waves. Their records' headers name
        `namespace` (None: the connection's). False where it was not stored."""
        self._check(keys, pages)
        with self._lock:
            client = self.link.get()
            if client is None or client.memory.window is None:
                return [False] * len(keys)

            def gather(wave: range, first: int) -> None:
                copy_many([(slot_bytes, segment) for slot, i in enumerate(wave, first)
                           for segment, slot_bytes in _pieces(pages[i], client.memory.slot(slot))])

            return self.transfers.store_waves(client, keys, gather, parent, namespace)

    def count_misses(self, kind: str, chunks: int, why: str, *args: Any) -> None:
        """`chunks` loaded chunks the engine's backend refused after they verified (`kind`:
        e.g. `bad_header`, a stored header that does not fit the engine's memory): counted
        in the service as `load.<kind>` (`kvstore info`, Prometheus) and logged once per
        kind. Best effort: it never connects, and a failure only logs."""
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("kvstore: " + why + " (counted as load.%s; logged once)", *args, kind)
        with self._lock:
            client = self.link.peek()
            if client is None:
                return
            try:
                client.count({f"load.{kind}": chunks})
            except KVStoreError as exc:
                self.transfers.failed("count", exc)

    def _check(self, keys: Sequence[bytes], pages: Sequence[Segments]) -> None:
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        for page in pages:
            if segments_bytes(page) != self.chunk_bytes:
                raise ValueError(f"a page of {segments_bytes(page)} bytes; this store's chunks "
                                 f"are {self.chunk_bytes}")

    def close(self) -> None:
        with self._lock:
            self.transfers.close()


def service_pages(source: Any, field: str, chunk_bytes: int, namespace: bytes,
                  description: Mapping[str, str | int] | None = None, *,
                  more: Sequence[tuple[bytes, Mapping[str, str | int]]] = ()) -> tuple[PageIO, PageIO]:
    """(reads, writes): two connections to the service that `source` configures (a
    kvstore YAML/JSON file or the config as a mapping; `field` names where it came
    from, for the error when it is missing), so a save never waits behind a load. Their
    records' headers name `namespace`, announced with `description` at each connect
    (what `kvstore purge --list` shows), together with `more` (digest, description):
    further namespaces a save names (`PageIO.save`'s `namespace`)."""
    if not source:
        raise ConfigError(field, None, "required: a kvstore YAML/JSON file or the config as a mapping")
    store = load_config(source)

    def make_client(map_tier: bool) -> StoreClient:
        client = StoreClient(store, chunk_bytes, namespace=namespace, map_tier=map_tier)
        announced = [(namespace, description)] if description is not None else []
        if announced or more:
            try:
                client.announce([*announced, *more])
            except BaseException:
                client.close()
                raise
        return client

    reads = PageIO(functools.partial(make_client, True), chunk_bytes)
    try:
        return reads, PageIO(functools.partial(make_client, False), chunk_bytes)  # writes: no tier mapped
    except BaseException:  # the pair or nothing: a caller that tries again leaks no connection
        reads.close()
        raise
