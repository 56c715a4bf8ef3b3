"""Checks that stop a run before a bad number spreads: rewards where they are made, the loss and the
gradients before the optimizer step, the weights before a checkpoint is written.

One NaN reward becomes a NaN advantage, a NaN loss, NaN gradients and, after one optimizer step, NaN
weights in every later checkpoint; the run used to finish "successfully" with all of them. Each check
here raises a `RunError` naming where the number came from (node, rule or function, step, rollout,
prompt), so the run ends with exit 2 and the last good checkpoint is still the newest one.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from graphrl.errors import RunError


def reward_tensor(value: Any, expected: int, source: str) -> Tensor:
    """A reward function's result as float32 [expected]; refuses a non-tensor or non-numeric result."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value):
        value = torch.tensor([float(v) for v in value])
    if not isinstance(value, Tensor):
        raise RunError(f"{source} returned a {type(value).__name__} ({_short(value)}), not a tensor of rewards",
                       fix=f"return a float tensor of shape ({expected},): one number per response")
    if value.dtype == torch.bool or not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64)):
        raise RunError(f"{source} returned a tensor of {value.dtype}, not numbers",
                       fix=f"return a float tensor of shape ({expected},): one number per response")
    if tuple(value.shape) != (expected,):
        raise RunError(f"{source} returned shape {tuple(value.shape)}, expected ({expected},)",
                       fix="return one reward per response")
    return value.float()


def first_non_finite(values: Tensor) -> int | None:
    """Index of the first NaN or infinite entry of a 1-D tensor, or None."""
    bad = (~torch.isfinite(values)).nonzero()
    return int(bad[0, 0]) if bad.numel() else None


def check_rewards(rewards: Tensor, source: str, step: int, start: int,
                  prompt_of: Callable[[int], str]) -> None:
    """Refuse a NaN or infinite reward, naming its source, step, rollout (index in the step's batch)
    and prompt; `prompt_of(i)` gives the prompt of the i-th reward here."""
    index = first_non_finite(rewards)
    if index is None:
        return
    raise RunError(f"{source} gave reward {float(rewards[index])} at step {step}, rollout {start + index} "
                   f"(prompt {_short(prompt_of(index))})",
                   fix="make the reward finite for every response (a NaN or inf reward would make the loss "
                       "and then every weight NaN)")


def check_update(loss: float, grad_norm: float, *, node: str, step: int) -> None:
    """Stop before the optimizer step when the loss or the gradients are NaN or infinite: stepping would
    make every weight NaN, and the checkpoints after it useless."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
    raise RunError(f"train node {node!r}, step {step}: {what}; the optimizer step was not taken",
                   fix="lower algorithm.lr or max_grad_norm, or check the rewards and advantages; --resume "
                       "continues from the last checkpoint, written before this step")


def check_weights(weights: Mapping[str, Mapping[str, Tensor]], step: int) -> None:
    """Refuse to write a checkpoint whose weights hold a NaN or infinite value."""
    for role, tensors in weights.items():
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise RunError(f"the weights of {role} after step {step} hold NaN or inf ({name}); no checkpoint "
                               "was written", fix="--resume continues from the last checkpoint, written before")


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


__all__ = ["check_rewards", "check_update", "check_weights", "first_non_finite", "reward_tensor"]
