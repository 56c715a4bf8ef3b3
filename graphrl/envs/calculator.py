"""The calculator environment: arithmetic word problems solved with a tool the model calls inline.

The model writes `<calc>12*7+3</calc>`, the environment answers `Result: 87`, and a turn without a call is
the final answer, scored against the dataset's answer. Expressions are evaluated by walking their `ast`
(numbers, + - * / // % **, unary signs, parentheses; never `eval`), with every intermediate value and
exponent bounded, so no expression a model writes can hang the run or exhaust its memory.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from graphrl.envs.tools import ToolTask

MAX_EXPONENT = 64
"""Largest |exponent| of `**`."""
MAX_MAGNITUDE = 1e30
"""Largest |value| of a number, an intermediate result or the result."""
MAX_EXPRESSION_CHARS = 200
"""Longest expression evaluated (keeps parsing and the tree walk small)."""
_TOO_LARGE = f"result too large (|value| <= {MAX_MAGNITUDE:.0e})".replace("+", "")

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOLS: dict[type[ast.AST], str] = {ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
                                      ast.RShift: ">>", ast.MatMult: "@", ast.Invert: "~", ast.Not: "not"}
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")

DEFAULT_INSTRUCTIONS = ("To compute, write <{tag}>EXPRESSION</{tag}> (for example <{tag}>12*7+3</{tag}>) and wait "
                        "for the result. When you are done, give the final answer as a number.")


class CalcError(ValueError):
    """An expression the calculator refuses; the message is what the model is told."""


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; raises CalcError saying why it cannot be computed."""
    expression = _THOUSANDS.sub("", expression.strip())  # `1,234` is a number in a word problem, not a tuple
    if not expression:
        raise CalcError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise CalcError("invalid expression") from None
    try:
        return _value(tree.body)
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except (OverflowError, RecursionError):
        raise CalcError(_TOO_LARGE) from None


def _value(node: ast.expr) -> Number:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalcError(f"unsupported value {node.value!r:.30}")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponent too large (|exponent| <= {MAX_EXPONENT})")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise CalcError(_unsupported(node))


def _bounded(value: Any) -> Number:
    """`value` if it is a real number within the bounds; a negative base to a fractional power is complex."""
    if not isinstance(value, int | float):
        raise CalcError("result is not a real number")
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > MAX_MAGNITUDE:
        raise CalcError(_TOO_LARGE)
    return value


def _unsupported(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return f"unknown name {node.id!r} (only numbers and + - * / // % ** are allowed)"
    if isinstance(node, ast.Call):
        return "function calls are not allowed (only numbers and + - * / // % ** are allowed)"
    op = getattr(node, "op", None)
    if op is not None and type(op) in _SYMBOLS:
        hint = " (use ** for powers)" if isinstance(op, ast.BitXor) else ""
        return f"unsupported operator {_SYMBOLS[type(op)]}{hint}"
    return f"unsupported {type(node).__name__.lower()} (only numbers and + - * / // % ** are allowed)"


def format_number(value: Number) -> str:
    """A result as the model reads it: whole numbers without `.0`, others to 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, int):
        return str(value)
    return format(value, ".12g")


class Calculator(ToolTask):
    """Arithmetic word problems with a calculator tool: `<calc>EXPRESSION</calc>` calls, then a numeric answer.

    Each call is one step with reward 0 and the observation `Result: VALUE` (or `error: ...`); a turn without a
    call ends the episode with reward 1 if its final number equals the row's answer, else 0. A call past
    `max_calls` is refused with an error telling the model to answer. A call left open at the end of the turn
    (generation stopped at the closing tag) counts as a call.

    For a model too small to follow the instructions alone, `examples` (up to 2) shows worked exchanges as
    earlier turns of the conversation (a problem, a call, its result, the answer), and `call_reward` rewards
    each call the calculator evaluates (a shaping reward: the episode's reward is their sum plus the answer's).
    """

    calls_left_name = "calculator calls"
    seconds_per_call = 0.00002  # one call measured at about 17 µs
    observation_tokens = 8

    def __init__(self, instructions: str | None = None, tag: str = "calc", max_calls: int = 4, examples: int = 0,
                 call_reward: float = 0.0) -> None:
        if not re.fullmatch(r"[A-Za-z][\w-]*", tag):
            raise ValueError(f"calculator option tag={tag!r} is not a tag name (letters, digits, '_' or '-')")
        if max_calls < 0:
            raise ValueError(f"calculator option max_calls={max_calls} is negative")
        if not 0 <= examples <= len(_EXAMPLES):
            raise ValueError(f"calculator option examples={examples} is not between 0 and {len(_EXAMPLES)}")
        self.examples, self.call_reward = examples, float(call_reward)
        self.tag = tag
        super().__init__(max_calls)
        self.instructions = DEFAULT_INSTRUCTIONS.format(tag=tag) if instructions is None else instructions
        self._call = re.compile(rf"<{re.escape(tag)}>(.*?)(?:</{re.escape(tag)}>|\Z)", re.DOTALL)

    def reset(self, row: dict) -> str | list[dict[str, str]]:
        self._answer = row.get("answer")
        if not self.examples:
            return f"{row['prompt']}\n\n{self.instructions}"
        shown: list[dict[str, str]] = []
        for question, expression in _EXAMPLES[:self.examples]:
            shown += [{"role": "user", "content": question},
                      {"role": "assistant", "content": f"<{self.tag}>{expression}</{self.tag}>"},
                      {"role": "user", "content": f"Result: {format_number(evaluate(expression))}"},
                      {"role": "assistant", "content": format_number(evaluate(expression))}]
        shown[0]["content"] += f"\n\n{self.instructions}"
        return shown + [{"role": "user", "content": row["prompt"]}]

    def find_call(self, text: str) -> str | None:
        call = self._call.search(text)
        return None if call is None else call.group(1)

    def run(self, call: str) -> tuple[str, bool, float]:
        try:
            return f"Result: {format_number(evaluate(call))}", True, self.call_reward
        except CalcError as exc:
            return f"error: {exc}", False, 0.0


# Worked exchanges `examples` shows before the problem: a question and the expression that answers it.
_EXAMPLES = (("Tom has 3 bags with 4 apples in each bag. How many apples are there in all?", "3*4"),
             ("Sam has 15 cards and gives away 6. How many cards are left?", "15-6"))


__all__ = ["DEFAULT_INSTRUCTIONS", "CalcError", "Calculator", "evaluate", "format_number"]
