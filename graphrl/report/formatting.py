"""Formatting shared by the text and HTML views: seconds, percentages and numbers as shown, the rows a
long table keeps, and samples clipped to one line.
"""

from __future__ import annotations

from typing import Any

from graphrl.compiler.preview import human_seconds

SAMPLE_TEXT_CHARS = 160

# Tables of long runs show the first and last steps; every step stays in `data`.
STEP_ROWS_HEAD, STEP_ROWS_TAIL = 10, 30
# Past this many ranks the busy table shows one row per mesh.
MAX_RANK_ROWS = 64


def fmt_seconds(value: float | None) -> str:
    return "-" if value is None else human_seconds(value)


def fmt_pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.1f}%" if signed else f"{value:.0f}%"


def fmt_number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def shown_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int, list[dict[str, Any]]]:
    """First and last rows of a long table, and how many are left out between them."""
    if len(rows) <= STEP_ROWS_HEAD + STEP_ROWS_TAIL + 5:
        return rows, 0, []
    return rows[:STEP_ROWS_HEAD], len(rows) - STEP_ROWS_HEAD - STEP_ROWS_TAIL, rows[-STEP_ROWS_TAIL:]


def clip(text: str, chars: int = SAMPLE_TEXT_CHARS, tail: bool = False) -> str:
    """One line of at most `chars` characters; prompts keep their end (the question), responses their start."""
    flat = " ".join(str(text).split())
    if len(flat) <= chars:
        return flat
    return "..." + flat[-chars + 3:] if tail else flat[:chars - 3] + "..."
