"""Reward functions that fail on purpose, for the fault-handling tests (loaded as `faulty_rewards:...`)."""

import os
import signal

import torch
import torch.distributed as dist

_calls = {"n": 0}


def _copy_reward(prompt_ids, prompt_mask, response_ids, response_mask):  # noqa: ANN001
    from graphrl.tasks import REWARDS

    return REWARDS["digits_copy"](prompt_ids, prompt_mask, response_ids, response_mask)


def raise_on_rank1(prompt_ids, prompt_mask, response_ids, response_mask):  # noqa: ANN001
    _calls["n"] += 1
    if dist.is_initialized() and dist.get_rank() == 1 and _calls["n"] == 3:
        raise RuntimeError("reward server unreachable (injected)")
    return _copy_reward(prompt_ids, prompt_mask, response_ids, response_mask)


def kill_rank1(prompt_ids, prompt_mask, response_ids, response_mask):  # noqa: ANN001
    _calls["n"] += 1
    if dist.is_initialized() and dist.get_rank() == 1 and _calls["n"] == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return _copy_reward(prompt_ids, prompt_mask, response_ids, response_mask)


def zeros(prompt_ids, prompt_mask, response_ids, response_mask):  # noqa: ANN001
    return torch.zeros(prompt_ids.shape[0])


def answer_rule_raising_on_twos(response: str, answer: str) -> float:
    """An answer rule with a bug that only some rollouts trigger."""
    if "2" in answer:
        raise ValueError("cannot compare this answer (injected)")
    return 0.0


def nan_at_step_two(prompt_ids, prompt_mask, response_ids, response_mask):  # noqa: ANN001
    """Finite rewards for two steps, then one NaN: the run must stop at step 2 naming it."""
    _calls["n"] += 1
    rewards = _copy_reward(prompt_ids, prompt_mask, response_ids, response_mask).float()
    if _calls["n"] == 3:
        rewards[1] = float("nan")
    return rewards


def returns_a_string(prompt_ids, prompt_mask, response_ids, response_mask):  # noqa: ANN001
    return "1.0"


def rule_returning_nan(response: str, answer: str) -> float:
    return float("nan")
