"""The next-turn policy replayed on a trace: what is in DRAM when a request arrives.

A Replayer (bench/replay.py) whose requests also end (arrival + output tokens x
`tpot_s`) and whose finished chains the service's NextTurnPredictor
(kvstore/tiers/next_turn.py) brings back into DRAM before their family is predicted to
return, through the same promotion a prefetch makes. Modes:
  off      nothing happens when a request ends (a cache of prompts, LRU alone)
  warm     a finished request's chunks are promoted at once (what the connector did
           before: keep the last turn warm)
  predict  promoted `lead_s` before the learned return
Per run: `dram_resident_at_arrival` (of the chunks a request finds stored, the
fraction already in DRAM when it arrives, before its own prefetch moves any) and
`prefetch_wasted_bytes` (read ahead into DRAM, then evicted or never read).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.replay import Replayer
from bench.trace import TraceRequest
from kvstore.tiers.next_turn import NextTurnPredictor
from kvstore.tiers.policy import TierPolicy
from kvstore.tiers.slots import Entry

MODES = ("off", "warm", "predict")


class NextTurnReplayer(Replayer):
    def __init__(self, tiers: Sequence[tuple[str, int]], kv_bytes_per_token: int, block_tokens: int,
                 mode: str, *, lead_s: float = 1.0, tpot_s: float = 0.02) -> None:
        super().__init__(tiers, kv_bytes_per_token, block_tokens, policy=TierPolicy())
        if mode not in MODES:
            raise ValueError(f"next-turn mode {mode!r}: one of {', '.join(MODES)}")
        self.mode = mode
        self.tpot_s = tpot_s
        self.predictor = NextTurnPredictor(lead_s=lead_s)
        self.found_chunks = 0
        self.resident_chunks = 0
        self.read_ahead_bytes = 0
        self.wasted_bytes = 0
        self._ahead: set[bytes] = set()  # read ahead into DRAM, not read since
        self.tiers[0].table.listeners.append(self._left_dram)

    def serve(self, request: TraceRequest) -> list[int]:
        now = request.arrival_s
        for chain in self.predictor.due(now):
            self._read_ahead(list(chain))
        keys = list(request.keys)
        usable = keys[: min(len(keys), (request.input_tokens - 1) // self.block_tokens)]
        run = next((i for i, key in enumerate(usable) if not self._held(key)), len(usable))
        self.found_chunks += run
        self.resident_chunks += sum(key in self.tiers[0] for key in usable[:run])
        self._ahead.difference_update(usable[:run])
        if self.mode == "predict":
            self.predictor.arrived(keys, now)
        found = super().serve(request)
        end = now + request.output_tokens * self.tpot_s
        if self.mode == "predict":
            self.predictor.finished(keys, end)
        elif self.mode == "warm":  # promoted at the finish itself
            self.predictor.expect(keys, end + self.predictor.lead_s)
        return found

    def _read_ahead(self, chain: list[bytes]) -> None:
        run = next((i for i, key in enumerate(chain) if not self._held(key)), len(chain))
        keys = chain[:run]
        before = {key for key in keys if key in self.tiers[0]}
        found = [next(i for i, t in enumerate(self.tiers) if key in t) for key in keys]
        self._promote(found, keys, [None, *keys[:-1]], "prefetch")
        moved = [key for key in keys if key not in before and key in self.tiers[0]]
        self._ahead.update(moved)
        self.read_ahead_bytes += len(moved) * self.chunk_bytes
        self.tiers[0].table.touch_chain(keys)

    def _left_dram(self, published: bool, entry: Entry) -> None:
        if not published and entry.key in self._ahead:
            self._ahead.discard(entry.key)
            self.wasted_bytes += self.chunk_bytes

    def result(self) -> dict[str, Any]:
        result = super().result()
        wasted = self.wasted_bytes + len(self._ahead) * self.chunk_bytes
        result.update(next_turn=self.mode,
                      dram_resident_at_arrival=self.resident_chunks / max(1, self.found_chunks),
                      prefetch_read_bytes=self.read_ahead_bytes, prefetch_wasted_bytes=wasted,
                      prefetch_wasted_fraction=wasted / max(1, self.read_ahead_bytes))
        return result
