"""Which earlier request a request continues: its turn, and how long its chain sat idle.

What a request that ends tells the service (return_rates.RequestEnd) is worked out from
chunk keys alone, the same way by the connector (connectors/chain_reports.py) and by the
trace replay (bench/support/replay.py): a request continues an earlier one when its keys contain a
key that request ended on (a next turn holds the last prompt and answer, then a new
message). Its turn is one more than that request's (0: it continues none: a new chain,
even on a system prompt others share), and its idle time runs from that request's end to
its own arrival.

Invariant: at most `capacity` ends are remembered, the oldest forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

ENDS = 1 << 16  # ends remembered by default


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
