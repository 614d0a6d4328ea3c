"""The namespaces one vLLM engine keys its chunks in, and their generations.

One namespace per KV cache group and tensor-parallel rank (group-major, as SchedulerCore
and the plan expect), for each request salt (LoRA adapter, cache salt); all share the
engine's model, KV format and weights (kvstore/format/keys.py: Weights). A weight update
in the running engine (vLLM resets its prefix cache with the connector's) moves every one
of them to a new generation: a random nonce, so two engines that updated differently never
meet, and nothing stored under the old weights is found again by this engine.

Every distinct salt of an HTTP request makes namespaces, so they are kept for the
MAX_SALTS salts used last only, and so are those not yet announced to the service: a salt
used again after it was forgotten makes its namespaces again, and they are announced
again (the service keeps a namespace's first announcement; another changes nothing).
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine_plugin.vllm.core.groups import GroupRules
from engine_plugin.vllm.core.options import ConnectorOptions
from engine_plugin.vllm.kv_spec import first_group_spec, layout_signature, record_dtype_name, spec_dtype
from engine_plugin.vllm.request_keys import model_weights
from kvstore.format.keys import KVNamespace, Shard, TensorParallel, Weights

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

MAX_SALTS = 1024  # salts whose namespaces an engine keeps made (a few hundred bytes each per rank)


class EngineNamespaces:
    """`namespaces(salt)`: the request's namespaces under the current generation;
    `new_generation()` starts the next one; `unannounced` and `announced`: those not told
    to the service yet. `base` holds the engine-wide fields."""

    def __init__(self, base: KVNamespace, groups: Sequence[str], tp_world: int) -> None:
        self.base = base
        self.groups = tuple(groups)
        self.tp_world = tp_world
        self._made: OrderedDict[tuple[str, KVNamespace], tuple[KVNamespace, ...]] = OrderedDict()
        # Made and not yet announced to the service (kvstore/service/namespaces.py), in order.
        self._unannounced: dict[KVNamespace, None] = {}

    @classmethod
    def of_engine(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, options: ConnectorOptions,
                  rules: GroupRules | None, name_weights: bool) -> EngineNamespaces:
        """The engine's: its model id (`model_id`, else the model path), KV dtype, layout
        signature, chunk size, groups and ranks; its weights named where `name_weights`
        (the scheduler, which plans every transfer; workers need no fingerprint)."""
        weights = Weights(model_weights(vllm_config, options.model_revision)) if name_weights else Weights()
        base = KVNamespace(options.model_id or str(vllm_config.model_config.model),
                           record_dtype_name(spec_dtype(first_group_spec(kv_cache_config))),
                           layout_signature(vllm_config, kv_cache_config), options.store.chunk_tokens,
                           weights=weights)
        groups = [g.signature for g in rules.groups] if rules is not None else [""]
        return cls(base, groups, vllm_config.parallel_config.tensor_parallel_size)

    def __call__(self, salt: str) -> tuple[KVNamespace, ...]:
        key = (salt, self.base)
        made = self._made.get(key)
        if made is not None:
            self._made.move_to_end(key)
            return made
        made = tuple(dataclasses.replace(self.base, shard=Shard(TensorParallel(rank, self.tp_world), group),
                                         salt=salt)
                     for group in self.groups for rank in range(self.tp_world))
        self._made[key] = made
        self._unannounced.update(dict.fromkeys(made))
        if len(self._made) > MAX_SALTS:  # the salt used least recently is forgotten
            for namespace in self._made.popitem(last=False)[1]:
                self._unannounced.pop(namespace, None)
        return made

    def unannounced(self, most: int) -> list[KVNamespace]:
        """At most `most` of the namespaces made and not yet announced, oldest first."""
        return list(itertools.islice(self._unannounced, most))

    def announced(self, namespaces: Sequence[KVNamespace]) -> None:
        """These were told to the service."""
        for namespace in namespaces:
            self._unannounced.pop(namespace, None)

    @property
    def weights(self) -> Weights:
        return self.base.weights

    def new_generation(self) -> Weights:
        """The same weights' fingerprint under a fresh random generation."""
        weights = Weights(self.base.weights.fingerprint, secrets.token_hex(8))
        self.base = dataclasses.replace(self.base, weights=weights)
        return weights
