"""Reward rules that check a response's text against the dataset's answer.

Each rule is `(response, answer) -> float` in [0, 1], registered by name; a reward node lists the
rules it combines with their weights (`rules: {numeric_answer: 1.0, boxed_format: 0.1}`). The numeric
rule reads the answer a model gives in `\\boxed{...}` or, failing that, the last number it writes, and
compares numbers, not strings (`7`, `7.0` and `14/2` are the same answer).
"""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction
from typing import Callable

from graphrl.schemas.registry import Registry
from graphrl.tasks import resolve_callable

AnswerRule = Callable[[str, str], float]
ANSWER_RULE_ARGS = ("response", "answer")
"""The positional arguments an answer rule is called with, in order (`combined_reward`)."""
ANSWER_RULES: Registry[AnswerRule] = Registry("answer reward rule")

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\s*\{")


def boxed_contents(text: str) -> list[str]:
    """The contents of every `\\boxed{...}`, nested braces kept."""
    found = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found.append(text[start:i])
                break
    return found


def parse_number(text: str) -> float | None:
    """A number written as `1,234`, `-3.5`, `3/4` or `.5`; None if `text` is not one."""
    text = text.strip().replace(",", "").replace(" ", "")
    try:
        return float(Fraction(text))
    except (ValueError, ZeroDivisionError):
        return None


def final_number(text: str) -> float | None:
    """The answer a response gives: the last `\\boxed{}` if it holds a number, else the last number in it."""
    for boxed in reversed(boxed_contents(text)):
        numbers = _NUMBER.findall(boxed)
        if numbers and (value := parse_number(numbers[-1])) is not None:
            return value
    numbers = _NUMBER.findall(text)
    return parse_number(numbers[-1]) if numbers else None


@ANSWER_RULES.register("numeric_answer")
def numeric_answer(response: str, answer: str) -> float:
    """1 if the response's final number equals the answer's (relative tolerance 1e-6), else 0."""
    got, want = final_number(response), final_number(answer)
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9))


def _normalize(text: str) -> str:
    return " ".join(text.strip().casefold().split()).rstrip(".")


@ANSWER_RULES.register("exact_match")
def exact_match(response: str, answer: str) -> float:
    """1 if the response (or its last `\\boxed{}`) is the answer, ignoring case, spacing and a final period."""
    boxed = boxed_contents(response)
    got = boxed[-1] if boxed else response
    return float(_normalize(got) == _normalize(answer))


@ANSWER_RULES.register("math_equivalence")
def math_equivalence(response: str, answer: str) -> float:
    """1 if `math-verify` finds the response's final expression equal to the answer's (`1/2` = `0.5` = `\\frac{1}{2}`)."""
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    predicted = parse(response)
    if not gold or not predicted:
        return 0.0
    return float(verify(gold, predicted))


@ANSWER_RULES.register("boxed_format")
def boxed_format(response: str, answer: str) -> float:
    """1 if the response puts exactly one answer in `\\boxed{}` (the format math graders read)."""
    return float(len(boxed_contents(response)) == 1)


@ANSWER_RULES.register("answer_tag_format")
def answer_tag_format(response: str, answer: str) -> float:
    """1 if the response ends with its answer between `<answer>` and `</answer>`."""
    return float(re.search(r"<answer>.+?</answer>\s*$", response, flags=re.DOTALL) is not None)


class RewardRuleError(Exception):
    """A rule raised, or returned something other than a finite number, on one rollout; carries the
    rollout so the report can show it."""

    def __init__(self, rule: str, index: int, response: str, answer: str, reason: str) -> None:
        super().__init__(f"reward rule {rule!r} {reason} on response {index} "
                         f"(response {response[:200]!r}, answer {answer!r})")
        self.rule, self.index, self.response, self.answer = rule, index, response, answer


def combined_reward(rules: dict[str, float], responses: list[str], answers: list[str]) -> list[float]:
    """sum_rule weight * rule(response, answer) for each rollout; a rule that raises, or returns a
    non-number or a NaN or infinite number, names its rollout."""
    fns = [(name, resolve_callable(name, ANSWER_RULES, "answer reward rule"), weight) for name, weight in rules.items()]
    totals = []
    for index, (response, answer) in enumerate(zip(responses, answers, strict=True)):
        total = 0.0
        for name, fn, weight in fns:
            try:
                value = fn(response, answer)
            except Exception as exc:  # a user rule's bug, reported with the rollout that triggered it
                raise RewardRuleError(name, index, response, answer,
                                      f"raised {type(exc).__name__}: {exc}") from exc
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise RewardRuleError(name, index, response, answer,
                                      f"returned {type(value).__name__} {value!r:.60}, not a number")
            if not math.isfinite(value):
                raise RewardRuleError(name, index, response, answer, f"returned {float(value)}, not a finite number")
            total += weight * float(value)
        totals.append(total)
    return totals


__all__ = ["ANSWER_RULES", "RewardRuleError", "combined_reward", "final_number", "numeric_answer"]
