"""Built-in prompt tasks and rule-based rewards.

The digit tasks are small enough that a tiny policy learns them from scratch on a laptop CPU in a
minute, and hard enough that a random policy scores near zero: the prompt is a string of digits, the
response must be the same digits copied, reversed or sorted, and the reward is the fraction of
positions right. Token ids: digits are 0..9, then the special tokens below (vocabulary of 16).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

from graphrl.schemas.registry import Registry

if TYPE_CHECKING:  # torch is imported where a task or reward runs: checking a job's names must not pay for it
    import torch

BOS, SEP, EOS, PAD = 10, 11, 12, 13
VOCAB_SIZE = 16


class Task(Protocol):
    """A source of prompts: `sample(generator, batch_size, prompt_len) -> (prompt_ids, prompt_mask)`."""

    def sample(self, gen: torch.Generator, batch_size: int, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        ...


RewardFn = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]
"""(prompt_ids[N,P], prompt_mask[N,P], response_ids[N,R], response_mask[N,R]) -> rewards[N] in [0, 1]. For an
episode (a generate node with an environment) response_mask marks the model's tokens only."""
REWARD_ARGS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
"""The positional arguments a reward function is called with, in order (the executor's `reward`)."""

TASKS: Registry[Callable[..., Task]] = Registry("task")
REWARDS: Registry[RewardFn] = Registry("reward function")


def _transform(name: str, digits: torch.Tensor) -> torch.Tensor:
    if name == "copy":
        return digits
    if name == "reverse":
        return digits.flip(-1)
    if name == "sort":
        return digits.sort(dim=-1).values
    raise KeyError(name)


@dataclass(frozen=True)
class DigitTask:
    """Prompts `BOS d1 .. dk SEP`, left-padded with PAD to `prompt_len`."""

    transform: str
    num_digits: int = 4

    def __post_init__(self) -> None:
        if self.num_digits < 1:
            raise ValueError(f"num_digits must be at least 1 (got {self.num_digits})")

    @property
    def prompt_tokens(self) -> int:
        """Tokens of every prompt: BOS, the digits, SEP; `prompt_len` must hold them."""
        return self.num_digits + 2

    def sample(self, gen: torch.Generator, batch_size: int, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        need = self.prompt_tokens
        if prompt_len < need:
            raise ValueError(f"prompt_len {prompt_len} is shorter than the {need} tokens a prompt needs")
        digits = torch.randint(0, 10, (batch_size, self.num_digits), generator=gen)
        body = torch.cat(
            [torch.full((batch_size, 1), BOS), digits, torch.full((batch_size, 1), SEP)], dim=1
        )
        ids = torch.full((batch_size, prompt_len), PAD, dtype=torch.int64)
        ids[:, prompt_len - need:] = body
        mask = torch.zeros((batch_size, prompt_len), dtype=torch.bool)
        mask[:, prompt_len - need:] = True
        return ids, mask


for _t in ("copy", "reverse", "sort"):
    TASKS.add(f"digits-{_t}", lambda num_digits=4, _t=_t: DigitTask(_t, int(num_digits)))


def _prompt_digits(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """The digits between BOS and SEP of left-padded prompts (all prompts have the same count)."""
    is_digit = (prompt_ids < 10) & prompt_mask
    counts = is_digit.sum(dim=1)
    k = int(counts.max().item()) if counts.numel() else 0
    # Digits are contiguous just before the trailing SEP.
    return prompt_ids[:, -1 - k:-1] if k else prompt_ids[:, :0]


def _digit_reward(transform: str) -> RewardFn:
    def reward(prompt_ids, prompt_mask, response_ids, response_mask):  # noqa: ANN001
        import torch

        target = _transform(transform, _prompt_digits(prompt_ids, prompt_mask))
        k = target.shape[1]
        if k == 0:
            return torch.zeros(prompt_ids.shape[0])
        got = torch.full_like(target, -1)
        n = min(k, response_ids.shape[1])
        got[:, :n] = torch.where(response_mask[:, :n], response_ids[:, :n], -1)
        return (got == target).float().mean(dim=1)

    reward.__name__ = f"digits_{transform}"
    reward.__doc__ = f"Fraction of the {transform}d prompt digits reproduced in place."
    return reward


for _t in ("copy", "reverse", "sort"):
    REWARDS.add(f"digits_{_t}", _digit_reward(_t))


def resolve_callable(ref: str, registry: Registry, what: str) -> Callable:
    """A registered name, or 'module:function' imported on demand. Raises LookupError with the reason."""
    entry = registry.get(ref)
    if entry is not None:
        return entry
    if ":" not in ref:
        raise LookupError(f"unknown {what} {ref!r}; registered: {', '.join(registry.names())}")
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError or an error inside the user's module
        raise LookupError(f"cannot import module {module_name!r} for {what} {ref!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise LookupError(f"module {module_name!r} has no callable {attr!r}")
    return fn


def call_mismatch(fn: Callable, args: Sequence[str] = (), kwargs: Mapping[str, Any] | None = None) -> str | None:
    """Why `fn` cannot be called with the positional arguments named `args` and the keyword arguments
    `kwargs` (as `its signature is (x): too many positional arguments`), or None when it can, or when
    Python cannot tell (a builtin without a signature)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **(kwargs or {}))
    except TypeError as exc:
        return f"its signature is {signature}: {exc}"
    return None


@dataclass(frozen=True)
class SyntheticTokens:
    """Uniformly random prompt tokens of full length: for capacity planning and throughput runs, not learning."""

    vocab_size: int = VOCAB_SIZE

    def sample(self, gen: torch.Generator, batch_size: int, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        ids = torch.randint(0, self.vocab_size, (batch_size, prompt_len), generator=gen)
        return ids, torch.ones((batch_size, prompt_len), dtype=torch.bool)


TASKS.add("synthetic-tokens", lambda vocab_size=VOCAB_SIZE: SyntheticTokens(int(vocab_size)))
