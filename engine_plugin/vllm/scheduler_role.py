"""The connector's scheduler role: its link to the service for lookups, the
engine-agnostic SchedulerCore, and what a vLLM request tells them (salt, prefetch
hints, a prefill instance's hand-off, KV events for routers)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from connectors.link import ServiceLink
from engine_plugin.vllm.core.groups import GroupRules, KVGeometry
from engine_plugin.vllm.core.handoff import Handoff, Role
from engine_plugin.vllm.core.hints import MAX_HINTS, Hint, HintLimits, action_hint, prefetch_hints
from engine_plugin.vllm.core.options import ConnectorOptions
from engine_plugin.vllm.core.prefetch import Residency
from engine_plugin.vllm.core.scheduler_side import Keying, Saves, SchedulerCore, SchedulerSettings
from engine_plugin.vllm.kv_events import RouterEvents
from engine_plugin.vllm.namespaces import EngineNamespaces
from engine_plugin.vllm.request_keys import Unnamed, lora_identity, request_extras
from kvstore.format.malformed import Malformed, MalformedCounts
from kvstore.service.client import StoreClient
from kvstore.service.client_types import RequestEnd
from kvstore.service.protocol import MAX_ANNOUNCED

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvstore")
MAX_ACTIONS = 8 * MAX_HINTS  # KV hint actions read per request (others' included)
# Loads a request may try: the engine recomputes a failed one and looks the request up again
# (what did not verify is gone from the store, so the rest of the prefix loads); after this
# many it is a miss, so a failure that recurs on every load cannot loop it.
LOAD_TRIES = 2
T = TypeVar("T")


class SchedulerRole:
    """`core` decides what to load and save; this feeds it lookups and requests and
    reports its counters and ends to the service. Never fatal: a service that fails
    a lookup is a miss; what a request asks for is validated (engine_plugin/vllm/core/hints.py,
    engine_plugin/vllm/core/handoff.py), a malformed part counted (`malformed.*`) and ignored; and the
    connector runs each vLLM hook through `guard`, so a fault is a miss for its request."""

    def __init__(self, options: ConnectorOptions, block_size: int,
                 namespaces: EngineNamespaces, rules: GroupRules | None,
                 saves: bool, kv_events: bool, limits: HintLimits, reporting_workers: int = 0) -> None:
        store = options.store
        self._namespaces, self._rules = namespaces, rules
        self.limits = limits
        self._trust_mm_uuids = options.trust_client_mm_uuids
        self._faults_logged: set[str] = set()
        self._abandoned: set[str] = set()  # faulted, or out of load tries: misses until they finish
        self._load_failures: Counter[str] = Counter()  # failed loads per request, until it finishes
        # A lookup blocks the scheduler: its deadline is short, not the I/O deadline.
        self.link = ServiceLink(lambda: StoreClient(store, timeout_s=options.lookup_timeout_s))
        self.link.start()  # starts the service if needed: config errors surface now
        kept: Saves = ("answers" if options.save_answers else "prompts") if saves else "none"
        settings = SchedulerSettings(load_async=options.load_async, sync_dram_loads=options.sync_dram_loads,
                                     prefetch=options.prefetch,
                                     stage_on_arrival=options.device_staging > 0,
                                     wait_for_saves_s=options.wait_for_saves_s, saves=kept,
                                     handoff_wait_s=options.pd_wait_s, reporting_workers=reporting_workers)
        self.core = SchedulerCore(KVGeometry(store.chunk_tokens, block_size, rules), namespaces, self._lookup,
                                  settings, notify=self._notify)
        self.router_events = RouterEvents(store.chunk_tokens, block_size, self.link) if kv_events else None
        self.malformed = MalformedCounts(log, self.core.counters)  # reported with the core's
        self._warned: set[str] = set()  # reasons a request went uncached, logged once each

    def guard(self, hook: str, req_id: str | None, call: Callable[..., T], *args: Any, fallback: T,
              blocks: Sequence[Sequence[int]] = ()) -> T:
        """`call(*args)` for vLLM's hook `hook`, or after a fault `fallback`: counted
        (`connector.faults`), logged once per hook (then at debug), and the request (if
        any) a miss until it finishes, its planned load given up whole (SchedulerCore.abandon;
        `blocks`: those vLLM allocated for a hit whose load was never planned)."""
        try:
            return call(*args)
        except Exception:
            first = hook not in self._faults_logged
            self._faults_logged.add(hook)
            (log.exception if first else log.debug)(
                "kvstore: %s failed%s; served without kvstore (counted as connector.faults%s)", hook,
                f" for request {req_id}" if req_id is not None else "", ", logged once" if first else "")
            self.core.counters["connector.faults"] += 1
        if req_id is not None:
            (self._abandoned.discard if hook == "request_finished" else self._abandoned.add)(req_id)
            try:
                self.core.abandon(req_id, blocks)
            except Exception:  # what it forgets may be what faulted: the plan is given up first
                log.debug("kvstore: request %s not wholly forgotten", req_id, exc_info=True)
        return fallback

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """get_num_new_matched_tokens: (tokens the store supplies, load async?), or (None,
        False): ask again later. An abandoned request is a miss (a fault that recurs on
        every lookup must not loop it between a planned load and a given-up one). Its
        counters go with the next lookup, or at the step's end (`workers_reported`)."""
        if request.request_id in self._abandoned:
            return 0, False
        try:
            extras = request_extras(request, self.core.chunk_tokens, self._trust_mm_uuids)
        except Unnamed:  # counted at arrival: neither loaded nor saved
            self.report_counters()
            return 0, False
        # The live token list: a resumed request looks up (and later saves) what it
        # generated too, and chunks decoding fills are saved as they complete.
        keying = Keying(request_salt(request), extras)
        count = self.core.num_new_matched_tokens(request.request_id, request.all_token_ids,
                                                 num_computed_tokens, keying)
        if count is None:
            return None, False
        return count, self.core.loads_async(request.request_id) and count > 0

    def finished(self, request: Request, role: Role, host: str | None) -> dict[str, Any] | None:
        """request_finished: forget it; a producer's reply names the prompt chunks it stored
        (saves may still be on their way: the consumer waits for them, engine_plugin/vllm/core/handoff.py)."""
        self._abandoned.discard(request.request_id)
        self._load_failures.pop(request.request_id, None)
        handoff = None
        if role.hands_off(request.kv_transfer_params):
            handoff = self.core.handoff(request.request_id, request.num_prompt_tokens, host)
        self.core.on_finished(request.request_id)
        return handoff.params() if handoff is not None else None

    def workers_reported(self, done_saves: list[int], failed_requests: Collection[str],
                         failed_blocks: Collection[int], finished_loads: Collection[str] = (),
                         loaded_steps: Collection[int] = (),
                         counters: Mapping[str, int] | None = None) -> None:
        """update_connector_output: saves done leave the in-flight set; the loads that ended
        give their leases back, read or, where they failed, unread (SchedulerCore.step_done),
        with the workers' counters (what their leased copies took);
        failed loads, as vLLM aggregated them over the workers, are counted: by request with
        several KV cache groups (`load.failed_requests`; one out of LOAD_TRIES is a miss
        until it finishes), else by block (`load.failed_blocks`, vLLM keeps the prefix
        before the first)."""
        # Leases first: a report lost to a fault after it would hold their DRAM for good.
        self.core.step_done(finished_loads, failed_requests, failed_blocks, loaded_steps)
        self.core.saves_done(done_saves)
        self.core.counters.update(counters or {})
        if not (failed_requests or failed_blocks):
            self.report_counters()
            return
        self._load_failures.update(failed_requests)
        self._abandoned.update(r for r in failed_requests if self._load_failures[r] >= LOAD_TRIES)
        counts = {"load.failed_requests": len(failed_requests), "load.failed_blocks": len(failed_blocks)}
        self.core.counters.update({name: count for name, count in counts.items() if count})
        self.report_counters()

    def _lookup(self, keys: list[list[bytes]], prefetch: bool, lease_from: int | None = None) -> Residency:
        """One lookup; it also gives back the leases done with and carries the counters
        pending (one round trip). A failed one drops the connection, and every lease with it."""
        client = self.link.get()
        if client is None:
            return Residency(0, 0)
        try:
            released = self.core.take_releases()
            found = client.lookup(keys, prefetch, lease_from, released.read, self.core.take_counters(),
                                  unread=released.unread)
        except Exception as exc:  # the cache must never take the scheduler down
            log.warning("kvstore lookup failed (%s); treating as a miss", exc)
            self.link.fail()
            return Residency(0, 0)
        return Residency(found.stored, found.resident, found.pending, found.lease, found.offsets)

    def _notify(self, kind: str, keys: list[list[bytes]], in_s: float,
                end: RequestEnd | None = None) -> None:
        """A request ended (`finished`, and how), a hint expects chunks later (`expect`), or
        a held request awaits a producer's chunks (`await`): told to the service (next-turn
        prediction, disk admission, the cluster index watch); never fatal."""
        client = self.link.get()
        if client is None:
            return
        try:
            if kind == "finished":
                client.finished(keys, end)
            elif kind == "await":  # a lookup that has the service await what it does not find
                client.residency_ranks(keys, await_s=in_s)
            else:
                client.expect(keys, in_s)
        except Exception as exc:
            log.debug("kvstore: %s not told to the service (%s)", kind, exc)

    def arrive(self, request: Request) -> None:
        """Arrival: start promoting its stored chunks, and those of any hinted tokens
        (kv_transfer_params {"kvstore_prefetch_token_ids": [[...], ...]}, or vLLM's KV
        hints: a `fetch` action now, an `expect` action `in_s` seconds ahead). A request
        whose inputs its keys cannot name is counted and left alone (request_keys.py)."""
        salt = request_salt(request)
        try:
            extras = request_extras(request, self.core.chunk_tokens, self._trust_mm_uuids)
        except Unnamed as exc:
            self.core.counters[f"keys.uncached_{exc.reason}"] += 1  # reported with the core's
            (log.debug if exc.reason in self._warned else log.warning)(
                "kvstore: request %s is neither loaded nor saved: %s", request.request_id, exc)
            self._warned.add(exc.reason)
            return
        if self.router_events is not None:
            groups = self._rules.groups if self._rules is not None else (None,)
            per_group = self._namespaces(salt)[:: self.core.ranks]  # rank 0's of each group
            self.router_events.remember(request, list(zip(per_group, groups, strict=True)), extras)
        try:
            handoff = Handoff.from_params(request.kv_transfer_params)
        except Malformed as exc:
            self.malformed.count(exc, "the request is served without waiting for a prefill")
            handoff = None
        if handoff is not None:  # handed off by a prefill instance: wait for its chunks
            self.core.expect_handoff(request.request_id, handoff)
        self.core.on_arrival(request.request_id, request.all_token_ids, Keying(salt, extras))
        for hint in request_hints(request, self.limits, self.malformed):
            if hint.in_s is None:
                self.core.hint(hint.tokens, salt)
            else:
                self.core.expect(hint.tokens, hint.in_s, salt)

    def report_counters(self) -> None:
        """Scheduler-side counters (prefetch timeliness, holds for in-flight saves) and the
        leases done with go to the service in one request (an empty lookup), where no lookup
        carried them; so do namespaces it has not been told of yet (described, for `kvstore
        purge`; told again after a failure)."""
        counters, released = self.core.take_counters(), self.core.take_releases()
        new = self._namespaces.unannounced(MAX_ANNOUNCED)  # the rest at the next report
        client = self.link.get() if counters or released.read or released.unread or new else None
        if client is None:
            return
        try:
            if new:
                client.announce([(ns.digest(), ns.description()) for ns in new])
                self._namespaces.announced(new)
            if counters or released.read or released.unread:
                client.lookup([], release=released.read, unread=released.unread, counters=counters)
        except Exception as exc:  # a lost connection released its leases too
            log.debug("kvstore: scheduler counters or namespaces not reported (%s)", exc)


def request_hints(request: Request, limits: HintLimits, malformed: MalformedCounts) -> list[Hint]:
    """The hints a request carries: its kv_transfer_params' prefetch token lists, then
    vLLM's KV hints (`request.kv_hints`, a KvHintsEnvelope: kvstore's `fetch` and `expect`
    actions; others are another component's). A malformed part is counted and skipped;
    past MAX_HINTS the rest are counted and dropped."""
    hints: list[Hint] = []
    try:
        hints += prefetch_hints(request.kv_transfer_params, limits)
    except Malformed as exc:
        malformed.count(exc)
    envelope = getattr(request, "kv_hints", None)
    actions = getattr(envelope, "actions", None) or ()
    actions = actions if isinstance(actions, list | tuple) else ()
    if len(actions) > MAX_ACTIONS:
        malformed.count(Malformed("kv_hints", f"{len(actions)} actions in one request"),
                        f"the first {MAX_ACTIONS} are read")
    for action in actions[:MAX_ACTIONS]:
        try:
            hint = action_hint(getattr(action, "action_type", None), getattr(action, "payload", None), limits)
        except Malformed as exc:
            malformed.count(exc)
            continue
        if hint is not None:
            hints.append(hint)
    if len(hints) > MAX_HINTS:
        malformed.count(Malformed("kv_hints", f"{len(hints)} hints in one request"),
                        f"the first {MAX_HINTS} are taken")
    return hints[:MAX_HINTS]


def request_salt(request: Request) -> str:
    """What changes a prompt's KV besides its tokens: LoRA adapter (by name and files), cache salt."""
    lora = lora_identity(request.lora_request) if request.lora_request else ""
    return f"{lora}|{request.cache_salt or ''}" if lora or request.cache_salt else ""
