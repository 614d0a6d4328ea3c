"""What a vLLM request's KV depends on besides its token ids, for its chunk keys, and
which weights compute it (the namespace's `Weights`).

vLLM keys its own prefix cache with each block's extra keys
(`vllm/v1/core/kv_cache_utils.py::generate_block_hash_extra_keys`): the multimodal
inputs a block overlaps (`mm_features`: identifier and placeholder offset), the LoRA
adapter, the cache salt, and a digest of the block's prompt embeddings. kvstore keys
chunks the same way (kvstore/format/keys.py: KeyExtras): the LoRA adapter and cache
salt are in the namespace (request_salt), the rest are each chunk's extra bytes.

An image is named by its content, not by vLLM's identifier: a client may choose that
identifier (a chat request's `uuid`), and vLLM then uses it verbatim. vLLM trusts it for
one engine's lifetime; a key made of it would extend that trust to every engine of the
store and across restarts, so a client could put its image's KV under the uuid another
tenant's different image uses. The name is a SHA-256 of the processed inputs the model
reads (the feature's `data`, which the engine core holds when the request arrives):
what shapes the KV, whoever named it. Only an operator who sets
`trust_client_mm_uuids` gets vLLM's identifier in keys instead (uuids are then shared
keys across every engine and restart of the store; cache_salt isolates tenants).

A request whose inputs the key cannot name (a multimodal input without its data or its
placeholder range) raises Unnamed: it is neither loaded nor saved, and counted
(`keys.uncached_<reason>`). A request's extras are computed once, at its first lookup,
and kept for its life (weakly), so its keys never change while it runs.

The weights are named by the operator's `model_revision`, else by a fingerprint of the
checkpoint files vLLM loaded (connectors/weights.py); a LoRA adapter by its name and a
fingerprint of its files (vLLM keys it by name and path: a name re-pointed at another
adapter, or an adapter rewritten in place, must not meet the KV of the old one).
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from connectors.weights import WeightsUnknown, fingerprint, overrides_digest, weights_identity
from connectors.weights import numerics as weights_numerics
from kvstore.format.keys import KeyExtras, Placeholder, key_digest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvstore")


class Unnamed(ValueError):
    """The request carries something its chunk keys cannot name; `reason` is the
    counter's suffix."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


# Each request's extras, computed at its first lookup (arrival) and kept while it lives:
# it is asked for its keys again at each lookup and save, and hashing its inputs once
# keeps the keys the same even if the engine lets go of an input's data meanwhile.
_extras: weakref.WeakKeyDictionary[Any, tuple[tuple[int, bool], KeyExtras]] = weakref.WeakKeyDictionary()


def request_extras(request: Request, chunk_tokens: int, trust_mm_uuids: bool = False) -> KeyExtras:
    """The request's multimodal placeholders (named by content, or by vLLM's identifier
    where `trust_mm_uuids`) and prompt-embeddings digests, chunk by chunk; Unnamed if it
    carries an input the key cannot name."""
    asked = (chunk_tokens, trust_mm_uuids)
    cached = _extras.get(request)
    if cached is not None and cached[0] == asked:
        return cached[1]
    placeholders = []
    for feature in request.mm_features or ():
        position = getattr(feature, "mm_position", None)
        name = _identifier_name(feature) if trust_mm_uuids else _content_name(feature)
        try:
            placeholders.append(Placeholder(name, position.offset, position.length))  # type: ignore[union-attr]
        except (ValueError, AttributeError):
            raise Unnamed("mm_input", f"a multimodal input ({getattr(feature, 'modality', '?')}) without a "
                                      "placeholder range") from None
    extras = KeyExtras(tuple(sorted(placeholders, key=lambda p: p.offset)), _embeds(request, chunk_tokens))
    _extras[request] = (asked, extras)
    return extras


def _identifier_name(feature: Any) -> str:
    """`uuid:` and vLLM's identifier of a multimodal input (the client's uuid, where it sent
    one), kept apart from every content name."""
    identifier = getattr(feature, "identifier", None)
    if not isinstance(identifier, str) or not identifier:
        raise Unnamed("mm_input", f"a multimodal input ({getattr(feature, 'modality', '?')}) without an "
                                  "identifier")
    return f"uuid:{identifier}"


def _content_name(feature: Any) -> str:
    """`sha256:` and the digest of a multimodal input's processed data (each field by name,
    its batching kind, its tensors' dtype, shape and bytes): what the model reads of it."""
    data = getattr(feature, "data", None)
    if not isinstance(data, Mapping) or not data:
        raise Unnamed("mm_data", f"a multimodal input ({getattr(feature, 'modality', '?')}) whose data the "
                                 "scheduler does not hold: its content cannot be named")
    hasher = hashlib.sha256(f"{getattr(feature, 'modality', '')}|".encode())
    for name in sorted(data):
        element = data[name]
        _digest_part(hasher, name.encode())
        _digest_part(hasher, type(getattr(element, "field", None)).__name__.encode())
        _digest_nested(hasher, getattr(element, "data", element))
    return "sha256:" + hasher.hexdigest()


def _digest_nested(hasher: Any, value: Any) -> None:
    """A tensor, or a list or tuple of them (vLLM's NestedTensors), into `hasher`, tagged and
    length-prefixed so no two different values feed it the same bytes."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().to("cpu").contiguous()
        _digest_part(hasher, f"T{flat.dtype}|{tuple(flat.shape)}".encode())
        _digest_part(hasher, flat.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(value, list | tuple):
        _digest_part(hasher, f"L{len(value)}".encode())
        for item in value:
            _digest_nested(hasher, item)
    else:
        raise Unnamed("mm_data", f"a multimodal input holding a {type(value).__name__}: its content "
                                 "cannot be named")


def _digest_part(hasher: Any, part: bytes | memoryview) -> None:
    hasher.update(len(part).to_bytes(8, "little"))
    hasher.update(part)


def _embeds(request: Request, chunk_tokens: int) -> tuple[bytes, ...]:
    """SHA-256 (cut to a key's length) of each chunk's prompt embeddings (dtype and shape
    included), the last chunk's as far as the prompt goes; () without prompt embeddings."""
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return ()
    if not isinstance(embeds, torch.Tensor):
        raise Unnamed("prompt_embeds", f"prompt embeddings of type {type(embeds).__name__}")
    flat = embeds.detach().to("cpu").contiguous()
    raw = flat.reshape(flat.shape[0], -1).view(torch.uint8).numpy()
    kind = f"{flat.dtype}|{tuple(flat.shape[1:])}|".encode()
    return tuple(key_digest(kind, raw[start : start + chunk_tokens].data)
                 for start in range(0, flat.shape[0], chunk_tokens))


def model_weights(vllm_config: VllmConfig, revision: str | None) -> str:
    """The weights' identity (connectors/weights.py: weights_identity) of the checkpoint
    vLLM loaded (a Hugging Face id: its local snapshot at vLLM's revision), and what vLLM
    does to them besides (`numerics`)."""
    model = vllm_config.model_config
    checkpoint = weights_identity(model.model_weights or model.model, revision, model.revision)
    return checkpoint + numerics(vllm_config)


def numerics(vllm_config: VllmConfig) -> str:
    """What vLLM does to the checkpoint's weights besides (connectors/weights.py: numerics):
    its quantization, its compute dtype where the KV cache's dtype is not it, and its
    `--hf-overrides` (a mapping by its content, a function by its name)."""
    model = vllm_config.model_config
    own_dtype = vllm_config.cache_config.cache_dtype == "auto"
    compute = None if own_dtype else str(model.dtype).removeprefix("torch.")
    overrides = model.hf_overrides
    named = f"{overrides.__module__}.{overrides.__qualname__}" if callable(overrides) else overrides
    return weights_numerics(quant=model.quantization, compute=compute, overrides=overrides_digest(named))


def lora_identity(lora: LoRARequest) -> str:
    """`name@fingerprint` of a LoRA adapter's files (`name@path` where they cannot be read)."""
    try:
        return f"{lora.lora_name}@{fingerprint(lora.lora_path)}"
    except (WeightsUnknown, OSError):
        return f"{lora.lora_name}@{lora.lora_path}"
