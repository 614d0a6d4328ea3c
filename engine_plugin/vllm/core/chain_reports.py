"""What the scheduler tells the service about chains: a hint's expected arrival, and a
request's end with what is known of it (kvstore/tiers/return_rates.RequestEnd: its answer's
tokens, its turn and how long the chain it continues sat idle), which the service's
next-turn prediction and `learned` disk admission learn from.

A request's turn and idle time are worked out when it is first planned
(ChainHistory.arrived: the deepest earlier end its keys continue); the scheduler keeps them
with the request until it ends. Invariants: nothing is told without a `notify`; a request
that stored nothing tells nothing (there is no chain to continue).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvstore.service.client_types import MAX_TOKENS, ChainHistory, RequestEnd


class Notify(Protocol):
    """Tell the service about a chain: ("finished", keys per rank, 0, how it ended) when a
    request ends (its next turn is expected), ("expect", keys per rank, in_s) for a hint,
    ("await", keys per rank, within_s) for chunks a held request waits for (handoff.py)."""

    def __call__(self, kind: str, ranks: list[list[bytes]], in_s: float, /,
                 end: RequestEnd | None = None) -> None: ...


class ChainReports:
    def __init__(self, notify: Notify | None, chunk_tokens: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._notify = notify
        self.chunk_tokens = chunk_tokens
        self._clock = clock
        self.chains = ChainHistory()

    def expect(self, ranks: list[list[bytes]], in_s: float) -> None:
        """A hint: these chains are wanted in `in_s` seconds."""
        if self._notify is not None:
            self._notify("expect", ranks, in_s)

    def planned(self, keys: Sequence[bytes]) -> tuple[int, float | None]:
        """A request of these keys (one rank's) is planned now: its turn and idle seconds."""
        return self.chains.arrived(keys, self._clock())

    def ended(self, stored: list[list[bytes]], tokens: int, prompt_tokens: int,
              turn_idle: tuple[int, float | None]) -> None:
        """A request planned with `turn_idle` ended holding `tokens` tokens (`prompt_tokens`
        of them its prompt's), its chunks `stored` per rank: noted as an end a next turn may
        continue, and told."""
        turn, idle_s = turn_idle
        chain = stored[0] if stored else []
        if not chain or self._notify is None:
            return
        turn = min(turn, MAX_TOKENS)
        prompt_end = chain[: prompt_tokens // self.chunk_tokens][-1:]  # a next turn holds it
        self.chains.ended([*prompt_end, chain[-1]], turn, self._clock())
        answer = min(MAX_TOKENS, max(0, tokens - prompt_tokens))
        self._notify("finished", stored, 0.0, RequestEnd(answer, turn, idle_s))
