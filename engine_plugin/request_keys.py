"""What a vLLM request's KV depends on besides its token ids, for its chunk keys, and
which weights compute it (the namespace's `Weights`).

vLLM keys its own prefix cache with each block's extra keys
(`vllm/v1/core/kv_cache_utils.py::generate_block_hash_extra_keys`): the multimodal
inputs a block overlaps (`mm_features`: identifier and placeholder offset), the LoRA
adapter, the cache salt, and a digest of the block's prompt embeddings. kvstore keys
chunks the same way (kvstore/format/keys.py: KeyExtras): the LoRA adapter and cache
salt are in the namespace (request_salt), the rest are each chunk's extra bytes.

A request whose inputs the key cannot name (a multimodal input without an identifier)
raises Unnamed: it is neither loaded nor saved, and counted (`keys.uncached_<reason>`).

The weights are named by the operator's `model_revision`, else by a fingerprint of the
checkpoint files vLLM loaded (connectors/weights.py); a LoRA adapter by its name and a
fingerprint of its files (vLLM keys it by name and path: a name re-pointed at another
adapter, or an adapter rewritten in place, must not meet the KV of the old one).
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from connectors.weights import WeightsUnknown, fingerprint, weights_identity
from kvstore.format.keys import KeyExtras, Placeholder

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


# Prompt embeddings digests, per request (they do not change while it lives): a request
# is asked for its keys at arrival and again at each lookup.
_embeds_digests: weakref.WeakKeyDictionary[Any, tuple[int, tuple[bytes, ...]]] = weakref.WeakKeyDictionary()


def request_extras(request: Request, chunk_tokens: int) -> KeyExtras:
    """The request's multimodal placeholders and prompt-embeddings digests, chunk by chunk;
    Unnamed if it carries an input the key cannot name."""
    placeholders = []
    for feature in request.mm_features or ():
        identifier = getattr(feature, "identifier", None)
        position = getattr(feature, "mm_position", None)
        try:
            placeholders.append(Placeholder(identifier, position.offset, position.length))  # type: ignore[arg-type, union-attr]
        except (ValueError, AttributeError):
            raise Unnamed("mm_input", f"a multimodal input ({getattr(feature, 'modality', '?')}) without an "
                                      "identifier or placeholder range") from None
    return KeyExtras(tuple(sorted(placeholders, key=lambda p: p.offset)), _embeds(request, chunk_tokens))


def _embeds(request: Request, chunk_tokens: int) -> tuple[bytes, ...]:
    """xxh3-128 of each chunk's prompt embeddings (dtype and shape included), the last
    chunk's as far as the prompt goes; () without prompt embeddings."""
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return ()
    cached = _embeds_digests.get(request)
    if cached is not None and cached[0] == id(embeds):
        return cached[1]
    if not isinstance(embeds, torch.Tensor):
        raise Unnamed("prompt_embeds", f"prompt embeddings of type {type(embeds).__name__}")
    flat = embeds.detach().to("cpu").contiguous()
    raw = flat.reshape(flat.shape[0], -1).view(torch.uint8).numpy()
    kind = f"{flat.dtype}|{tuple(flat.shape[1:])}|".encode()
    digests = []
    for start in range(0, flat.shape[0], chunk_tokens):
        hasher = xxhash.xxh3_128(kind)
        hasher.update(raw[start : start + chunk_tokens].data)
        digests.append(hasher.digest())
    _embeds_digests[request] = (id(embeds), found := tuple(digests))
    return found


def model_weights(vllm_config: VllmConfig, revision: str | None) -> str:
    """The weights' identity (connectors/weights.py: weights_identity) of the checkpoint
    vLLM loaded (a Hugging Face id: its local snapshot at vLLM's revision)."""
    model = vllm_config.model_config
    return weights_identity(model.model_weights or model.model, revision, model.revision)


def lora_identity(lora: LoRARequest) -> str:
    """`name@fingerprint` of a LoRA adapter's files (`name@path` where they cannot be read)."""
    try:
        return f"{lora.lora_name}@{fingerprint(lora.lora_path)}"
    except (WeightsUnknown, OSError):
        return f"{lora.lora_name}@{lora.lora_path}"
