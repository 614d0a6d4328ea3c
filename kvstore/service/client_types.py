"""The storage engine's types an engine's client side needs, in one place, so that code
outside kvstore/ reaches none of its floors below the service (a house rule): what a
request's end tells the service (`RequestEnd`, its `MAX_TOKENS`), the chain history
both the connector and the service work a request's turn out with (`ChainHistory`),
and the counters a client keeps and reports (`Stats`)."""

from kvstore.tiers.chain_history import ChainHistory
from kvstore.tiers.return_rates import MAX_TOKENS, RequestEnd
from kvstore.tiers.stats import Stats

__all__ = ["MAX_TOKENS", "ChainHistory", "RequestEnd", "Stats"]
