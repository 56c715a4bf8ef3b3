"""RL advantage estimators and losses as pure tensor functions (no processes, no torch.distributed).

They are the arithmetic of the `advantage` and `train` nodes, kept apart from the runtime so each
formula is tested on numbers written out by hand. Shapes: N responses of R tokens; `mask` [N, R] is
bool, True on real response tokens (a prefix of each row: up to and including EOS). Token tensors are
0 where masked. Losses are token means over the mask of the whole batch (every real token weighs the
same, whatever its response's length) and return `(loss, metrics)` with plain-float metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import Tensor

from graphrl.registry import Registry
from graphrl.schemas.job import AdvantageNode, AlgorithmSpec

KLEstimator = Literal["k1", "k3"]
Metrics = dict[str, float]


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * mask) / max(sum(mask), 1), a scalar.

    `torch.where`, not a product, so NaN/inf in masked slots (e.g. log 0 of a pad) cannot leak in.
    """
    mask = mask.to(torch.bool)
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp(min=1)


def broadcast_to_tokens(advantages_n: Tensor, mask: Tensor) -> Tensor:
    """adv[N] -> adv[N, R]: every real token of response i gets adv_i; 0 where masked."""
    return torch.where(mask.to(torch.bool), advantages_n[:, None].to(torch.float32), 0.0)


def _groups(rewards_n: Tensor, group_size: int) -> Tensor:
    """rewards [N] -> [N / G, G]; responses to one prompt are contiguous blocks of G."""
    if group_size < 2:
        raise ValueError(f"a group baseline needs group_size >= 2, got {group_size}")
    if rewards_n.numel() % group_size:
        raise ValueError(f"{rewards_n.numel()} rewards do not split into groups of {group_size}")
    return rewards_n.to(torch.float32).view(-1, group_size)


# ----------------------------------------------------------------------------------------------
# Advantages


def grpo_advantages(rewards: Tensor, group_size: int, normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO (Shao et al. 2024): A_i = (r_i - mean_g(r)) / (std_g(r) + eps), per group g of group_size.

    std is the unbiased (n-1) sample std, as in TRL and verl. A group whose rewards are all equal
    gets 0. `normalize=False` (Dr. GRPO, Liu et al. 2025) drops the division: A_i = r_i - mean_g(r).
    Returns adv [N]; spread it over tokens with `broadcast_to_tokens`.
    """
    groups = _groups(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - (sum_g(r) - r_i) / (G - 1), the mean of the others.

    Leaving r_i out of its own baseline keeps the estimate unbiased. Returns adv [N].
    """
    groups = _groups(rewards, group_size)
    others_mean = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others_mean).reshape(-1)


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    normalize: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """REINFORCE++ (Hu 2025): discounted returns of token rewards, normalized over the whole batch.

    Token rewards: r_t = -kl_coef * kl_t on every real token, plus the response's reward on its last
    real token (kl [N, R] is a per-token KL estimate to the reference, e.g. k1 = logp - ref_logp).
    Returns G_t = sum_{s >= t} gamma^(s-t) r_s. Advantages A_t = (G_t - mu) / (sigma + eps), with mu
    and sigma the mean and population std over all real tokens of the batch (no per-prompt baseline:
    the batch is the baseline). Returns adv [N, R], 0 where masked.
    """
    mask = mask.to(torch.bool)
    token_rewards = _terminal_rewards(rewards, mask)
    if kl is not None and kl_coef:
        token_rewards = token_rewards - kl_coef * torch.where(mask, kl.to(torch.float32), 0.0)
    returns = torch.zeros_like(token_rewards)
    running_n = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running_n = token_rewards[:, t] + gamma * running_n
        returns[:, t] = running_n
    returns = torch.where(mask, returns, 0.0)
    if not normalize:
        return returns
    mean = masked_mean(returns, mask)
    std = masked_mean((returns - mean) ** 2, mask).sqrt()
    return torch.where(mask, (returns - mean) / (std + eps), 0.0)


def _terminal_rewards(rewards_n: Tensor, mask: Tensor) -> Tensor:
    """[N, R] zeros with reward_i on the last real token of row i (rows with no real token get none)."""
    num_tokens = mask.shape[1]
    slot_r = torch.arange(num_tokens, device=mask.device)
    last_n = torch.where(mask, slot_r, -1).max(dim=1).values
    is_last = (slot_r[None, :] == last_n[:, None]) & mask
    return torch.where(is_last, rewards_n[:, None].to(torch.float32), 0.0)


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) with the reward on the last real token.

    values [N, R] is V(s_t), the critic's value before token t. With V = 0 past the last real token:
        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        returns = A_t + V_t   (the critic's regression target)
    Returns (advantages [N, R], returns [N, R]), 0 where masked; no gradient flows into values.
    """
    mask = mask.to(torch.bool)
    token_rewards = _terminal_rewards(rewards, mask)
    values = torch.where(mask, values.to(torch.float32), 0.0)
    num_tokens = values.shape[1]
    advantages = torch.zeros_like(values)
    next_value_n = torch.zeros_like(values[:, 0])
    next_adv_n = torch.zeros_like(values[:, 0])
    for t in reversed(range(num_tokens)):
        delta_n = token_rewards[:, t] + gamma * next_value_n - values[:, t]
        adv_n = torch.where(mask[:, t], delta_n + gamma * lam * next_adv_n, 0.0)
        advantages[:, t] = adv_n
        next_value_n, next_adv_n = values[:, t], adv_n
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


# ----------------------------------------------------------------------------------------------
# Losses


def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float
) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate (also GRPO's): with ratio = exp(logp - old_logp) per token,
        loss = -mean_mask( min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) ).
    Metrics: loss, clip_frac (tokens whose clipped term is the smaller one, so they get no gradient),
    ratio_mean, approx_kl (mean of k3 = exp(d) - d - 1 with d = old - logp, >= 0).
    """
    mask = mask.to(torch.bool)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    loss = -masked_mean(torch.minimum(unclipped, clipped), mask)
    with torch.no_grad():
        neg = -log_ratio
        metrics = {
            "loss": loss.item(),
            "clip_frac": masked_mean((clipped < unclipped).float(), mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "approx_kl": masked_mean(torch.exp(neg) - neg - 1.0, mask).item(),
        }
    return loss, metrics


def aipo_loss(
    logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor, rho: float
) -> tuple[Tensor, Metrics]:
    """AIPO (LlamaRL, Wu et al. 2025): off-policy REINFORCE with a truncated importance weight.

        w = min(exp(logp - behaviour_logp), rho), detached
        loss = -mean_mask( w * A * logp )
    The behaviour log-probs come from the (possibly stale) generator; truncating at rho bounds the
    variance the lag introduces. Metrics: loss, clipped_frac (tokens with exp(...) > rho), weight_mean.
    """
    mask = mask.to(torch.bool)
    with torch.no_grad():
        raw_weight = torch.exp(logprobs - behaviour_logprobs)
        weight = torch.clamp(raw_weight, max=rho)
    loss = -masked_mean(weight * advantages * logprobs, mask)
    metrics = {
        "loss": loss.item(),
        "clipped_frac": masked_mean((raw_weight > rho).float(), mask).item(),
        "weight_mean": masked_mean(weight, mask).item(),
    }
    return loss, metrics


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: KLEstimator = "k3"
) -> tuple[Tensor, Metrics]:
    """KL(pi || pi_ref) estimated per sampled token (Schulman, "Approximating KL divergence", 2020).

    With d = ref_logp - logp:  k1 = -d = logp - ref_logp (unbiased, can be negative);
    k3 = exp(d) - d - 1 (unbiased, always >= 0, lower variance). loss = mean_mask(k); add it
    times kl_coef. Metrics: kl.
    """
    if estimator == "k1":
        per_token = logprobs - ref_logprobs
    elif estimator == "k3":
        d = ref_logprobs - logprobs
        per_token = torch.exp(d) - d - 1.0
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1' or 'k3'")
    loss = masked_mean(per_token, mask)
    return loss, {"kl": loss.item()}


def entropy_bonus(entropy: Tensor, mask: Tensor) -> tuple[Tensor, Metrics]:
    """loss = -mean_mask(entropy): adding entropy_coef * loss rewards keeping the policy spread out.

    Metrics: entropy (the positive mean).
    """
    mean_entropy = masked_mean(entropy, mask)
    return -mean_entropy, {"entropy": mean_entropy.item()}


def critic_loss(
    values: Tensor, old_values: Tensor | None, returns: Tensor, mask: Tensor, clip: float
) -> tuple[Tensor, Metrics]:
    """Clipped value loss (PPO2 / OpenAI baselines):

        v_clip = old_v + clip(v - old_v, -clip, clip)
        loss   = 0.5 * mean_mask( max((v - R)^2, (v_clip - R)^2) )
    The max makes the loss pessimistic: a value that jumps more than `clip` from old_v towards the
    return earns no further gain. Without old_values: loss = 0.5 * mean_mask((v - R)^2).
    Metrics: loss, clip_frac (tokens where the clipped error is the larger), value_mean.
    """
    mask = mask.to(torch.bool)
    unclipped = (values - returns) ** 2
    if old_values is None:
        per_token = unclipped
        clipped_active = torch.zeros_like(mask)
    else:
        values_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (values_clipped - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_active = clipped > unclipped
    loss = 0.5 * masked_mean(per_token, mask)
    metrics = {
        "loss": loss.item(),
        "clip_frac": masked_mean(clipped_active.float(), mask).item(),
        "value_mean": masked_mean(values.detach(), mask).item(),
    }
    return loss, metrics


# ----------------------------------------------------------------------------------------------
# The arithmetic of each estimator and policy loss, by the names in graphrl.schemas.algorithms


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read: rewards [N], the response mask [N, R], the critic's values [N, R]
    (None unless the estimator needs them), the group size and the node's settings."""

    rewards: Tensor
    mask: Tensor
    values: Tensor | None
    group_size: int
    spec: AdvantageNode


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a policy loss may read: the current log-probs, the old policy's (None when the job has no
    old-logprob node), the generator's behaviour log-probs, per-token advantages and the mask."""

    logprobs: Tensor
    old_logprobs: Tensor | None
    behaviour_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    algorithm: AlgorithmSpec


AdvantageFn = Callable[[AdvantageInputs], tuple[Tensor, Tensor]]
"""-> (advantages [N, R], returns [N, R])."""
PolicyLossFn = Callable[[PolicyLossInputs], tuple[Tensor, Metrics]]

ADVANTAGE_FNS: Registry[AdvantageFn] = Registry("advantage estimator")
POLICY_LOSS_FNS: Registry[PolicyLossFn] = Registry("policy loss")


@ADVANTAGE_FNS.register("grpo")
def _grpo(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    adv = broadcast_to_tokens(grpo_advantages(x.rewards, x.group_size, x.spec.normalize), x.mask)
    return adv, adv


@ADVANTAGE_FNS.register("rloo")
def _rloo(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    adv = broadcast_to_tokens(rloo_advantages(x.rewards, x.group_size), x.mask)
    return adv, adv


@ADVANTAGE_FNS.register("reinforce_pp")
def _reinforce_pp(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    adv = reinforce_pp_advantages(x.rewards, x.mask, gamma=x.spec.gamma, normalize=x.spec.normalize)
    return adv, adv


@ADVANTAGE_FNS.register("gae")
def _gae(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    assert x.values is not None, "gae reads the critic's values"
    return gae(x.rewards, x.values, x.mask, x.spec.gamma, x.spec.lam)


def _clipped_surrogate(x: PolicyLossInputs) -> tuple[Tensor, Metrics]:
    old = x.old_logprobs if x.old_logprobs is not None else x.behaviour_logprobs
    return policy_loss(x.logprobs, old, x.advantages, x.mask, x.algorithm.clip_eps)


POLICY_LOSS_FNS.add("ppo", _clipped_surrogate)
POLICY_LOSS_FNS.add("grpo", _clipped_surrogate)


@POLICY_LOSS_FNS.register("aipo")
def _aipo(x: PolicyLossInputs) -> tuple[Tensor, Metrics]:
    return aipo_loss(x.logprobs, x.behaviour_logprobs, x.advantages, x.mask, x.algorithm.aipo_rho)
