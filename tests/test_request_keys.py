"""A vLLM request's chunk keys cover what vLLM's own block hashes cover: its images (by
content and offset, or by vLLM's identifier where the operator trusts client uuids) and
prompt embeddings; one the keys cannot name is not cached.

The requests are vLLM's own `Request` objects carrying vLLM's own processed multimodal
items, and the placeholders' spans are checked against vLLM's `_gen_mm_extra_hash_keys`,
chunk by chunk, so a change in how vLLM keys images shows up here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import xxhash
from support.collisions import xxh3_twins
from support.engines import processed_image

pytest.importorskip("vllm")

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import _gen_mm_extra_hash_keys
from vllm.v1.request import Request

from connectors.weights import FileDigests, fingerprint
from engine_plugin.vllm.namespaces import EngineNamespaces
from engine_plugin.vllm.request_keys import Unnamed, lora_identity, model_weights, request_extras
from kvstore.format.errors import ConfigError
from kvstore.format.keys import KVNamespace, Weights, chunk_keys

CHUNK = 16
NS = KVNamespace("m", "float16", "cpu", CHUNK)


def request(tokens: list[int] | None, images: list[tuple[str | None, int, int]] = (),  # type: ignore[assignment]
            embeds: torch.Tensor | None = None,
            data: list[MultiModalKwargsItem | None] | None = None) -> Request:
    """A vLLM request; image i's data is `data[i]` (default: an image seeded by its identifier)."""
    seeds = [sum(map(ord, ident or "")) for ident, _, _ in images]
    items = data if data is not None else [processed_image(seed) for seed in seeds]
    features = [MultiModalFeatureSpec(data=item, modality="image", identifier=ident,  # type: ignore[arg-type]
                                      mm_position=PlaceholderRange(offset, length))
                for (ident, offset, length), item in zip(images, items, strict=True)]
    return Request("r", tokens, SamplingParams(max_tokens=1), None, prompt_embeds=embeds,
                   mm_features=features)


def parse(extra: bytes) -> list[tuple[bytes, bytes]]:
    """A chunk's extra bytes as (tag, body) fields (the encoding of KeyExtras.chunk)."""
    fields, at = [], 0
    while at < len(extra):
        size = int.from_bytes(extra[at + 1 : at + 5], "little")
        fields.append((extra[at : at + 1], extra[at + 5 : at + 5 + size]))
        at += 5 + size
    return fields


images_st = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 40)),
                     max_size=3).map(lambda items: _laid_out(items))


def _laid_out(items: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """Images one after another with a gap of text between (vLLM's features are ordered)."""
    laid, at = [], 3
    for ident, length in items:
        laid.append((ident, at, length))
        at += length + 5
    return laid


@settings(max_examples=60, deadline=None)
@given(images_st, st.booleans())
def test_each_chunk_names_the_images_vllm_names_for_that_span(images, trust):
    """Each chunk names the images vLLM names for its span, at the same offsets: by vLLM's
    identifier where the operator trusts uuids, else by their content."""
    tokens = [7] * 128
    req = request(tokens, images)
    extras = request_extras(req, CHUNK, trust)
    by_content = {ident: request_extras(request([7] * 64, [(ident, 1, 2)]), CHUNK).placeholders[0].identifier
                  for ident, _, _ in images}
    for index in range(len(tokens) // CHUNK):
        start = index * CHUNK
        theirs, _ = _gen_mm_extra_hash_keys(req, start, start + CHUNK, 0)
        ours = [(body[:-8].decode(), int.from_bytes(body[-8:], "little", signed=True))
                for tag, body in parse(extras.chunk(index, CHUNK)) if tag == b"M"]
        named = {ident: f"uuid:{ident}" if trust else by_content[ident] for ident in by_content}
        assert ours == [(named[ident], offset) for _, ident, offset in theirs]


def test_an_image_is_named_by_its_content_not_by_the_uuid_a_client_gave_it():
    """The attack: a client sends its own image under the uuid another tenant's image uses
    (vLLM then takes the uuid as the image's identifier). By default the two requests share
    no key past the text before the image; only an operator's `trust_client_mm_uuids` makes
    the uuid the key, and then they do share them (what the setting's docs warn of)."""
    tokens = [5] * 96
    mine, theirs = request(tokens, [("tenant-uuid", 40, 20)], data=[processed_image(1)]), \
        request(tokens, [("tenant-uuid", 40, 20)], data=[processed_image(2)])
    keys = {name: [chunk_keys(tokens, NS, extras=request_extras(req, CHUNK, trust))
                   for req in (mine, theirs)] for name, trust in (("content", False), ("trusted", True))}
    assert keys["content"][0][:2] == keys["content"][1][:2] == chunk_keys(tokens, NS)[:2]
    assert not set(keys["content"][0][2:]) & set(keys["content"][1][2:])
    assert keys["trusted"][0] == keys["trusted"][1]
    same_image = request(tokens, [("another-uuid", 40, 20)], data=[processed_image(1)])
    assert chunk_keys(tokens, NS, extras=request_extras(same_image, CHUNK)) == keys["content"][0]


def test_a_request_keeps_its_keys_when_the_engine_lets_go_of_an_images_data():
    tokens = [5] * 96
    req = request(tokens, [("a", 40, 20)])
    first = request_extras(req, CHUNK)
    assert req.mm_features is not None
    req.mm_features[0].data = None
    assert request_extras(req, CHUNK) == first
    with pytest.raises(Unnamed) as caught:  # a request whose data never reached the scheduler
        request_extras(request(tokens, [("a", 40, 20)], data=[None]), CHUNK)
    assert caught.value.reason == "mm_data"


def test_a_text_request_keeps_its_text_keys():
    tokens = list(range(64))
    assert not request_extras(request(tokens), CHUNK)
    assert chunk_keys(tokens, NS, extras=request_extras(request(tokens), CHUNK)) == chunk_keys(tokens, NS)


def test_two_images_with_the_same_text_and_the_same_image_elsewhere_have_other_keys():
    tokens = [5] * 96  # the image's placeholder tokens are all alike
    keys = {name: chunk_keys(tokens, NS, extras=request_extras(request(tokens, [(ident, offset, 20)]), CHUNK))
            for name, ident, offset in (("a@40", "a", 40), ("b@40", "b", 40), ("a@44", "a", 44))}
    assert keys["a@40"][:2] == keys["b@40"][:2] == keys["a@44"][:2] == chunk_keys(tokens, NS)[:2]
    for one, other in (("a@40", "b@40"), ("a@40", "a@44"), ("b@40", "a@44")):
        assert not set(keys[one][2:]) & set(keys[other][2:])


def test_prompt_embeddings_are_keyed_by_their_values():
    torch.manual_seed(0)
    embeds = torch.randn(40, 8, dtype=torch.bfloat16)
    other = embeds.clone()
    other[35, 0] += 1  # the last, partial chunk differs
    zeros = [0] * 40  # vLLM's stand-in token ids for an embeddings prompt
    same = request(None, embeds=embeds.clone())
    a, b = request_extras(request(None, embeds=embeds), CHUNK), request_extras(same, CHUNK)
    assert a == b and len(a.embeds) == 3
    assert request_extras(same, CHUNK).embeds is b.embeds  # asked again: the digests come from its cache
    changed = request_extras(request(None, embeds=other), CHUNK)
    assert changed.embeds[:2] == a.embeds[:2] and changed.embeds[2] != a.embeds[2]
    keys = chunk_keys(zeros + [9] * 8, NS, extras=a)
    assert keys != chunk_keys(zeros + [9] * 8, NS)
    assert keys[:2] == chunk_keys(zeros + [9] * 8, NS, extras=changed)[:2]
    assert keys[2] != chunk_keys(zeros + [9] * 8, NS, extras=changed)[2]


def test_prompt_embeddings_built_to_collide_under_xxh3_get_keys_of_their_own():
    """The review's attack, rebuilt (support/collisions.py): two prompt-embedding tensors a
    few values apart that xxh3-128, kvstore's old key hash over what a chunk digest hashes
    (dtype, shape, values), gives one digest. Their chunk keys must differ."""
    rows = torch.zeros(CHUNK, 64, dtype=torch.float32)
    kind = f"{rows.dtype}|{tuple(rows.shape[1:])}|".encode()  # what the chunk digest hashes first
    one, other = xxh3_twins(kind, rows.numpy().tobytes())
    assert xxhash.xxh3_128_digest(kind + one) == xxhash.xxh3_128_digest(kind + other) and one != other
    tensors = [torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(CHUNK, 64)
               for raw in (one, other)]
    extras = [request_extras(request(None, embeds=t), CHUNK) for t in tensors]
    zeros = [0] * CHUNK
    assert chunk_keys(zeros, NS, extras=extras[0]) != chunk_keys(zeros, NS, extras=extras[1])


def test_an_image_without_an_identifier_is_not_cached_where_uuids_are_trusted():
    with pytest.raises(Unnamed) as caught:
        request_extras(request([1] * 32, [(None, 4, 8)]), CHUNK, trust_mm_uuids=True)
    assert caught.value.reason == "mm_input"
    assert request_extras(request([1] * 32, [(None, 4, 8)]), CHUNK).placeholders  # named by content


# -- which weights computed the KV -------------------------------------------------------

def _vllm_config(model: str, quantization: str | None = None, dtype: str = "torch.bfloat16",
                 cache_dtype: str = "auto", hf_overrides: object = None) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(model=model, model_weights="", revision=None,
                                                        quantization=quantization, dtype=dtype,
                                                        hf_overrides=hf_overrides or {}),
                           cache_config=SimpleNamespace(cache_dtype=cache_dtype))


def test_the_weights_are_named_by_revision_or_by_their_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    assert model_weights(_vllm_config(str(tmp_path)), "v7") == "rev:v7"  # type: ignore[arg-type]
    found = model_weights(_vllm_config(str(tmp_path)), None)  # type: ignore[arg-type]
    assert found == fingerprint(str(tmp_path), FileDigests(None))
    with pytest.raises(ConfigError, match="model_revision"):
        model_weights(_vllm_config(str(tmp_path / "nowhere")), None)  # type: ignore[arg-type]


def test_a_quantization_or_a_compute_dtype_the_cache_dtype_hides_names_other_weights(tmp_path):
    """The same files run with `--quantization fp8`, or filling an fp8 KV cache from bf16
    and from fp16 compute, make other KV: their namespaces differ. With neither (a cache
    of the compute dtype, no quantization) the identity is the checkpoint's alone, as before."""
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    plain = model_weights(_vllm_config(str(tmp_path)), None)  # type: ignore[arg-type]
    assert plain == fingerprint(str(tmp_path), FileDigests(None))
    assert model_weights(_vllm_config(str(tmp_path), dtype="torch.float16"), None) == plain  # type: ignore[arg-type]
    named = {model_weights(_vllm_config(str(tmp_path), quantization, dtype, cache), "v7")  # type: ignore[arg-type]
             for quantization in (None, "fp8") for dtype in ("torch.bfloat16", "torch.float16")
             for cache in ("auto", "fp8_e4m3")}
    assert named == {"rev:v7", "rev:v7|quant:fp8", "rev:v7|compute:bfloat16", "rev:v7|compute:float16",
                     "rev:v7|quant:fp8|compute:bfloat16", "rev:v7|quant:fp8|compute:float16"}


def test_config_overrides_name_other_weights(tmp_path):
    """`--hf-overrides` (a rope scaling, say) makes other KV from the same files: a mapping
    is named by its content, a function by its name; none leaves the identity as it was."""
    def longer(config: object) -> object:
        return config

    overrides = [None, {"rope_scaling": {"factor": 2.0}}, {"rope_scaling": {"factor": 4.0}}, longer]
    named = [model_weights(_vllm_config(str(tmp_path), hf_overrides=o), "v7") for o in overrides]  # type: ignore[arg-type]
    assert named[0] == "rev:v7" and len(set(named)) == 4, named
    again = {"rope_scaling": {"factor": 2.0}, "max_position_embeddings": None}
    assert model_weights(_vllm_config(str(tmp_path), hf_overrides=dict(reversed(again.items()))), "v7") == \
        model_weights(_vllm_config(str(tmp_path), hf_overrides=again), "v7") != named[1]  # type: ignore[arg-type]


def test_a_lora_adapter_is_named_by_its_files(tmp_path):
    (tmp_path / "adapter_model.safetensors").write_bytes(b"a")
    (tmp_path / "adapter_config.json").write_text("{}")
    lora = LoRARequest("sql", 1, str(tmp_path))
    named = lora_identity(lora)
    assert named == f"sql@{fingerprint(str(tmp_path), FileDigests(None))}"
    (tmp_path / "adapter_model.safetensors").write_bytes(b"b")  # rewritten in place, same name
    assert lora_identity(lora) != named
    assert lora_identity(LoRARequest("sql", 1, "/no/such/adapter")) == "sql@/no/such/adapter"


def test_a_new_generation_moves_every_namespace_and_no_two_engines_share_one():
    base = KVNamespace("m", "float16", "cpu", CHUNK, weights=Weights("xxh3:ab"))
    one, other = EngineNamespaces(base, [""], 2), EngineNamespaces(base, [""], 2)
    before = {ns.digest() for ns in one("") + one("salt")}
    assert {ns.digest() for ns in other("")} <= before  # same weights, same generation: shared
    one.new_generation()
    other.new_generation()
    after = {ns.digest() for ns in one("") + one("salt")}
    assert not before & after and len(after) == 4
    assert one.weights.fingerprint == "xxh3:ab" and one.weights.generation != other.weights.generation
    assert not after & {ns.digest() for ns in other("") + other("salt")}
