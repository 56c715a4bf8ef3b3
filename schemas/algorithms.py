"""The advantage estimators and losses a job may name, with what the compiler needs to know of each.

One entry per kind. The job schema validates names against these tables (an unknown name is refused
with the known ones listed), the op kinds read their ports from the traits (`needs_values`,
`trains`), and the executor looks the arithmetic up by the same name
(`graphrl.executors.algorithms.ADVANTAGE_FNS` / `POLICY_LOSS_FNS`); a test keeps the tables equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from graphrl.registry import Registry


@dataclass(frozen=True)
class EstimatorKind:
    """An advantage estimator as the compiler sees it."""

    name: str
    needs_values: bool  # reads the critic's values (an input port `values`)
    doc: str


@dataclass(frozen=True)
class LossKind:
    """A training loss as the compiler sees it."""

    name: str
    trains: Literal["policy", "critic"]  # a policy loss reads log-probs; a critic loss reads values
    off_policy: bool  # importance-corrects stale (asynchronous) batches
    doc: str


ESTIMATORS: Registry[EstimatorKind] = Registry("advantage estimator")
LOSSES: Registry[LossKind] = Registry("loss")

for _kind in (
    EstimatorKind("grpo", False, "group-relative: (r - mean_group) / std_group"),
    EstimatorKind("rloo", False, "leave-one-out baseline within the group"),
    EstimatorKind("reinforce_pp", False, "REINFORCE++: discounted returns, normalised over the batch"),
    EstimatorKind("gae", True, "generalised advantage estimation with the critic's values"),
):
    ESTIMATORS.add(_kind.name, _kind)

for _loss in (
    LossKind("ppo", "policy", False, "PPO clipped surrogate"),
    LossKind("grpo", "policy", False, "GRPO: the PPO clipped surrogate on group-relative advantages"),
    LossKind("aipo", "policy", True, "AIPO: REINFORCE with the importance weight min(pi/mu, rho)"),
    LossKind("critic", "critic", False, "clipped value regression to the returns"),
):
    LOSSES.add(_loss.name, _loss)


def check_name(value: str, table: Registry) -> str:
    """`value` if `table` has it; otherwise a ValueError listing the known names (pydantic shows it
    at the field's path)."""
    if value not in table:
        raise ValueError(f"unknown {table.what}; known: {', '.join(table.names())}")
    return value
