"""Answer reward rules on hand-written responses, their weighted combination, and a rule that raises."""

from __future__ import annotations

import pytest

from graphrl.rewards import (
    ANSWER_RULES,
    RewardRuleError,
    combined_reward,
    final_number,
    numeric_answer,
)


@pytest.mark.parametrize(("response", "answer", "expected"), [
    ("3 + 4 = 7", "7", 1.0),
    ("First 2 apples, then 5 more, so 7.", "7", 1.0),
    ("The answer is \\boxed{7}. (Not 8.)", "7", 1.0),           # boxed beats the last number
    ("I think 8", "7", 0.0),
    ("It is 7.0", "7", 1.0),                                     # numbers, not strings
    ("Total: 1,234 dollars", "1234", 1.0),
    ("\\boxed{14/2}", "7", 1.0),
    ("She has -3 left", "-3", 1.0),
    ("no number here", "7", 0.0),
    ("7", "#### 7", 1.0),                                        # GSM8K-style answers
])
def test_numeric_answer(response: str, answer: str, expected: float) -> None:
    assert numeric_answer(response, answer) == expected


def test_final_number_reads_nested_boxes() -> None:
    assert final_number("so \\boxed{\\frac{1}{2}} hmm") == 2.0  # last number inside the box
    assert final_number("x = \\boxed{12} and \\boxed{13}") == 13.0
    assert final_number("") is None


def test_exact_match_and_formats() -> None:
    assert ANSWER_RULES["exact_match"]("  Paris. ", "paris") == 1.0
    assert ANSWER_RULES["exact_match"]("It is \\boxed{Paris}", "Paris") == 1.0
    assert ANSWER_RULES["exact_match"]("Lyon", "Paris") == 0.0
    assert ANSWER_RULES["boxed_format"]("so \\boxed{3}", "") == 1.0
    assert ANSWER_RULES["boxed_format"]("\\boxed{3} or \\boxed{4}", "") == 0.0
    assert ANSWER_RULES["answer_tag_format"]("think... <answer>3</answer>", "") == 1.0
    assert ANSWER_RULES["answer_tag_format"]("<answer>3</answer> trailing", "") == 0.0


def test_math_equivalence() -> None:
    pytest.importorskip("math_verify")
    rule = ANSWER_RULES["math_equivalence"]
    assert rule("The answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert rule("The answer is $\\boxed{2\\sqrt{2}}$", "\\sqrt{8}") == 1.0
    assert rule("The answer is $\\frac{1}{3}$", "0.5") == 0.0


def test_weighted_combination() -> None:
    rewards = combined_reward({"numeric_answer": 1.0, "boxed_format": 0.25},
                              ["\\boxed{7}", "7", "\\boxed{8}"], ["7", "7", "7"])
    assert rewards == [1.25, 1.0, 0.25]


def broken_rule(response: str, answer: str) -> float:
    if "boom" in response:
        raise ValueError("cannot parse")
    return 1.0


def test_a_rule_that_raises_names_the_rollout() -> None:
    with pytest.raises(RewardRuleError, match=r"broken_rule.*cannot parse.*response 1.*boom") as info:
        combined_reward({f"{__name__}:broken_rule": 1.0}, ["fine", "boom here"], ["1", "2"])
    assert info.value.index == 1 and info.value.answer == "2"
