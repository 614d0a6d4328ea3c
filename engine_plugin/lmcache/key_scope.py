"""The weights and generation in front of keys an engine makes itself (LMCache's).

LMCache hands kvstore its own key (a chunk hash with the model, rank and dtype) and
kvstore hashes it into a 16-byte key. A KeyScope puts the weights' identity (a
fingerprint of the checkpoint, or the operator's revision: connectors/weights.py) and
their generation in front. A weight update the engine tells kvstore about (LMCache's
`clear`) starts a new generation, a random nonce, so nothing stored before is found by
this engine again. A chunk the engine removes (its `clear` of some tokens, a PD
receiver's `remove_after_retrieve`) is hidden from this engine's lookups and loads, never
deleted (the store is shared); past MAX_HIDDEN hidden keys a new generation hides
everything at once, so memory stays bounded and no removed chunk ever comes back.
Thread-safe: LMCache calls from several threads.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from connectors.page_io import PageIO, service_pages
from kvstore.format.keys import Weights, key_digest

MAX_HIDDEN = 1 << 16


class KeyScope:
    def __init__(self, fingerprint: str, max_hidden: int = MAX_HIDDEN) -> None:
        self.weights = Weights(fingerprint)
        self.max_hidden = max_hidden
        self._hidden: set[bytes] = set()
        self._lock = threading.Lock()

    def key(self, text: str) -> bytes:
        """kvstore's key for the engine's key `text`, in this generation."""
        return key_digest(f"{self.weights.fingerprint}#{self.weights.generation}|{text}".encode())

    def new_generation(self) -> Weights:
        with self._lock:
            self.weights = Weights(self.weights.fingerprint, secrets.token_hex(8))
            self._hidden.clear()
            return self.weights

    def hide(self, keys: Iterable[bytes]) -> None:
        """These keys miss for this engine from now on (a new generation once too many are)."""
        with self._lock:
            self._hidden.update(keys)
            full = len(self._hidden) > self.max_hidden
        if full:
            self.new_generation()

    def visible(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key not in self._hidden for key in keys]

    def leading(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys before the first hidden one (a lookup's leading run stops there)."""
        shown = self.visible(keys)
        return list(keys[: shown.index(False) if False in shown else len(keys)])

    def pages(self, source: Any, field: str, chunk_bytes: int, engine: str,
              model: str) -> tuple[PageIO, PageIO]:
        """Connections (connectors/page_io.py) whose records name this generation's namespace,
        announced described (engine, model, weights, generation) for `kvstore purge`."""
        weights = self.weights
        identity = f"{engine}|{chunk_bytes}|{model}|{weights.fingerprint}#{weights.generation}"
        description: dict[str, str | int] = {"engine": engine, "model": model, "weights": weights.fingerprint,
                                             "generation": weights.generation, "chunk_bytes": chunk_bytes}
        namespace = key_digest(identity.encode())
        return service_pages(source, field, chunk_bytes, namespace, description)
