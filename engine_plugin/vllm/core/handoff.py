"""Prefill/decode handoff through the store: what a producer tells a consumer, and how
long the consumer waits for it.

vLLM's disaggregated flow (its router, vllm-router): a prefill instance computes the
prompt with `max_tokens` 1 and returns `kv_transfer_params` in its reply; the router
sends the request on to a decode instance with those params. Through kvstore no KV
moves between the two: the producer names the chunks it stored (how many leading prompt
chunks, and the key of the last one), the consumer computes the same content keys from
the same prompt and holds the request ("ask again later", no KV blocks taken) until its
service finds that many chunks readable (its own tiers, or a peer's device through the
cluster index), at most `pd_wait_s`; then it loads what is there and recomputes the
rest. A wrong or late handoff costs recompute, never wrong tokens and never a hang.
The producer's saves may still be on their way when its reply reaches the consumer, so
a held request also has its service watch the index for the named chunks (a lookup's
`await_s`): a lookup backoff (an index read that failed or came late) would otherwise
hide chunks published meanwhile until the hold ran out.

The params sit under one key (PARAMS_KEY), so vLLM's MultiConnector can merge them with
another connector's without a clash; they carry no `do_remote_prefill`, which would make
vLLM report the prefill's cached tokens as the decode's.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine_plugin.vllm.core.chain_reports import Notify
from kvstore.config.store import StoreConfig
from kvstore.format.errors import ConfigError
from kvstore.format.malformed import Malformed, whole

PARAMS_KEY = "kvstore_handoff"
MAX_CHUNKS = 1 << 24  # more chunks than any context holds
MAX_HOST = 255
_HEX = re.compile(r"[0-9a-fA-F]+")
PRODUCER_ROLES = ("kv_producer", "kv_both")


@dataclass(frozen=True)
class Role:
    """What an instance does with the store, from vLLM's `kv_role`.

    vLLM: a kv_producer's KV goes to others, a kv_consumer's comes from others, kv_both
    is either. kvstore: every role loads what the store holds; a producer (and kv_both)
    saves and names its stored prompt chunks in kv_transfer_params when the request asks
    (`do_remote_decode`, as vLLM's router does; a kv_producer always does); a consumer
    saves nothing unless `pd_consumer_saves` (its prompts were saved by the producer; what it
    generates is not asked for again)."""

    name: str
    saves: bool
    always_hands_off: bool

    @classmethod
    def of(cls, kv_role: str | None, consumer_saves: bool) -> Role:
        name = kv_role or "kv_both"
        return cls(name, saves=name in PRODUCER_ROLES or consumer_saves,
                   always_hands_off=name == "kv_producer")

    def hands_off(self, request_params: Mapping[str, Any] | None) -> bool:
        """Does this request's reply carry a handoff?"""
        if self.name not in PRODUCER_ROLES:
            return False
        return self.always_hands_off or bool((request_params or {}).get("do_remote_decode"))


def check_producer_store(role: Role, store: StoreConfig) -> None:
    """A producer in a cluster must put its fresh chunks where peers read them (its disk
    tier, on the shared array): peers never read its DRAM, so under write-back a fresh
    chunk would reach them only when evicted."""
    if (role.name == "kv_producer" and store.cluster is not None and store.tiers.dram is not None
            and store.write_policy != "write_through"):
        raise ConfigError("write_policy", store.write_policy,
                          "a kv_producer with a DRAM tier in a cluster must write through "
                          "(write_policy: write_through), or consumers on other hosts cannot "
                          "read what it stored until it is evicted")


@dataclass(frozen=True)
class Handoff:
    """Leading prompt chunks stored by the producer, and rank 0's key of the last one."""

    chunks: int
    last_key: bytes
    host: str | None = None

    def params(self) -> dict[str, Any]:
        return {PARAMS_KEY: {"chunks": self.chunks, "last_key": self.last_key.hex(), "host": self.host}}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> Handoff | None:
        """The handoff in a request's kv_transfer_params, None if absent; Malformed (kind
        `handoff`) unless it is {"chunks": 1..MAX_CHUNKS, "last_key": 32 hex digits,
        "host": a short string or null}. It comes from an HTTP request: nothing else raises."""
        raw = params.get(PARAMS_KEY) if isinstance(params, Mapping) else None
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise Malformed("handoff", f"{PARAMS_KEY} must be a mapping")
        chunks = whole(raw.get("chunks"), "handoff", "chunks", 1, MAX_CHUNKS)
        key, host = raw.get("last_key"), raw.get("host")
        if not isinstance(key, str) or len(key) != 32 or not _HEX.fullmatch(key):
            raise Malformed("handoff", "last_key must be a 16-byte key as 32 hex digits")
        if host is not None and (not isinstance(host, str) or not 0 < len(host) <= MAX_HOST):
            raise Malformed("handoff", f"host must be a host id of 1 to {MAX_HOST} characters or null")
        return cls(chunks, bytes.fromhex(key), host)


@dataclass
class _Waiting:
    handoff: Handoff
    since: float | None = None


class HandoffWaits:
    """Consumer side: requests held until the chunks their producer named are readable.

    Counters (into `counters`): handoff.requests (requests that came with a handoff),
    handoff.ready (all named chunks readable at the first ask), handoff.waited and
    handoff.wait_ms (held, and for how long), handoff.expired (the deadline passed first:
    the rest is recomputed), handoff.mismatch (the named key is not this prompt's: another
    model id, salt or chunk size; nothing waited for). When a request is first held, the
    service is told to await the named chunks of every key list for the hold's length
    (`notify("await", ...)`)."""

    def __init__(self, wait_s: float, counters: Counter[str],
                 clock: Callable[[], float] = time.monotonic, notify: Notify | None = None) -> None:
        self.wait_s = wait_s
        self.counters = counters
        self._clock = clock
        self._notify = notify
        self._waiting: dict[str, _Waiting] = {}

    def expect(self, req_id: str, handoff: Handoff) -> None:
        self._waiting[req_id] = _Waiting(handoff)
        self.counters["handoff.requests"] += 1

    def held(self, req_id: str, keys: Sequence[Sequence[bytes]], stored: int, prompt_tokens: int,
             chunk_tokens: int) -> bool:
        """True while fewer than the named chunks (those a load may use: never the one
        holding the prompt's last token) are readable, up to wait_s from the first ask.
        `keys`: the request's key lists (one per group and rank), rank 0's first."""
        waiting = self._waiting.get(req_id)
        if waiting is None:
            return False
        handoff = waiting.handoff
        if handoff.chunks > len(keys[0]) or keys[0][handoff.chunks - 1] != handoff.last_key:
            self.counters["handoff.mismatch"] += 1
            del self._waiting[req_id]
            return False
        wanted = min(handoff.chunks, (prompt_tokens - 1) // chunk_tokens)
        now = self._clock()
        first = waiting.since is None
        waiting.since = now if waiting.since is None else waiting.since
        waited = now - waiting.since
        if stored < wanted and waited < self.wait_s:
            if first and self._notify is not None:
                self._notify("await", [list(k[:wanted]) for k in keys], self.wait_s)
            return True
        del self._waiting[req_id]
        if waited == 0:
            self.counters["handoff.ready"] += 1
        else:
            self.counters["handoff.waited"] += 1
            self.counters["handoff.wait_ms"] += round(waited * 1000)
        self.counters["handoff.expired"] += int(stored < wanted)
        return False

    def forget(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)
