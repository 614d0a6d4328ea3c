"""Two runs' greedy answers judged as vLLM's own tests judge them, and judged exactly where
the two read the same KV bytes.

vLLM's `check_logprobs_close` (tests/models/utils.py in vLLM's repository) compares two
runs token by token: while the tokens are equal, go on; at the first token where they
differ, each side's token must be among the other side's top logprobs (5 here, as in
most of vLLM's model tests), and the comparison stops there: past a near-tie the two
sequences condition on different text, so nothing after it says anything. This is the
bar for a run with kvstore against one without (a hit computes the rest of the prompt
in a different split than a recompute, so the last bits of the logits move, as with
vLLM's own prefix cache). A divergence where either side's token is not in the other's
top 5 is not a near-tie: it is a wrong answer.

Two runs that loaded the same stored chunks (a DRAM load and a disk load of them) run
the same computation on the same bytes, so `identical` holds them to bit equality:
the same tokens and the same logprobs.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

TOP_LOGPROBS = 5  # how many logprobs per generated token every run asks for


class Answer(Protocol):
    """A run's greedy answer: its tokens, and for each the engine's top logprobs (token ->
    logprob; the chosen token among them). Tokens are ids, or whatever an engine names
    them by (SGLang's chat logprobs: text), the same on both sides of a comparison."""

    @property
    def token_ids(self) -> Sequence[Hashable]: ...

    @property
    def top_logprobs(self) -> Sequence[Mapping[Any, float]]: ...


@dataclass(frozen=True)
class Tokens:
    """An Answer built from plain lists (an engine run's JSON result)."""

    token_ids: Sequence[Hashable]
    top_logprobs: Sequence[Mapping[Any, float]]

    @classmethod
    def of(cls, result: Mapping[str, Any]) -> Tokens:
        """One result of an engine run (bench/support/engine_run.py), or an answer read
        back from JSON (token ids as text keys)."""
        return cls(result["token_ids"], [{int(token): value for token, value in step.items()}
                                         for step in result["top_logprobs"]])


@dataclass(frozen=True)
class Comparison:
    """How two answers compare. `position`: the first token where they differ (None: no
    token differs over the shorter length). `close`: vLLM's bar. `margins`: at
    `position`, how far ahead of the other side's token each side's own choice was in
    its own logprobs (None where the other's token was not in its top logprobs). Two
    answers of which one ends where the other goes on, equal as far as both go, are not
    close: the one that ended chose its end (a stop token an engine leaves out of the
    tokens) over the other's token, and nothing says by how much."""

    names: tuple[str, str]
    position: int | None
    close: bool
    margins: tuple[float | None, float | None] = (None, None)
    tokens: tuple[Hashable, Hashable] | None = None
    lengths: tuple[int, int] = (0, 0)

    @property
    def equal(self) -> bool:
        return self.position is None and self.lengths[0] == self.lengths[1]

    @property
    def verdict(self) -> str:
        """A few words: equal, a near-tie or a divergence and where."""
        if self.position is None:
            return "equal" if self.equal else "DIVERGED: one ends where the other goes on"
        return f"{'near-tie' if self.close else 'DIVERGED'} at token {self.position}"

    def describe(self) -> str:
        """One line: equal, a near-tie (where, and by how much), or a divergence."""
        a, b = self.names
        if self.position is None:
            if self.equal:
                return f"{a} and {b}: the same {self.lengths[0]} tokens"
            return (f"{a} and {b}: DIVERGED: the same tokens over {min(self.lengths)}, then one ends "
                    f"({self.lengths[0]} and {self.lengths[1]} tokens)")
        assert self.tokens is not None
        ta, tb = self.tokens

        def margin(value: float | None) -> str:
            return "not in its top 5" if value is None else f"{value:.3f} behind"

        kind = "near-tie" if self.close else "DIVERGED"
        return (f"{a} and {b}: {kind} at token {self.position}: {a} chose {ta} ({b}'s choice "
                f"{tb} {margin(self.margins[0])}), {b} chose {tb} ({a}'s choice {ta} "
                f"{margin(self.margins[1])})")


def compare(a: Answer, b: Answer, names: tuple[str, str] = ("a", "b")) -> Comparison:
    """vLLM's check_logprobs_close on one pair of answers."""
    lengths = (len(a.token_ids), len(b.token_ids))
    for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
        if ta == tb:
            continue
        top_a, top_b = _top(a, i), _top(b, i)
        margins = (_margin(top_a, ta, tb), _margin(top_b, tb, ta))
        return Comparison(names, i, ta in top_b and tb in top_a, margins, (ta, tb), lengths)
    return Comparison(names, None, lengths[0] == lengths[1], lengths=lengths)


def worst(comparisons: Iterable[Comparison]) -> Comparison:
    """Of several prompts' comparisons: the first divergence, else the first near-tie,
    else the first (all equal)."""
    every = list(comparisons)
    return next((c for c in every if not c.close), next((c for c in every if not c.equal), every[0]))


def identical(a: Answer, b: Answer) -> bool:
    """The same tokens and the same logprobs, to the bit: two runs on the same KV bytes."""
    return (list(a.token_ids) == list(b.token_ids)
            and [dict(t) for t in a.top_logprobs] == [dict(t) for t in b.top_logprobs])


def _top(answer: Answer, index: int) -> Mapping[Any, float]:
    return answer.top_logprobs[index] if index < len(answer.top_logprobs) else {}


def _margin(top: Mapping[Any, float], own: Hashable, other: Hashable) -> float | None:
    if own not in top or other not in top:
        return None
    return top[own] - top[other]


def judge_results(reference: Sequence[Mapping[str, Any]], results: Sequence[Mapping[str, Any]],
                  mode: str) -> dict[str, Any]:
    """Two engine runs of the same prompts (bench/support/engine_run.py results): {answers:
    the worst prompt's verdict, answers_close: whether every prompt meets vLLM's bar}."""
    found = worst(compare(Tokens.of(a), Tokens.of(b), ("reference", mode))
                  for a, b in zip(reference, results, strict=True))
    return {"answers": found.verdict, "answers_close": found.close}
