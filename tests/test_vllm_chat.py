"""A real conversation through vLLM's OpenAI server: every turn finds the last one's answer.

The model is a real chat model (SmolLM2-135M-Instruct, bench/support/chat_model.py), the
requests are /v1/chat/completions through its chat template, each turn sent the moment
the previous reply arrives, vLLM's own prefix cache off on the kvstore server so every
hit is kvstore's. From turn 2 on the cached tokens must reach the prompt + answer bound
(bench/support/conversation.py; one chunk of slack for the end of an answer), not just what the
previous prompt covered (which is all a cache of prompts gives, issue 19's table).

The reference is a server without kvstore with vLLM's own prefix cache on, fed the same
history: its first turn is a cold computation, so the cold answers must be the same
tokens and logprobs (a cache must not change an answer it did not serve); its later
turns hit vLLM's own cache at block boundaries, and kvstore's answers are judged against
those as vLLM's tests judge answers (bench/support/answers.py: the same greedy tokens, or a
near-tie at the first difference; docs/vllm.md says why bit equality cannot be asked).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engines import assert_close
from support.services import service_config, stop_service

from bench.support.answers import identical
from bench.support.chat_model import WheelUnavailable, build_chat_model, default_chat_model_dir
from bench.support.conversation import QUESTIONS, converse
from bench.support.openai_server import OpenAIServer

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

CHUNK = 256
ARGS = ["--dtype", "float16", "--enable-prompt-tokens-details", "--max-model-len", "8192", "--enforce-eager",
        "--served-model-name", "chat"]


@pytest.fixture(scope="module")
def model() -> Path:
    pytest.importorskip("gguf", reason="needs gguf (the vllm extra)")
    try:
        return build_chat_model(default_chat_model_dir())
    except WheelUnavailable as exc:
        pytest.skip(str(exc))


def test_every_turn_finds_the_previous_answer_and_answers_stay_those_of_vllm(model, tmp_path, disk_dir):
    config = service_config(tmp_path, chunk_tokens=CHUNK, dram="1GiB", disk_dir=disk_dir, disk="1GiB",
                            staging="64MiB")
    try:
        with OpenAIServer(model, [*ARGS, "--no-enable-prefix-caching"], tmp_path / "kvstore.log",
                          connector={"config": config}, kv_cache_gib=2) as server:
            turns = converse(server.url, "chat", QUESTIONS, chunk_tokens=CHUNK)
    finally:
        stop_service(config)
    for i, turn in enumerate(turns[1:], start=2):
        assert turn.bound > 0, f"turn {i} shares nothing with turn {i - 1}: {turn}"
        assert turn.cached_tokens >= turn.bound - CHUNK, (
            f"turn {i}: {turn.cached_tokens} cached of a {turn.bound}-token bound "
            f"({turn.common} tokens shared with the previous prompt + answer)")
        previous = turns[i - 2]
        assert turn.cached_tokens > previous.prompt_tokens // CHUNK * CHUNK or turn.bound <= (
            previous.prompt_tokens // CHUNK * CHUNK), f"turn {i} found no chunk of the previous answer"

    with OpenAIServer(model, ARGS, tmp_path / "reference.log", kv_cache_gib=2) as reference:
        expected = converse(reference.url, "chat", QUESTIONS, chunk_tokens=CHUNK,
                            answers=[t.answer for t in turns])
    assert identical(turns[0], expected[0]), "kvstore changed a cold answer it did not serve"
    assert [t.prompt_tokens for t in turns] == [t.prompt_tokens for t in expected]
    for i, (turn, reference) in enumerate(zip(turns, expected, strict=True), start=1):
        assert_close(reference, turn, f"kvstore, turn {i}")
