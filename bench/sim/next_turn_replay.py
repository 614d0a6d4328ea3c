"""The next-turn policy replayed on a trace: what is in DRAM when a request arrives.

Hooks on a Replayer (bench/sim/replay.py): its requests end (arrival + output tokens
x its `tpot_s`), and the service's NextTurnPredictor (kvstore/tiers/next_turn.py) brings
finished chains back into DRAM before their family is predicted to return, through the
same promotion a prefetch makes (`SimStore.read_ahead`). Modes:
  off      nothing happens when a request ends (a cache of prompts, LRU alone)
  warm     a finished request's chunks are promoted at once (what the connector did
           before: keep the last turn warm)
  predict  promoted `lead_s` before the learned return
  oracle   the bound for any such predictor: it knows when each chunk of a finished
           request arrives next (`foresee` reads the trace ahead), and promotes each
           part of the chain `lead_s` before the request that reuses it, never one
           that does not come back; same DRAM, same promotion, same lead
Per run: `dram_resident_at_arrival` (of the chunks a request finds stored, the
fraction already in DRAM when it arrives, before its own prefetch moves any) and
`prefetch_wasted_bytes` (read ahead into DRAM, then evicted or never read).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from bench.sim.replay import Replayer
from bench.support.trace import TraceRequest
from kvstore.tiers.next_turn import NextTurnPredictor
from kvstore.tiers.slots import Change, Entry

MODES = ("off", "warm", "predict", "oracle")


class NextTurnReads:
    def __init__(self, replayer: Replayer, mode: str, *, lead_s: float = 1.0) -> None:
        """Read ahead on `replayer`'s tiers in `mode` (one of MODES), from now on."""
        if mode not in MODES:
            raise ValueError(f"next-turn mode {mode!r}: one of {', '.join(MODES)}")
        self.replayer = replayer
        self.mode = mode
        self.predictor = NextTurnPredictor(lead_s=lead_s)
        self.found_chunks = 0
        self.resident_chunks = 0
        self.read_ahead_bytes = 0
        self.wasted_bytes = 0
        self._ahead: set[bytes] = set()  # read ahead into DRAM, not read since
        self._next_use: list[list[float | None]] = []  # oracle: per request, per key
        self._served = 0
        self._top = replayer.tiers[0]
        self._top.table.subscribe(self._left_dram)
        replayer.hooks.append(self)

    def before(self, request: TraceRequest) -> None:
        """Due chains are read ahead; what the request finds is counted as it arrives."""
        replayer, now = self.replayer, request.arrival_s
        for chain, _ in self.predictor.due(now):
            moved = replayer.store.read_ahead(list(chain))
            self._ahead.update(moved)
            self.read_ahead_bytes += len(moved) * replayer.chunk_bytes
        keys = list(request.keys)
        usable = keys[: min(len(keys), (request.input_tokens - 1) // replayer.block_tokens)]
        run = next((i for i, key in enumerate(usable) if not replayer.store.held(key)), len(usable))
        self.found_chunks += run
        self.resident_chunks += sum(key in self._top for key in usable[:run])
        self._ahead.difference_update(usable[:run])
        if self.mode == "predict":
            self.predictor.arrived(keys, now)

    def after(self, request: TraceRequest) -> None:
        """The request's end is when its chain may be wanted back from."""
        keys = list(request.keys)
        end = request.arrival_s + request.output_tokens * self.replayer.ends.tpot_s
        if self.mode == "predict":
            self.predictor.finished(keys, end)
        elif self.mode == "oracle":
            self._foretell(keys, self._next_use[self._served])
        elif self.mode == "warm":  # promoted at the finish itself
            self.predictor.expect(keys, end + self.predictor.lead_s)
        self._served += 1

    def foresee(self, requests: Iterable[TraceRequest]) -> None:
        """Oracle: learn when each request's chunks arrive next (None: never)."""
        rows = list(requests)
        later: dict[bytes, float] = {}
        self._next_use = [[] for _ in rows]
        for index in range(len(rows) - 1, -1, -1):
            self._next_use[index] = [later.get(key) for key in rows[index].keys]
            later.update(dict.fromkeys(rows[index].keys, rows[index].arrival_s))

    def _foretell(self, keys: list[bytes], next_use: list[float | None]) -> None:
        """Each part of the chain is wanted when its next user arrives: a key's next user
        also holds every key before it, so those times grow with depth."""
        last: dict[float, int] = {}
        for i, at in enumerate(next_use):
            if at is not None:
                last[at] = i
        for at, end in last.items():
            self.predictor.expect(keys[: end + 1], at)

    def reset(self) -> None:
        self.found_chunks = self.resident_chunks = self.read_ahead_bytes = self.wasted_bytes = 0
        self._ahead.clear()

    def _left_dram(self, change: Change, entry: Entry) -> None:
        if change is not Change.STORED and entry.key in self._ahead:
            self._ahead.discard(entry.key)
            self.wasted_bytes += self.replayer.chunk_bytes

    def result(self) -> dict[str, Any]:
        wasted = self.wasted_bytes + len(self._ahead) * self.replayer.chunk_bytes
        return {"next_turn": self.mode,
                "dram_resident_at_arrival": self.resident_chunks / max(1, self.found_chunks),
                "prefetch_read_bytes": self.read_ahead_bytes, "prefetch_wasted_bytes": wasted,
                "prefetch_wasted_fraction": wasted / max(1, self.read_ahead_bytes)}
