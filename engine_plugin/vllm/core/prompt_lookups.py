"""What the store holds of a prompt: its chunk keys in a request's namespaces, and one answer
across tensor-parallel ranks and KV cache groups."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine_plugin.vllm.core.groups import KVGeometry
from engine_plugin.vllm.core.prefetch import Lookup, Residency
from kvstore.format.keys import KeyExtras, KVNamespace, chunk_keys


@dataclass(frozen=True)
class Keying:
    """What a request's keys depend on besides its token ids: the salt its namespaces
    take (LoRA adapter, cache salt) and its chunks' extras (images, prompt embeddings)."""

    salt: str = ""
    extras: KeyExtras | None = None


TOKENS_ONLY = Keying()  # keys of token ids alone: no salt, no extras


class PromptLookups:
    """Keys prompts and asks the store (`lookup`) what it holds of them.

    `namespaces(salt)` gives one namespace per tensor-parallel rank for a request's salt
    (with KV cache groups: one per group and rank, group-major, in `geometry.groups` order).

    Invariants:
    - A prompt's keys are made in the namespaces of now: one key list per group and rank.
    - A chunk counts as stored only where every rank holds it, and with KV cache groups
      where every group holds what a hit ending there needs (GroupRules.hit), at most `cap`.
    - Only a one-group lookup leases (`lease_from`): its answer names the DRAM run pinned.
    - Keys kept for a request (`keep`: computed at its arrival, or at an ask that held it)
      are the ones its next ask uses, so a request is hashed once; all are dropped when the
      namespaces change (`clear`), a request's when it is forgotten.
    """

    def __init__(self, geometry: KVGeometry, namespaces: Callable[[str], Sequence[KVNamespace]],
                 lookup: Lookup) -> None:
        self.geometry = geometry
        self.namespaces = namespaces
        self._lookup = lookup
        self.ranks = len(namespaces("")) // len(geometry.groups)
        self._kept: dict[str, list[list[bytes]]] = {}

    def keys(self, prompt: Sequence[int], keying: Keying) -> list[list[bytes]]:
        """The prompt's full chunks' keys, per group and rank."""
        return [chunk_keys(prompt, ns, extras=keying.extras) for ns in self.namespaces(keying.salt)]

    def residency(self, keys: list[list[bytes]], prefetch: bool, cap: int | None = None,
                  lease_from: int | None = None) -> Residency:
        """Leading chunks stored for every rank (and every group, at most `cap`); with
        `lease_from` (one group) the DRAM run from that chunk on leased for the workers."""
        if not keys[0]:
            return Residency(0, 0)
        rules = self.geometry.rules
        if rules is None:
            return self._lookup(keys, prefetch, lease_from)
        grouped = [keys[g * self.ranks : (g + 1) * self.ranks] for g in range(len(rules.groups))]
        return rules.hit(self._lookup, grouped, len(keys[0]) if cap is None else cap, prefetch)

    def kept(self, req_id: str) -> list[list[bytes]] | None:
        """The keys kept for `req_id`, if any (made in the namespaces of now)."""
        return self._kept.get(req_id)

    def keep(self, req_id: str, keys: list[list[bytes]]) -> None:
        self._kept[req_id] = keys

    def forget(self, req_id: str) -> None:
        self._kept.pop(req_id, None)

    def clear(self) -> None:
        """The namespaces changed (a new generation): every key kept is stale."""
        self._kept.clear()
