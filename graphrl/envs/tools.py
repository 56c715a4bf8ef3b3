"""What the tool environments share: a problem the model answers over turns, calling a tool when it wants.

A turn that calls the tool runs it and shows the result (or the error) as the next message; a turn without a
call is the final answer, scored against the row's answer (`graphrl.rewards.numeric_answer`), and ends the
episode. A call past `max_calls` is refused with an error telling the model to answer. The episode's counters
`tool_calls` and `tool_errors` are what the run reports.
"""

from __future__ import annotations

from graphrl.rewards import numeric_answer


class ToolTask:
    """The turn logic of a tool environment; a subclass finds a turn's call (`find_call`) and runs it (`run`)."""

    calls_left_name = "tool calls"  # in the refusal past max_calls: "no {calls_left_name} left"

    def __init__(self, max_calls: int) -> None:
        self.max_calls = max_calls
        self._answer: str | None = None
        self.tool_calls = 0
        self.tool_errors = 0

    def find_call(self, text: str) -> str | None:
        """The argument of the turn's call (an expression, a code block), or None for a final answer."""
        raise NotImplementedError

    def run(self, call: str) -> tuple[str, bool, float]:
        """(the observation, whether the tool ran without error, the turn's reward) of one call."""
        raise NotImplementedError

    def step(self, text: str) -> tuple[str | None, float, bool]:
        call = self.find_call(text)
        if call is None:
            reward = numeric_answer(text, self._answer) if self._answer is not None else 0.0
            return None, reward, True
        self.tool_calls += 1
        if self.tool_calls > self.max_calls:
            self.tool_errors += 1
            return f"error: no {self.calls_left_name} left ({self.max_calls} used); give the final answer as a " \
                   "number", 0.0, False
        observation, ok, reward = self.run(call)
        if not ok:
            self.tool_errors += 1
        return observation, reward, False


__all__ = ["ToolTask"]
