"""The advantage estimators and losses a job may name, with what the compiler needs to know of each.

One entry per kind. The job schema validates names against these tables (an unknown name is refused
with the known ones listed), the op kinds read their ports from the traits (`needs_values`,
`trains`), and the executor looks the arithmetic up by the same name
(`graphrl.executors.algorithms.ADVANTAGE_FNS` / `POLICY_LOSS_FNS`); a test keeps the tables equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from graphrl.schemas.registry import Registry

Normalization = Literal["group", "batch", "none"]
"""How an estimator scales its advantages: by the std of each prompt's group, by the std over the whole
batch (every data-parallel rank's responses), or not at all."""
KLEstimatorName = Literal["k1", "k2", "k3", "k3_is"]
"""Per-token estimators of KL(pi || pi_ref) (Schulman 2020; k3_is: Tang & Munos 2025)."""
KLPlacement = Literal["loss", "reward"]
"""Where the KL penalty acts: a term of the policy loss, or a per-token reward before the advantage."""
ImportanceLevel = Literal["token", "sequence", "geometric"]
"""What AIPO's importance weight pi/mu is taken over: each token's own ratio, the response's (the product of
its tokens' ratios), or the response's geometric mean (the product's 1/T-th power, T its real tokens)."""
ImportanceMode = Literal["truncate", "mask"]
"""What AIPO does with a weight outside the trust region: cap it at rho (truncated importance sampling), or
drop its tokens from the loss when it leaves [1/rho, rho] (masked importance sampling)."""
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
"""How per-token losses become one number: the mean over every real token of the batch (DAPO), the mean
over responses of each response's token mean (GRPO paper), the mean over responses of each response's
token sum divided by the generation budget R (Dr. GRPO)."""


@dataclass(frozen=True)
class EstimatorKind:
    """An advantage estimator as the compiler sees it."""

    name: str
    needs_values: bool  # reads the critic's values (an input port `values`)
    doc: str
    # The `normalize` choices the estimator offers; the first is its default.
    normalizations: tuple[Normalization, ...] = ("none",)
    # Builds per-token rewards, so a KL penalty can shape them (`algorithm.kl_in: reward`).
    token_rewards: bool = False
    # Its baseline is the other responses to the same prompt: it needs samples_per_prompt >= 2.
    group_baseline: bool = False


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
    EstimatorKind("grpo", False, "group-relative: (r - mean_group) / std_group", ("group", "batch", "none"),
                  group_baseline=True),
    EstimatorKind("rloo", False, "leave-one-out baseline within the group", ("none",), group_baseline=True),
    EstimatorKind("reinforce_pp", False, "REINFORCE++: discounted returns, normalised over the batch",
                  ("batch", "none"), token_rewards=True),
    EstimatorKind("gae", True, "generalised advantage estimation with the critic's values", ("none", "batch"),
                  token_rewards=True),
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
