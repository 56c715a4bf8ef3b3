"""The checks that stop a run before a bad number spreads (executors/guards.py), and metrics lines
that stay JSON whatever the numbers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from graphrl.errors import RunError
from graphrl.executors.guards import check_rewards, check_update, check_weights, reward_tensor
from graphrl.executors.outputs import json_line
from graphrl.rewards import RewardRuleError, combined_reward


def test_a_nan_reward_names_its_source_step_rollout_and_prompt() -> None:
    rewards = torch.tensor([0.0, 1.0, float("nan"), 0.5])
    with pytest.raises(RunError) as info:
        check_rewards(rewards, "reward node 'score' (function 'mod:fn')", 7, 8, lambda i: f"prompt number {i}")
    text = str(info.value)
    assert "reward node 'score' (function 'mod:fn')" in text and "step 7" in text
    assert "rollout 10" in text and "prompt number 2" in text and "nan" in text
    check_rewards(torch.tensor([0.0, 1.0]), "x", 0, 0, str)  # finite: nothing raised


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_an_infinite_reward_is_refused(value: float) -> None:
    with pytest.raises(RunError, match="step 3, rollout 1"):
        check_rewards(torch.tensor([0.0, value]), "src", 3, 0, str)


def test_a_reward_function_returning_a_string_is_named() -> None:
    """A reward function returning a string failed with AttributeError ('str' has no attribute 'float')."""
    with pytest.raises(RunError, match=r"function 'm:f' returned a str \('1.0'\), not a tensor"):
        reward_tensor("1.0", 4, "function 'm:f'")
    with pytest.raises(RunError, match="returned shape"):
        reward_tensor(torch.zeros(3), 4, "f")
    with pytest.raises(RunError, match="torch.bool"):
        reward_tensor(torch.zeros(4, dtype=torch.bool), 4, "f")
    assert reward_tensor([1, 0.5], 2, "f").tolist() == [1.0, 0.5]
    assert reward_tensor(torch.ones(2, dtype=torch.int64), 2, "f").dtype == torch.float32


def _nan_rule(response: str, answer: str) -> float:
    return float("nan")


def _text_rule(response: str, answer: str) -> str:
    return "1"


@pytest.mark.parametrize(("rule", "says"), [("_nan_rule", "returned nan, not a finite number"),
                                            ("_text_rule", "returned str '1', not a number")])
def test_an_answer_rule_giving_no_finite_number_names_the_rule_and_rollout(rule: str, says: str) -> None:
    """float(rule(...)) accepted the string '1' and NaN alike; both now name the rule and the rollout."""
    with pytest.raises(RewardRuleError) as info:
        combined_reward({f"{__name__}:{rule}": 1.0}, ["a", "b"], ["1", "2"])
    assert says in str(info.value) and rule in str(info.value) and info.value.index == 0


def test_a_non_finite_loss_or_gradient_stops_before_the_optimizer_step() -> None:
    check_update(0.5, 2.0, node="update", step=3)
    with pytest.raises(RunError, match="'update', step 3: loss nan; the optimizer step was not taken"):
        check_update(float("nan"), 2.0, node="update", step=3)
    with pytest.raises(RunError, match="gradient norm inf"):
        check_update(0.5, float("inf"), node="update", step=3)


def test_guarded_update_leaves_the_weights_as_they_were() -> None:
    """The check sits between backward and the optimizer step: with a NaN loss the weights stay finite."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.ones(1, 3)).sum() * float("nan")
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RunError):
        check_update(float(loss.detach()), float(norm), node="u", step=0)
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_weights_with_nan_are_never_checkpointed() -> None:
    check_weights({"policy": {"w": torch.ones(2)}}, 1)
    with pytest.raises(RunError, match="policy after step 4 hold NaN or inf \\(w\\); no checkpoint"):
        check_weights({"policy": {"w": torch.tensor([1.0, float("nan")])}}, 4)


def test_metrics_lines_are_json_whatever_the_numbers() -> None:
    """metrics.jsonl held bare `NaN`, which no JSON reader accepts."""
    line = json_line({"step": 1, "loss": float("nan"), "kl": float("inf"), "nested": [float("-inf"), 1.0]})
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"step": 1, "loss": None, "kl": None, "nested": [None, 1.0]}
    assert not math.isnan(json.loads(json_line({"x": 0.25}))["x"])
