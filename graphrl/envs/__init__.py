"""Environments: what a generate node's episodes talk to over several turns.

An environment is a class; the run builds one instance per episode (so its state is the episode's) with
the node's `env.options` as keyword arguments, and calls, sync or async:

    reset(row: dict) -> str | list[dict] | None
        The episode's first user message (or messages: [{"role": ..., "content": ...}]), from the dataset row
        (`prompt`, `answer`, `system`, and `index`, the episode's response index in its step). None keeps the
        dataset's own prompt.
    step(text: str) -> (observation: str | list[dict] | None, reward: float, done: bool)
        `text` is the model's decoded turn. The observation is the next user (or tool) message, rendered with
        the model's chat template as the next turn and appended to the episode's tokens; None ends it.

A class may declare `seconds_per_call` and `observation_tokens` (what one call takes and adds), which the
preview charges where the job does not say. Built-in environments register by name in `ENVS`; a job names
one of them or 'module:Class'. Nothing here runs a model: `graphrl.executors.episodes` drives the episodes.
"""

from __future__ import annotations

import difflib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

from graphrl.schemas.registry import Registry
from graphrl.tasks import resolve_callable

ENVS: Registry[type] = Registry("environment")

Message = dict[str, str]


class EnvProtocolError(ValueError):
    """An environment returned something the protocol does not allow (the episode ends, reason 'bad_return')."""


def env_class(ref: str) -> type:
    """The environment class a job names: a built-in name or 'module:Class'. Raises LookupError with the reason."""
    _load_builtins()
    cls = resolve_callable(ref, ENVS, "environment")
    if not inspect.isclass(cls):
        raise LookupError(f"environment {ref!r} is a {type(cls).__name__}, not a class")
    return cls


def class_mismatch(cls: type, options: dict[str, Any]) -> str | None:
    """Why `cls` cannot serve as an environment built with `options`, or None when it can."""
    return method_mismatch(cls) or options_mismatch(cls, options)


def method_mismatch(cls: type) -> str | None:
    """Why `cls` has no `reset(row)` and `step(text)` to call, or None."""
    for method, args in (("reset", ("row",)), ("step", ("text",))):
        fn = getattr(cls, method, None)
        if fn is None or not callable(fn):
            return f"it has no method {method}({', '.join(args)})"
        try:
            inspect.signature(fn).bind(None, *args)  # (self, ...)
        except TypeError as exc:
            return f"its {method}{inspect.signature(fn)} cannot be called as {method}({', '.join(args)}): {exc}"
        except ValueError:
            pass  # a builtin without a signature: Python cannot tell
    return None


def options_mismatch(cls: type, options: dict[str, Any]) -> str | None:
    """Why `cls(**options)` cannot be called (with the option it takes that a misspelt one is nearest), or None."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(**options)
    except TypeError as exc:
        takes = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
        hints = [f"{key!r}: did you mean {close[0]!r}?" for key in options
                 if key not in takes and (close := difflib.get_close_matches(key, takes, n=1))]
        return (f"its constructor {cls.__name__}{_signature(cls)} cannot take the options {sorted(options)} ({exc})"
                + (f"; {'; '.join(hints)}" if hints else ""))
    return None


def _signature(cls: type) -> str:
    try:
        return str(inspect.signature(cls).replace(return_annotation=inspect.Signature.empty))
    except (TypeError, ValueError):
        return "(...)"


def messages_of(value: Any, what: str) -> list[Message]:
    """A reset or step message as a list of chat messages: a string is one user message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise EnvProtocolError(f"{what} returned {_shown(value)}; expected a string or a non-empty list of "
                           "{'role': str, 'content': str} messages")


@dataclass(frozen=True)
class StepResult:
    observation: list[Message] | None
    reward: float
    done: bool


def step_result(value: Any) -> StepResult:
    """`step`'s return checked: (observation or None, a finite reward, done)."""
    if not isinstance(value, tuple | list) or len(value) != 3:
        raise EnvProtocolError(f"step returned {_shown(value)}; expected (observation, reward, done)")
    observation, reward, done = value
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(float(reward)):
        raise EnvProtocolError(f"step returned the reward {_shown(reward)}; expected a finite number")
    if not isinstance(done, bool):
        raise EnvProtocolError(f"step returned done = {_shown(done)}; expected True or False")
    return StepResult(None if observation is None else messages_of(observation, "step"), float(reward), done)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def declared(cls: type, name: str) -> float | None:
    """A class's declared estimate (`seconds_per_call`, `observation_tokens`), or None."""
    value = getattr(cls, name, None)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 else None


_LOADED = False


def _load_builtins() -> None:
    """Register the built-in environments (imported on first use: none of them is needed to compile a job)."""
    global _LOADED
    if not _LOADED:
        _LOADED = True
        from graphrl.envs import builtin  # noqa: F401  (registers into ENVS)


Call = Callable[..., Any]

__all__ = ["ENVS", "EnvProtocolError", "Message", "StepResult", "class_mismatch", "declared", "env_class",
           "messages_of", "method_mismatch", "options_mismatch", "step_result"]
