"""bench/support/answers.py: vLLM's check_logprobs_close convention and bit equality, on made-up
answers (the engine runs that use them are the vllm-marked tests)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bench.support.answers import Tokens, compare, identical, judge_results, worst


def answer(tokens: list[int], tops: list[dict[int, float]] | None = None) -> Tokens:
    return Tokens(tokens, tops if tops is not None else [{t: -0.1} for t in tokens])


def test_equal_tokens_are_equal_whatever_the_logprobs():
    a = answer([5, 6, 7], [{5: -0.1}, {6: -0.2}, {7: -0.3}])
    b = answer([5, 6, 7], [{5: -0.2}, {6: -0.1}, {7: -0.9}])
    found = compare(a, b, ("recompute", "dram"))
    assert found.equal and found.close and found.position is None
    assert found.verdict == "equal" and not identical(a, b)
    assert identical(a, answer([5, 6, 7], [{5: -0.1}, {6: -0.2}, {7: -0.3}]))


def test_a_near_tie_is_close_and_says_where_and_by_how_much():
    a = answer([5, 6, 1, 1], [{5: -0.1}, {6: -0.5, 9: -0.6, 3: -2.0}, {1: -1}, {1: -1}])
    b = answer([5, 9, 2, 2], [{5: -0.1}, {9: -0.55, 6: -0.57}, {2: -1}, {2: -1}])
    found = compare(a, b, ("recompute", "dram"))
    assert found.close and not found.equal and found.position == 1
    assert found.tokens == (6, 9)
    assert found.margins[0] is not None and abs(found.margins[0] - 0.1) < 1e-9
    assert found.margins[1] is not None and abs(found.margins[1] - 0.02) < 1e-9
    assert found.verdict == "near-tie at token 1"
    assert "recompute chose 6 (dram's choice 9 0.100 behind)" in found.describe()


def test_a_token_outside_the_others_top_logprobs_is_a_divergence():
    a = answer([5, 6], [{5: -0.1}, {6: -0.5, 9: -0.6}])
    b = answer([5, 9], [{5: -0.1}, {9: -0.1, 4: -3.0}])  # 6 is not among b's top logprobs
    found = compare(a, b, ("recompute", "disk"))
    assert not found.close and found.verdict == "DIVERGED at token 1"
    assert "not in its top 5" in found.describe()


def test_one_answer_ending_first_at_a_near_tie_is_close():
    """The end-of-turn token against text: the turn-3 case of the demo."""
    a = answer([5, 2], [{5: -0.1}, {2: -0.70, 198: -0.72}])
    b = answer([5, 198, 44], [{5: -0.1}, {198: -0.69, 2: -0.71}, {44: -0.1}])
    assert compare(a, b).close and compare(a, b).position == 1
    # Equal as far as both go, then one ends (its stop token not among the tokens): no
    # logprobs say how close that was, so it is not close.
    ended = compare(answer([5]), answer([5, 6]))
    assert not ended.close and ended.verdict == "DIVERGED: one ends where the other goes on"


def test_worst_and_engine_results():
    equal, tie = compare(answer([1]), answer([1])), compare(answer([1, 2], [{1: 0}, {2: -1, 3: -1}]),
                                                            answer([1, 3], [{1: 0}, {3: -1, 2: -1}]))
    wrong = compare(answer([4]), answer([5]))
    assert worst([equal, tie, wrong]) is wrong and worst([equal, tie]) is tie and worst([equal]) is equal
    run = [{"token_ids": [1, 2], "top_logprobs": [{1: -0.1}, {2: -0.1}]}]
    assert judge_results(run, run, "dram") == {"answers": "equal", "answers_close": True}


tokens = st.lists(st.integers(0, 20), max_size=12)


@given(tokens, tokens)
def test_the_comparison_stops_at_the_first_difference(a_ids, b_ids):
    a, b = answer(a_ids), answer(b_ids)
    found, back = compare(a, b), compare(b, a)
    first = next((i for i, (x, y) in enumerate(zip(a_ids, b_ids, strict=False)) if x != y), None)
    assert found.position == back.position == first
    assert found.close == back.close  # symmetric
    assert found.equal == (a_ids == b_ids)
    assert found.close == back.close == (first is None and len(a_ids) == len(b_ids))
    assert compare(a, a).equal and identical(a, a)
