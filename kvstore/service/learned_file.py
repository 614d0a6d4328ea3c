"""What `learned` disk admission learned, kept across the service's restarts.

Learning from cold takes as long as people take to come back to a conversation
(minutes), and a disk admission that has not learned yet refuses what it should not. So
the service writes the store's learned return rates (per bucket: no key, no prompt) to
`SOCKET.learned` (0600 JSON in its private directory) when it closes, and hands them
back to the store it makes at the next start, or to the store a reload switches to
`learned`. A file that does not check, whatever is wrong with it (another version, a
damaged, foreign, huge or deeply nested file), is moved aside (`SOCKET.learned.bad`) with a
warning and counted (`admission.learned_refused`): the store then learns from cold; the
hello or reload that read it goes on.
`Keeper` also writes the file every `service.learned_save_s` while the service runs: a
service killed outright (SIGKILL, out of memory) never reaches its close, and its
successor would otherwise start from the last clean stop's file.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvstore.config.runtime import read_private_json, set_aside, write_private_json
from kvstore.format.errors import KVStoreError
from kvstore.store.tiered import TieredStore

log = logging.getLogger(__name__)
SUFFIX = ".learned"  # after the service's socket path
MAX_BYTES = 1 << 20  # a state is ~200 KB, set by the tally layout (return_rates.py ReturnRates.state)
STATE = dict[str, int | float | list[float]]  # its shape: nothing nests deeper


def restore(store: TieredStore, socket: str) -> None:
    """Start the store's `learned` admission from the service's file, if both are there."""
    path = socket + SUFFIX
    if store.admin.learned_admission() is None:
        return  # another admission policy: nothing to start from
    try:
        state = read_private_json(path, STATE, MAX_BYTES)
        if state is not None:
            store.admin.learned_admission(state)
            log.info("learned disk admission: return rates restored from %s", path)
    except Exception as exc:  # whatever the file holds: never the end of a hello or a reload
        store.stats.add("admission.learned_refused")
        log.warning("learned disk admission: %s not used (%s: %s; %s); learning from cold", path,
                    type(exc).__name__, str(exc)[:300], set_aside(path))


class Keeper:
    """The service's learned rates over its store's life: restored when the store is made
    and when a reload switches it to `learned`, written every `every_s` seconds from a
    thread of its own (a slow filesystem delays only that thread), and once more at close.
    Invariants: no write comes between a switch to `learned` and its restore (a periodic
    write cannot replace the file with a cold state just before it is read); after `close`
    returns nothing is written again, its own write being the last."""

    def __init__(self, socket: str, every_s: float) -> None:
        self._socket = socket
        self._every_s = every_s
        self._store: TieredStore | None = None
        self._lock = threading.Lock()  # a write, or a switch and its restore
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvstore-learned")

    def start(self, store: TieredStore) -> None:
        """The service made its store: start it from the file, then keep the file."""
        with self._lock:
            restore(store, self._socket)
            self._store = store
        if self._thread.ident is None and not self._stopping.is_set():
            self._thread.start()

    def switch(self, store: TieredStore, apply: Callable[[], None]) -> None:
        """Change the store's policy (`apply`, a reload's); if that switched `learned` on, it
        starts from the file, as at a start, not from cold."""
        with self._lock:
            learning = store.admin.learned_admission() is not None
            apply()
            if not learning:
                restore(store, self._socket)

    def _run(self) -> None:
        while not self._stopping.wait(self._every_s):
            store = self._store
            try:
                if store is not None:
                    with self._lock:
                        save(store, self._socket)
            except Exception:  # never the end of the writes: the next one may do
                log.exception("learned disk admission: return rates not written")

    def close(self) -> None:
        """Stop the periodic writes, then write once more (before the store closes)."""
        self._stopping.set()
        if self._thread.ident is not None:
            self._thread.join()
        if self._store is not None:
            save(self._store, self._socket)
            self._store = None


def save(store: TieredStore, socket: str) -> None:
    """Write what the store's `learned` admission has learned (nothing under another policy)."""
    state = store.admin.learned_admission()
    if state is None:
        return
    try:
        write_private_json(socket + SUFFIX, state)
    except (OSError, KVStoreError) as exc:
        log.warning("learned disk admission: return rates not written to %s (%s)", socket + SUFFIX, exc)
