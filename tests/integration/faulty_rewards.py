"""Reward functions that fail on purpose, for the fault-handling tests (loaded as `faulty_rewards:...`)."""

import os
import signal
import time

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


def _signal_the_group(signum: int = signal.SIGINT) -> None:
    """What a terminal's Ctrl-C does (SIGINT), or a scheduler's SIGTERM: the signal to every process of the
    run's process group (the launcher, the ranks), sent from the first rank, so that it lands at a known
    point of the run."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.killpg(os.getpgid(0), signum)


def signal_in_step_two(prompt_ids, prompt_mask, response_ids, response_mask):  # noqa: ANN001
    """The signal named by GRAPHRL_TEST_SIGNAL (SIGINT, SIGTERM) while step 2 scores its responses (the third
    call), once per process; the run must stop after step 2. Without it, the digit-copy reward."""
    _calls["n"] += 1
    name = os.environ.get("GRAPHRL_TEST_SIGNAL")
    if _calls["n"] == 3 and name:
        _signal_the_group(signal.Signals[name])
    return _copy_reward(prompt_ids, prompt_mask, response_ids, response_mask)


def ctrl_c_then_hang_in_step_two(prompt_ids, prompt_mask, response_ids, response_mask):  # noqa: ANN001
    """Ctrl-C in step 2, then a step that does not end (a hung tool, a very long step): only a second
    Ctrl-C ends the run."""
    _calls["n"] += 1
    if _calls["n"] == 3:
        _signal_the_group()
        time.sleep(600)
    return _copy_reward(prompt_ids, prompt_mask, response_ids, response_mask)


def ctrl_c_while_starting(**options):  # noqa: ANN003
    """The digit-copy task, built while a rank starts: Ctrl-C there, before any step runs."""
    from graphrl.tasks import TASKS

    if dist.is_initialized():
        _signal_the_group()
        time.sleep(2.0)  # the signal is handled here, while the rank is still starting
    return TASKS["digits-copy"](**options)
