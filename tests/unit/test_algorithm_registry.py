"""Estimators and losses: one table of names and traits, the executor's arithmetic under the same names,
and a job naming an unknown one refused with the known names."""

from __future__ import annotations

import pytest
import torch

from graphrl.errors import GraphRLError
from graphrl.executors import algorithms as alg
from graphrl.loader import load_job_text
from graphrl.ops import OPS
from graphrl.schemas.algorithms import ESTIMATORS, LOSSES
from graphrl.schemas.job import AdvantageNode, AlgorithmSpec, TrainNode

GRPO_TINY = open("examples/grpo_tiny.yaml").read()


def test_every_estimator_has_its_arithmetic_and_nothing_else_does() -> None:
    assert ESTIMATORS.names() == alg.ADVANTAGE_FNS.names()


def test_every_policy_loss_has_its_arithmetic() -> None:
    policy_losses = [name for name in LOSSES.names() if LOSSES[name].trains == "policy"]
    assert policy_losses == alg.POLICY_LOSS_FNS.names()


@pytest.mark.parametrize("name", ESTIMATORS.names())
def test_an_estimator_reads_values_exactly_when_its_traits_say(name: str) -> None:
    node = AdvantageNode(estimator=name)
    ports = OPS["advantage"].ports(node)
    assert ("values" in ports.inputs) == ESTIMATORS[name].needs_values
    n, r, g = 4, 3, 2
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    values = torch.randn(n, r) if ESTIMATORS[name].needs_values else None
    adv, returns = alg.ADVANTAGE_FNS[name](alg.AdvantageInputs(torch.tensor([1.0, 0.0, 0.5, 0.25]), mask, values, g, node))
    assert adv.shape == returns.shape == (n, r)
    assert torch.all(adv[~mask] == 0)


def test_the_registered_losses_compute_the_documented_formulas() -> None:
    mask = torch.ones(2, 2, dtype=torch.bool)
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.5]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.25], [0.5, 0.05]]))
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    a = AlgorithmSpec(aipo_rho=2.0, clip_eps=0.2)
    x = alg.PolicyLossInputs(logp, None, behaviour, adv, mask, a)
    aipo, _ = alg.POLICY_LOSS_FNS["aipo"](x)
    weights = torch.tensor([[2.0, 1.0], [1.0, 2.0]])  # min(pi/mu, rho): 2, 1, 1, min(10, 2)
    assert torch.allclose(aipo, -(weights * adv * logp).mean())
    ppo, _ = alg.POLICY_LOSS_FNS["ppo"](x)  # no old log-probs: the behaviour log-probs are the old policy
    assert torch.allclose(ppo, alg.policy_loss(logp, behaviour, adv, mask, 0.2)[0])


@pytest.mark.parametrize("field, value, table", [("estimator", "grpoo", ESTIMATORS), ("loss", "dpo", LOSSES)])
def test_a_job_naming_an_unknown_one_is_refused_with_the_known_names(field: str, value: str, table) -> None:
    text = GRPO_TINY.replace(f"{field}: grpo", f"{field}: {value}", 1)
    assert text != GRPO_TINY
    with pytest.raises(GraphRLError) as err:
        load_job_text(text, "job.yaml")
    message = str(err.value)
    assert value in message and field in message
    assert all(name in message for name in table.names())


def test_node_specs_accept_every_registered_name() -> None:
    for name in LOSSES.names():
        assert TrainNode(model="policy", loss=name).loss == name


@pytest.mark.parametrize("name", ESTIMATORS.names())
def test_an_estimator_reads_reference_logprobs_exactly_when_it_shapes_token_rewards(name: str) -> None:
    """`kl_in: reward` needs the estimator to take the reference's log-probs; the others have no such port,
    so a job cannot wire a KL the estimator would drop."""
    ports = OPS["advantage"].ports(AdvantageNode(estimator=name))
    assert ("ref_logprobs" in ports.inputs) == ESTIMATORS[name].token_rewards
    assert ("ref_logprobs" in ports.inputs) == ("old_logprobs" in ports.inputs)


@pytest.mark.parametrize("name", ESTIMATORS.names())
def test_every_offered_normalization_runs_and_the_default_is_offered(name: str) -> None:
    kind = ESTIMATORS[name]
    assert AdvantageNode(estimator=name).normalization == kind.normalizations[0]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    values = torch.randn(4, 3) if kind.needs_values else None
    for normalize in kind.normalizations:
        node = AdvantageNode(estimator=name, normalize=normalize)
        adv, _ = alg.ADVANTAGE_FNS[name](alg.AdvantageInputs(torch.tensor([1.0, 0.0, 0.5, 0.25]), mask, values, 2, node))
        assert torch.isfinite(adv).all() and torch.all(adv[~mask] == 0)
