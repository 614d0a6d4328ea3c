"""The connector's scheduler role: its link to the service for lookups, the
engine-agnostic SchedulerCore, and what a vLLM request tells them (salt, prefetch
hints, a prefill instance's hand-off, KV events for routers)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from connectors.groups import GroupRules
from connectors.handoff import Handoff
from connectors.link import ServiceLink
from connectors.options import ConnectorOptions
from connectors.prefetch import Residency
from connectors.scheduler_side import Saves, SchedulerCore, SchedulerSettings
from engine_plugin.kv_events import RouterEvents
from kvstore.format.keys import KVNamespace
from kvstore.service.client import StoreClient

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvstore")


class SchedulerRole:
    """`core` decides what to load and save; this feeds it lookups and requests and
    reports its counters and ends to the service. Never fatal: a service that fails
    a lookup is a miss."""

    def __init__(self, options: ConnectorOptions, block_size: int,
                 namespaces: Callable[[str], Sequence[KVNamespace]], rules: GroupRules | None,
                 tp_world: int, saves: bool, kv_events: bool) -> None:
        store = options.store
        self._namespaces, self._rules, self._tp_world = namespaces, rules, tp_world
        # A lookup blocks the scheduler: its deadline is short, not the I/O deadline.
        self.link = ServiceLink(lambda: StoreClient(store, timeout_s=options.lookup_timeout_s))
        self.link.start()  # starts the service if needed: config errors surface now
        kept: Saves = ("answers" if options.save_answers else "prompts") if saves else "none"
        settings = SchedulerSettings(load_async=options.load_async, prefetch=options.prefetch,
                                     stage_on_arrival=options.device_staging > 0,
                                     wait_for_saves_s=options.wait_for_saves_s, saves=kept,
                                     handoff_wait_s=options.pd_wait_s, groups=rules)
        self.core = SchedulerCore(store.chunk_tokens, block_size, namespaces, self._lookup, settings,
                                  notify=self._notify)
        self.router_events = RouterEvents(store.chunk_tokens, block_size, self.link) if kv_events else None

    def _lookup(self, keys: list[list[bytes]], prefetch: bool) -> Residency:
        client = self.link.get()
        if client is None:
            return Residency(0, 0)
        try:
            return Residency(*client.residency_ranks(keys, prefetch=prefetch))
        except Exception as exc:  # the cache must never take the scheduler down
            log.warning("kvstore lookup failed (%s); treating as a miss", exc)
            self.link.fail()
            return Residency(0, 0)

    def _notify(self, kind: str, keys: list[list[bytes]], in_s: float) -> None:
        """A request ended (`finished`) or a hint expects chunks later (`expect`): told to
        the service's next-turn prediction; never fatal."""
        client = self.link.get()
        if client is None:
            return
        try:
            if kind == "finished":
                client.finished(keys)
            else:
                client.expect(keys, in_s)
        except Exception as exc:
            log.debug("kvstore: %s not told to the service (%s)", kind, exc)

    def arrive(self, request: Request) -> None:
        """Arrival: start promoting its stored chunks, and those of any hinted tokens
        (kv_transfer_params {"kvstore_prefetch_token_ids": [[...], ...]}, or vLLM's KV
        hints: a `fetch` action now, an `expect` action `in_s` seconds ahead)."""
        salt = request_salt(request)
        if self.router_events is not None:
            groups = self._rules.groups if self._rules is not None else (None,)
            per_group = self._namespaces(salt)[:: self._tp_world]  # rank 0's of each group
            self.router_events.remember(request, list(zip(per_group, groups, strict=True)))
        handoff = Handoff.from_params(request.kv_transfer_params)
        if handoff is not None:  # handed off by a prefill instance: wait for its chunks
            self.core.expect_handoff(request.request_id, handoff)
        self.core.on_arrival(request.request_id, request.prompt_token_ids or [], salt)
        for tokens in hinted_token_ids(request):
            self.core.hint(tokens, salt)
        for tokens, in_s in kv_hint_actions(request):
            if in_s is None:
                self.core.hint(tokens, salt)
            else:
                self.core.expect(tokens, in_s, salt)

    def report_counters(self) -> None:
        """Scheduler-side counters (prefetch timeliness, holds for in-flight saves) go to
        the service (kvstore info, Prometheus)."""
        pending = self.core.counters or (self.core.prefetch is not None and self.core.prefetch.counters)
        client = self.link.get() if pending else None
        if client is None:
            return
        counters = self.core.take_counters()
        try:
            client.count(counters)
        except Exception as exc:
            log.debug("kvstore: scheduler counters not reported (%s)", exc)


def hinted_token_ids(request: Request) -> list[list[int]]:
    """Token lists a request's kv_transfer_params announce (a future turn's prefix)."""
    hint = (request.kv_transfer_params or {}).get("kvstore_prefetch_token_ids")
    if not hint:
        return []
    lists = hint if isinstance(hint[0], list) else [hint]
    return [[int(t) for t in tokens] for tokens in lists]


def kv_hint_actions(request: Request) -> list[tuple[list[int], float | None]]:
    """vLLM's KV hints (`request.kv_hints`, a KvHintsEnvelope) that kvstore acts on:
    action_type `fetch` ({"token_ids": [...]}: promote now) and `expect`
    ({"token_ids": [...], "in_s": N}: wanted in N seconds); others are ignored."""
    envelope = getattr(request, "kv_hints", None)
    found: list[tuple[list[int], float | None]] = []
    for action in getattr(envelope, "actions", None) or ():
        tokens = action.payload.get("token_ids") if isinstance(action.payload, dict) else None
        if not tokens or action.action_type not in ("fetch", "expect"):
            continue
        in_s = action.payload.get("in_s") if action.action_type == "expect" else None
        found.append(([int(t) for t in tokens], None if in_s is None else float(in_s)))
    return found


def request_salt(request: Request) -> str:
    """What changes a prompt's KV besides its tokens: LoRA adapter, cache salt."""
    lora = request.lora_request.lora_name if request.lora_request else ""
    return f"{lora}|{request.cache_salt or ''}" if lora or request.cache_salt else ""
