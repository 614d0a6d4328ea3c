"""`kvstore verify`'s judging, on made-up replies (its run against real servers is in
docs/verify.md; the multimodal case's engine test is tests/test_vllm_multimodal.py)."""

from __future__ import annotations

import pytest

from bench.commands.verify import CASES, _first_image, check
from bench.support.openai_server import ChatReply, Completion
from bench.support.tiny_vlm import image_message


def reply(prompt: list[int]) -> ChatReply:
    return ChatReply("", prompt, [1], 0, 0.0, 0.0, [{1: -0.1}])


def test_the_first_image_is_the_first_run_of_placeholders_or_the_first_difference():
    text, image = [5, 6, 7, 8], [9] * 4
    same = [reply(text + image + [3] + image), reply(text + image + [3] + image)]
    assert _first_image(same) == 4
    assert _first_image([reply([5, 6, 7]), reply([5, 6, 8])]) == 2


def test_a_reply_passes_only_if_close_and_within_what_it_may_share():
    expected = Completion([1, 2], 0, 10, 0.0, top_logprobs=[{1: -0.1}, {2: -0.1, 3: -0.2}])
    tie = Completion([1, 3], 256, 10, 0.0, top_logprobs=[{1: -0.1}, {3: -0.1, 2: -0.15}])
    assert "near-tie at token 1" in check(tie, expected, 256, must_load=256)
    with pytest.raises(AssertionError, match="served chunks the first request stored"):
        check(tie, expected, 0)
    with pytest.raises(AssertionError, match="expected 512"):
        check(tie, expected, 512, must_load=512)
    wrong = Completion([1, 4], 0, 10, 0.0, top_logprobs=[{1: -0.1}, {4: -0.1}])
    with pytest.raises(AssertionError, match="DIVERGED at token 1"):
        check(wrong, expected, 0)


def test_every_case_the_issue_names_is_there():
    assert [name for name, _ in CASES] == ["images", "image offsets", "lora", "cache salt", "long prompt",
                                           "killed write", "disk full", "weights"]


def test_a_message_takes_text_and_images_in_turns():
    message = image_message("before", "data:image/png;base64,AA", "middle", "data:image/png;base64,BB", "")
    content = message[0]["content"]
    assert [part["type"] for part in content] == ["text", "image_url", "text", "image_url"]
    assert content[3]["image_url"]["url"].endswith("BB")
