"""Multi-turn chats over an OpenAI-compatible server, and what each turn could reuse.

A turn's prompt is the previous prompt + the previous answer + the new message (the
chat template's end-of-turn and role tokens between them). What a KV cache can serve
of it is bounded by the longest prefix it shares with the previous turn's prompt and
answer, less the answer's last token (sampled, never fed back, so its KV was never
computed), cut to whole chunks, and at least one prompt token must be computed. A
turn whose answer text re-tokenizes differently from the tokens generated shares a
shorter prefix: `common` shows it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from bench.support.openai_server import ChatReply, chat

# A long system prompt, as agents and assistants with instructions have: a prefix every
# turn shares. Deterministic, so runs compare turn for turn.
SYSTEM_PROMPT = "You are a helpful assistant for a city guide. Answer in full sentences. " + " ".join(
    f"Fact {i}: district {i} has {i * 7 % 13 + 1} parks and {i * 5 % 11 + 2} museums." for i in range(110))
QUESTIONS = ("Tell me about the history of Paris in detail.", "And what about Berlin?",
             "Which of the two is older?", "Summarize both cities in a few sentences.")


@dataclass
class Turn:
    question: str
    answer: str
    prompt_tokens: int
    answer_tokens: int
    cached_tokens: int  # what the server reported it did not compute
    common: int  # prompt tokens shared with the previous turn's prompt + answer
    bound: int  # the most a cache of whole chunks could serve (see the module docstring)
    ttft_s: float
    seconds: float
    token_ids: list[int] = field(default_factory=list)  # the answer's, as generated
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per answer token (answers.py)


def reuse_bound(previous: ChatReply | None, reply: ChatReply, chunk_tokens: int) -> tuple[int, int]:
    """(tokens shared with the previous turn, the whole-chunk bound on what a cache serves)."""
    if previous is None:
        return 0, 0
    before = previous.prompt_token_ids + previous.token_ids
    prompt = reply.prompt_token_ids
    common = next((i for i, (a, b) in enumerate(zip(before, prompt, strict=False)) if a != b),
                  min(len(before), len(prompt)))
    usable = min(common, len(before) - 1, len(prompt) - 1)
    return common, usable // chunk_tokens * chunk_tokens


def converse(url: str, model: str, questions: tuple[str, ...] = QUESTIONS, *, max_tokens: int = 300,
             chunk_tokens: int = 256, system: str = SYSTEM_PROMPT, answers: list[str] | None = None,
             gap_s: float = 0.0) -> list[Turn]:
    """One conversation, each turn sent `gap_s` after the previous reply (0: at once).
    `answers`: put these in the history instead of the replies, so another server sees
    exactly the prompts an earlier run saw."""
    messages = [{"role": "system", "content": system}]
    turns: list[Turn] = []
    previous: ChatReply | None = None
    for i, question in enumerate(questions):
        if i and gap_s:
            time.sleep(gap_s)
        messages.append({"role": "user", "content": question})
        reply = chat(url, model, messages, max_tokens)
        common, bound = reuse_bound(previous, reply, chunk_tokens)
        turns.append(Turn(question, reply.text, len(reply.prompt_token_ids), len(reply.token_ids),
                          reply.cached_tokens, common, bound, reply.ttft_s, reply.seconds,
                          reply.token_ids, reply.top_logprobs))
        messages.append({"role": "assistant", "content": answers[i] if answers else reply.text})
        previous = reply
    return turns
