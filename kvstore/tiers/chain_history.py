"""Which earlier request a request continues: its turn, and how long its chain sat idle.

What a request that ends tells the service (return_rates.RequestEnd) is worked out from
chunk keys alone, the same way by the connector (connectors/chain_reports.py) and by the
trace replay (bench/support/replay.py): a request continues an earlier one when its keys contain a
key that request ended on (a next turn holds the last prompt and answer, then a new
message). Its turn is one more than that request's (0: it continues none: a new chain,
even on a system prompt others share), and its idle time runs from that request's end to
its own arrival.

`InferredEnds` works the same out of puts alone, for engines whose backends report no
request end (SGLang's HiCache, LMCache's storage plugin and L2 adapter: their saves name a
chain's new chunks and the chunk before them, nothing else): a put continues the put that
ended on its parent, or on one of its own keys (a put of the whole chain); one within
SAME_REQUEST_S of that put is the same request saving on (a request's pages come in
several saves), a later one its next turn. Its answer is not known.

Invariant: at most `capacity` ends are remembered (by each), the oldest forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvstore.tiers.return_rates import MAX_TOKENS, RequestEnd

ENDS = 1 << 16  # ends remembered by default
SAME_REQUEST_S = 2.0  # a put continuing another this soon is the same request saving on


class ChainHistory:
    def __init__(self, capacity: int = ENDS) -> None:
        self.capacity = capacity
        self._ends: OrderedDict[bytes, tuple[int, float]] = OrderedDict()  # key ended on -> (turn, when)

    def arrived(self, keys: Sequence[bytes], now: float) -> tuple[int, float | None]:
        """(turn, idle seconds) of a request of `keys` arriving now; (0, None): a new chain."""
        for key in reversed(keys):  # the deepest end it continues
            known = self._ends.get(key)
            if known is not None:
                return known[0] + 1, max(0.0, now - known[1])
        return 0, None

    def ended(self, tails: Iterable[bytes], turn: int, now: float) -> None:
        """A request of turn `turn` ended now on these keys (its last; its prompt's last)."""
        for tail in tails:
            self._ends[tail] = (turn, now)
            self._ends.move_to_end(tail)
        while len(self._ends) > self.capacity:
            self._ends.popitem(last=False)


class InferredEnds:
    def __init__(self, capacity: int = ENDS) -> None:
        self.capacity = capacity
        # key a put ended on -> (turn, when, idle seconds, chunks in the chain up to it)
        self._ends: OrderedDict[bytes, tuple[int, float, float | None, int]] = OrderedDict()

    def put(self, keys: Sequence[bytes], parent: bytes | None, now: float) -> tuple[RequestEnd, int]:
        """A put of `keys` (`parent` before the first) now: how its request ended as far as
        can be told, and the chunks of its chain up to its last key."""
        chain = list(keys) if parent is None else [parent, *keys]
        turn, idle, chunks = 0, None, len(keys)
        for index in range(len(chain) - 1, -1, -1):  # the deepest end it continues
            known = self._ends.get(chain[index])
            if known is not None:
                last, when, last_idle, depth = known
                same = now - when <= SAME_REQUEST_S
                turn, idle = (last, last_idle) if same else (last + 1, max(0.0, now - when))
                chunks = depth + len(chain) - 1 - index
                break
        if keys:
            self._ends[keys[-1]] = (turn, now, idle, chunks)
            self._ends.move_to_end(keys[-1])
            while len(self._ends) > self.capacity:
                self._ends.popitem(last=False)
        return RequestEnd(None, min(turn, MAX_TOKENS), idle), chunks
