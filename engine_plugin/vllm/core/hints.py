"""What a request asks kvstore to warm ahead of time, validated before anything acts on it.

Two sources, both written by whoever sends the engine a request (an HTTP client, a
router, an orchestrator): `kv_transfer_params["kvstore_prefetch_token_ids"]` (one token
list or a list of them: prompts a future request will start with, promoted now) and
KV hint actions (`fetch` {"token_ids": [...]}: promote now; `expect` {"token_ids":
[...], "in_s": N}: wanted in N seconds). They are read on the engine's scheduler
thread, where an exception ends the engine, so a parser here never raises anything but
Malformed, which the caller counts and drops (kvstore/format/malformed.py).

Invariants of what comes out: at most MAX_HINTS hints per request (each costs a
synchronous lookup or message on the scheduler thread); every token list is non-empty,
at most `HintLimits.max_tokens` long (the model's context: a longer one is no prompt),
of ints in [0, vocab); `in_s` is finite, in [0, MAX_EXPECT_S].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.format.malformed import Malformed, finite

PREFETCH_KEY = "kvstore_prefetch_token_ids"
MAX_HINTS = 8
MAX_EXPECT_S = 86400.0  # a day: further ahead than any DRAM tier keeps a chunk


@dataclass(frozen=True)
class HintLimits:
    """What a token list must fit: the model's context length and vocabulary size."""

    max_tokens: int
    vocab: int


@dataclass(frozen=True)
class Hint:
    """Tokens a future request starts with; wanted in `in_s` seconds, or now (None)."""

    tokens: list[int]
    in_s: float | None = None


def prefetch_hints(params: Any, limits: HintLimits) -> list[Hint]:
    """The hints under PREFETCH_KEY of a request's kv_transfer_params ([] if absent or
    empty); Malformed (kind `kv_transfer_params`) if they are anything but token lists."""
    if params is None:
        return []
    if not isinstance(params, Mapping):
        raise Malformed("kv_transfer_params", f"must be a mapping, not {type(params).__name__}")
    value = params.get(PREFETCH_KEY)
    if value is None or (isinstance(value, list) and not value):
        return []
    if not isinstance(value, list):
        raise Malformed("kv_transfer_params", f"{PREFETCH_KEY} must be a list of token ids or of "
                                              f"token-id lists, not {type(value).__name__}")
    lists = value if isinstance(value[0], list) else [value]
    if len(lists) > MAX_HINTS:
        raise Malformed("kv_transfer_params", f"{PREFETCH_KEY} names {len(lists)} token lists; "
                                              f"at most {MAX_HINTS} are taken")
    return [Hint(token_ids(tokens, limits, "kv_transfer_params", PREFETCH_KEY)) for tokens in lists]


def action_hint(action_type: Any, payload: Any, limits: HintLimits) -> Hint | None:
    """The hint of one KV hint action: `fetch` and `expect` are kvstore's, others are
    another component's (None); Malformed (kind `kv_hints`) if kvstore's has a bad payload."""
    if action_type not in ("fetch", "expect"):
        return None
    if not isinstance(payload, Mapping):
        raise Malformed("kv_hints", f"a {action_type} action's payload must be a mapping")
    tokens = token_ids(payload.get("token_ids"), limits, "kv_hints", f"a {action_type} action's token_ids")
    if action_type == "fetch":
        return Hint(tokens)
    return Hint(tokens, finite(payload.get("in_s"), "kv_hints", "an expect action's in_s", 0.0, MAX_EXPECT_S))


def token_ids(value: Any, limits: HintLimits, kind: str, field: str) -> list[int]:
    """`value` as a non-empty token list within `limits`, else Malformed."""
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        raise Malformed(kind, f"{field} must be a non-empty list of token ids")
    if len(value) > limits.max_tokens:
        raise Malformed(kind, f"{field} holds {len(value)} tokens, more than the model's "
                              f"{limits.max_tokens}")
    if not all(type(t) is int for t in value):  # not bool, not float: 1e999 is inf
        raise Malformed(kind, f"{field} must hold integers only")
    if min(value) < 0 or max(value) >= limits.vocab:
        raise Malformed(kind, f"{field} holds a token id outside the vocabulary [0, {limits.vocab})")
    return list(value)
