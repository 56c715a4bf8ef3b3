"""RL advantage estimators and losses as pure tensor functions (no processes, no torch.distributed).

They are the arithmetic of the `advantage` and `train` nodes, kept apart from the runtime so each
formula is tested on numbers written out by hand and against references written from the papers.
Shapes: N responses of R tokens; `mask` [N, R] is bool, True on real response tokens (a prefix of each
row: up to and including EOS). Token tensors are 0 where masked.

Batch-wide quantities never depend on how the batch is split over ranks or micro-batches: statistics
over the whole batch go through a `BatchSum` (the executor's all-reduce over the data-parallel ranks;
the identity on one rank), and a loss is a weighted sum `sum(w * loss_t)` whose token weights
(`TokenWeights`) are computed from batch-wide counts, so each rank's (or micro-batch's) sum is exactly
its share of the batch's loss. Losses return `(loss, metrics)` with plain-float metrics that are shares
in the same sense (token means over the whole batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from graphrl.schemas.algorithms import ImportanceLevel, ImportanceMode, KLEstimatorName, LossAggregation, Normalization
from graphrl.schemas.job import AdvantageNode, AlgorithmSpec
from graphrl.schemas.registry import Registry

KLEstimator = KLEstimatorName
Metrics = dict[str, float]
BatchSum = Callable[[Tensor], Tensor]
"""Sums a float64 vector over every data-parallel rank's part of the batch (identity on one rank)."""

STD_EPS = 1e-6
"""Added to a std before dividing by it (GRPO's group std, REINFORCE++'s and GAE whitening's batch std)."""
CONSTANT_GROUP_TOL = 1e-6
"""A group whose rewards span at most this (relative to max(1, |largest reward|)) counts as constant and
gets advantage 0 exactly: its rewards say nothing about which response is better."""


def local_sum(x: Tensor) -> Tensor:
    """The `BatchSum` of a batch held whole (one rank, no split)."""
    return x


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
    """rewards [N] -> float64 [N / G, G]; responses to one prompt are contiguous blocks of G."""
    if group_size < 2:
        raise ValueError(f"a group baseline needs group_size >= 2, got {group_size}")
    if rewards_n.numel() % group_size:
        raise ValueError(f"{rewards_n.numel()} rewards do not split into groups of {group_size}")
    return rewards_n.to(torch.float64).view(-1, group_size)


def _masked_stats(x: Tensor, mask: Tensor, batch_sum: BatchSum) -> tuple[Tensor, Tensor]:
    """(mean, population std) of x over the real tokens of the whole batch, in float64."""
    x64 = torch.where(mask, x.to(torch.float64), 0.0)
    sums = batch_sum(torch.stack([x64.sum(), (x64 * x64).sum(), mask.sum().to(torch.float64)]))
    count = sums[2].clamp(min=1.0)
    mean = sums[0] / count
    var = (sums[1] / count - mean * mean).clamp(min=0.0)
    return mean, var.sqrt()


# ----------------------------------------------------------------------------------------------
# Advantages


def grpo_advantages(rewards: Tensor, group_size: int, normalize: Normalization = "group", eps: float = STD_EPS,
                    *, batch_sum: BatchSum = local_sum) -> Tensor:
    """GRPO (Shao et al. 2024): A_i = (r_i - mean_g(r)) / (std_g(r) + eps), per group g of group_size.

    std is the unbiased (n-1) sample std, as in TRL and verl; eps = STD_EPS. The statistics are float64,
    and a group whose rewards are equal (within CONSTANT_GROUP_TOL) gets exactly 0: in float32 the mean
    of G equal rewards can miss them by an ulp, and that ulp divided by (std ~ 1e-8) + eps gave such a
    group advantages of ~0.1, all of one sign. `normalize`:
      'group'  divide by the group's std (the paper);
      'batch'  divide by the std over the whole batch of the centred rewards, sqrt(sum(c^2) / N), N the
               batch's responses on every rank (REINFORCE++-baseline's global normalisation);
      'none'   A_i = r_i - mean_g(r) (Dr. GRPO, Liu et al. 2025).
    Returns adv [N] float32; spread it over tokens with `broadcast_to_tokens`.
    """
    groups = _groups(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    spread = groups.amax(dim=1, keepdim=True) - groups.amin(dim=1, keepdim=True)
    constant = spread <= CONSTANT_GROUP_TOL * groups.abs().amax(dim=1, keepdim=True).clamp(min=1.0)
    centred = torch.where(constant, 0.0, centred)
    if normalize == "group":
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    elif normalize == "batch":
        sums = batch_sum(torch.stack([(centred * centred).sum(), torch.tensor(float(centred.numel()),
                                                                             dtype=torch.float64)]))
        centred = centred / ((sums[0] / sums[1].clamp(min=1.0)).sqrt() + eps)
    elif normalize != "none":
        raise ValueError(f"grpo: unknown normalize {normalize!r}; expected 'group', 'batch' or 'none'")
    return centred.reshape(-1).to(torch.float32)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - (sum_g(r) - r_i) / (G - 1), the mean of the others.

    Leaving r_i out of its own baseline keeps the estimate unbiased. Float64 arithmetic, so a group of
    equal rewards gets exactly 0. Returns adv [N] float32.
    """
    groups = _groups(rewards, group_size)
    others_mean = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others_mean).reshape(-1).to(torch.float32)


def _token_rewards(rewards_n: Tensor, mask: Tensor, kl: Tensor | None, kl_coef: float) -> Tensor:
    """r_t = -kl_coef * kl_t on every real token, plus the response's reward on its last real token."""
    token_rewards = _terminal_rewards(rewards_n, mask)
    if kl is not None and kl_coef:
        token_rewards = token_rewards - kl_coef * torch.where(mask, kl.to(torch.float32), 0.0)
    return token_rewards


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    normalize: Normalization = "batch",
    eps: float = STD_EPS,
    batch_sum: BatchSum = local_sum,
) -> Tensor:
    """REINFORCE++ (Hu 2025): discounted returns of token rewards, normalized over the whole batch.

    Token rewards: r_t = -kl_coef * kl_t on every real token, plus the response's reward on its last
    real token (kl [N, R] is a per-token KL estimate to the reference, e.g. k1 = logp - ref_logp).
    Returns G_t = sum_{s >= t} gamma^(s-t) r_s. With normalize 'batch', A_t = (G_t - mu) / (sigma + eps),
    mu and sigma the mean and population std over all real tokens of the batch, every rank's (no
    per-prompt baseline: the batch is the baseline); 'none' returns G_t. Returns adv [N, R], 0 where masked.
    """
    mask = mask.to(torch.bool)
    token_rewards = _token_rewards(rewards, mask, kl, kl_coef)
    returns = torch.zeros_like(token_rewards)
    running_n = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):  # over the real tokens (an episode's environment ones skipped)
        running_n = torch.where(mask[:, t], token_rewards[:, t] + gamma * running_n, running_n)
        returns[:, t] = running_n
    returns = torch.where(mask, returns, 0.0)
    if normalize == "none":
        return returns
    if normalize != "batch":
        raise ValueError(f"reinforce_pp: unknown normalize {normalize!r}; expected 'batch' or 'none'")
    mean, std = _masked_stats(returns, mask, batch_sum)
    return torch.where(mask, ((returns.to(torch.float64) - mean) / (std + eps)).to(torch.float32), 0.0)


def _terminal_rewards(rewards_n: Tensor, mask: Tensor) -> Tensor:
    """[N, R] zeros with reward_i on the last real token of row i (rows with no real token get none)."""
    num_tokens = mask.shape[1]
    slot_r = torch.arange(num_tokens, device=mask.device)
    last_n = torch.where(mask, slot_r, -1).max(dim=1).values
    is_last = (slot_r[None, :] == last_n[:, None]) & mask
    return torch.where(is_last, rewards_n[:, None].to(torch.float32), 0.0)


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float, *, kl: Tensor | None = None,
        kl_coef: float = 0.0, whiten: bool = False, eps: float = STD_EPS,
        batch_sum: BatchSum = local_sum) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) with the reward on the last real token. Masked
    tokens between real ones (an episode's environment tokens) are skipped: the estimate is that of the real
    tokens laid end to end.

    values [N, R] is V(s_t), the critic's value before token t. With V = 0 past the last real token:
        r_t     = reward on the last real token - kl_coef * kl_t (KL reward shaping, Ouyang et al. 2022)
        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        returns = A_t + V_t   (the critic's regression target, from the unwhitened A)
    `whiten`: A_t <- (A_t - mu) / (sigma + eps) over every real token of the batch (every rank's).
    Returns (advantages [N, R], returns [N, R]), 0 where masked; no gradient flows into values.
    """
    mask = mask.to(torch.bool)
    token_rewards = _token_rewards(rewards, mask, kl, kl_coef)
    values = torch.where(mask, values.to(torch.float32), 0.0)
    num_tokens = values.shape[1]
    advantages = torch.zeros_like(values)
    next_value_n = torch.zeros_like(values[:, 0])
    next_adv_n = torch.zeros_like(values[:, 0])
    for t in reversed(range(num_tokens)):
        delta_n = token_rewards[:, t] + gamma * next_value_n - values[:, t]
        adv_n = torch.where(mask[:, t], delta_n + gamma * lam * next_adv_n, 0.0)
        advantages[:, t] = adv_n
        # A masked token inside a response (an episode's environment tokens) is skipped, not an end: the
        # recursion runs over the real tokens as if they were contiguous.
        next_value_n = torch.where(mask[:, t], values[:, t], next_value_n)
        next_adv_n = torch.where(mask[:, t], adv_n, next_adv_n)
    returns = torch.where(mask, advantages + values, 0.0)
    if whiten:
        mean, std = _masked_stats(advantages, mask, batch_sum)
        advantages = torch.where(mask, ((advantages.to(torch.float64) - mean) / (std + eps)).to(torch.float32), 0.0)
    return advantages, returns


# ----------------------------------------------------------------------------------------------
# Aggregation: per-token weights from batch-wide counts


@dataclass(frozen=True)
class TokenWeights:
    """Per-token weights [N, R] of this part of the batch: `loss` aggregates the loss (loss = sum(w * l_t)),
    `stats` is the token mean over the whole batch (for metrics). Computed from the whole batch's counts,
    so summing over ranks and micro-batches gives the batch's value."""

    loss: Tensor
    stats: Tensor

    def rows(self, rows: slice) -> "TokenWeights":
        """The weights of responses `rows` (a micro-batch)."""
        return TokenWeights(self.loss[rows], self.stats[rows])


def batch_counts(mask: Tensor) -> Tensor:
    """float64 [real tokens, responses with at least one real token] of this part of the batch; sum them
    over the data-parallel ranks before `token_weights`."""
    mask = mask.to(torch.bool)
    return torch.stack([mask.sum(), mask.any(dim=1).sum()]).to(torch.float64)


def token_weights(mask: Tensor, agg: LossAggregation, counts: Tensor | None = None) -> TokenWeights:
    """The weights of `agg` for this part of the batch, given the whole batch's `batch_counts` (default:
    this part is the whole batch). With T real tokens, N responses, |o_i| response i's tokens and R the
    generation budget (mask.shape[1]):
        token_mean               w_it = 1 / T                  (DAPO; "bnpo")
        seq_mean_token_mean      w_it = 1 / (N * |o_i|)        (the GRPO paper)
        seq_mean_token_sum_norm  w_it = 1 / (N * R)            (Dr. GRPO: a constant normaliser)
    0 where masked; `stats` is always the token mean's."""
    mask = mask.to(torch.bool)
    counts = batch_counts(mask) if counts is None else counts
    num_tokens, num_seqs = counts[0].clamp(min=1.0), counts[1].clamp(min=1.0)
    real = mask.to(torch.float64)
    stats = real / num_tokens
    if agg == "token_mean":
        loss = stats
    elif agg == "seq_mean_token_mean":
        loss = real / real.sum(dim=1, keepdim=True).clamp(min=1.0) / num_seqs
    elif agg == "seq_mean_token_sum_norm":
        loss = real / (num_seqs * mask.shape[1])
    else:
        raise ValueError(f"unknown loss aggregation {agg!r}")
    return TokenWeights(loss.to(torch.float32), stats.to(torch.float32))


def weighted_sum(x: Tensor, weights: Tensor) -> Tensor:
    """sum(w * x) over the slots of positive weight (NaN/inf in masked slots cannot leak in)."""
    return torch.where(weights > 0, x * weights, 0.0).sum()


def _weights_of(mask: Tensor, weights: TokenWeights | None) -> TokenWeights:
    return token_weights(mask, "token_mean") if weights is None else weights


# ----------------------------------------------------------------------------------------------
# Losses. Each takes optional `weights` (`TokenWeights`); without them, the token mean over `mask`.


def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float, *,
    clip_eps_high: float | None = None, dual_clip_c: float | None = None, weights: TokenWeights | None = None,
) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate (also GRPO's): with ratio = exp(logp - old_logp) per token,
        obj_t = min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)
        obj_t = max(obj_t, c * A) where A < 0        (dual clip, Ye et al. 2020, when dual_clip_c = c)
        loss  = -sum_t w_t obj_t                     (w: the aggregation's weights)
    clip_eps_high defaults to clip_eps (symmetric); a larger one is DAPO's clip-higher.
    Metrics: loss, clip_frac (tokens whose clipped term is the smaller one, so they get no gradient),
    dual_clip_frac, ratio_mean, approx_kl = mean of k3 = (ratio - 1) - log ratio, an unbiased, >= 0
    estimate of KL(pi_old || pi) from tokens sampled by pi_old.
    """
    mask = mask.to(torch.bool)
    w = _weights_of(mask, weights)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * advantages
    objective = torch.minimum(unclipped, clipped)
    dual_active = torch.zeros_like(mask)
    if dual_clip_c is not None:
        floor = dual_clip_c * advantages
        dual_active = (advantages < 0) & (objective < floor)
        objective = torch.where(dual_active, floor, objective)
    loss = -weighted_sum(objective, w.loss)
    with torch.no_grad():
        metrics = {
            "loss": loss.item(),
            "clip_frac": weighted_sum((clipped < unclipped).float(), w.stats).item(),
            "dual_clip_frac": weighted_sum(dual_active.float(), w.stats).item(),
            "ratio_mean": weighted_sum(ratio, w.stats).item(),
            "approx_kl": weighted_sum(torch.expm1(log_ratio) - log_ratio, w.stats).item(),
        }
    return loss, metrics


def aipo_loss(
    logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor, rho: float, *,
    weights: TokenWeights | None = None, level: ImportanceLevel = "token", mode: ImportanceMode = "truncate",
) -> tuple[Tensor, Metrics]:
    """AIPO (LlamaRL, Wu et al. 2025): off-policy REINFORCE with a truncated importance weight.

        w_is = min(exp(logp - behaviour_logp), rho), detached
        loss = -sum_t w_t * w_is * A * logp          (w: the aggregation's weights)
    The behaviour log-probs come from the (possibly stale) generator or serving engine; truncating at rho
    bounds the variance the lag or the mismatch introduces. `level` takes the ratio per token, per
    response (the product of its tokens' ratios, on every token of it) or as the response's geometric
    mean; `mode="mask"` keeps the weight inside [1/rho, rho] and gives the tokens outside it weight 0
    instead of capping. Metrics: loss, clipped_frac (tokens whose weight was capped or masked),
    weight_mean.
    """
    mask = mask.to(torch.bool)
    w = _weights_of(mask, weights)
    with torch.no_grad():
        log_ratio = torch.where(mask, logprobs - behaviour_logprobs, 0.0)
        if level != "token":  # one ratio per response, in log space (a product of ratios overflows)
            per_row = log_ratio.sum(dim=-1, keepdim=True)
            if level == "geometric":
                per_row = per_row / mask.sum(dim=-1, keepdim=True).clamp(min=1)
            log_ratio = per_row.expand_as(log_ratio)
        log_rho = math.log(rho)
        if mode == "truncate":
            outside = log_ratio > log_rho
            weight = torch.exp(log_ratio.clamp(max=log_rho))
        else:
            outside = log_ratio.abs() > log_rho
            weight = torch.where(outside, 0.0, torch.exp(log_ratio.clamp(-log_rho, log_rho)))
    loss = -weighted_sum(weight * advantages * logprobs, w.loss)
    metrics = {
        "loss": loss.item(),
        "clipped_frac": weighted_sum(outside.float(), w.stats).item(),
        "weight_mean": weighted_sum(weight, w.stats).item(),
    }
    return loss, metrics


def kl_terms(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator,
             sampling_logprobs: Tensor | None = None) -> Tensor:
    """Per-token estimates of KL(pi || pi_ref) at tokens sampled from pi_sampling (Schulman, "Approximating
    KL divergence", 2020; Tang & Munos 2025, arXiv 2506.09477). With d = ref_logp - logp:

        k1    = -d              value unbiased;  loss gradient: 0 in expectation (on-policy)
        k2    = d^2 / 2         value biased;    loss gradient: that of KL(pi || ref)
        k3    = exp(d) - d - 1  value unbiased;  loss gradient: that of KL(ref || pi)
        k3_is = rho * k3, rho = exp(logp - sg(sampling_logp)) (1 in value on-policy);
                                value unbiased;  loss gradient: that of KL(pi || ref), also off-policy

    (gradients in expectation over tokens drawn from pi; sg = no gradient). k3_is needs
    `sampling_logprobs`, the log-probs of the policy that drew the tokens."""
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator in ("k3", "k3_is"):
        k3 = torch.expm1(d) - d
        if estimator == "k3":
            return k3
        if sampling_logprobs is None:
            raise ValueError("k3_is weighs k3 by pi / pi_sampling and needs the sampling policy's log-probs")
        return torch.exp(logprobs - sampling_logprobs.detach()) * k3
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1', 'k2', 'k3' or 'k3_is'")


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: KLEstimator = "k3", *,
    sampling_logprobs: Tensor | None = None, weights: TokenWeights | None = None,
) -> tuple[Tensor, Metrics]:
    """loss = sum_t w_t k_t with k the `kl_terms` of `estimator` (add it times kl_coef). Metrics: kl."""
    w = _weights_of(mask, weights)
    per_token = kl_terms(logprobs, ref_logprobs, estimator, sampling_logprobs)
    loss = weighted_sum(per_token, w.loss)
    return loss, {"kl": loss.item()}


def entropy_bonus(entropy: Tensor, mask: Tensor, *, weights: TokenWeights | None = None) -> tuple[Tensor, Metrics]:
    """loss = -sum_t w_t entropy_t: adding entropy_coef * loss rewards keeping the policy spread out.

    Metrics: entropy (the positive token mean)."""
    w = _weights_of(mask, weights)
    loss = -weighted_sum(entropy, w.loss)
    return loss, {"entropy": weighted_sum(entropy.detach(), w.stats).item()}


def critic_loss(
    values: Tensor, old_values: Tensor | None, returns: Tensor, mask: Tensor, clip: float, *,
    weights: TokenWeights | None = None,
) -> tuple[Tensor, Metrics]:
    """Clipped value loss (PPO2 / OpenAI baselines):

        v_clip = old_v + clip(v - old_v, -clip, clip)
        loss   = 0.5 * sum_t w_t max((v - R)^2, (v_clip - R)^2)
    The max makes the loss pessimistic: a value that jumps more than `clip` from old_v towards the
    return earns no further gain. Without old_values: loss = 0.5 * sum_t w_t (v - R)^2.
    Metrics: loss, clip_frac (tokens where the clipped error is the larger), value_mean.
    """
    mask = mask.to(torch.bool)
    w = _weights_of(mask, weights)
    unclipped = (values - returns) ** 2
    if old_values is None:
        per_token = unclipped
        clipped_active = torch.zeros_like(mask)
    else:
        values_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (values_clipped - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_active = clipped > unclipped
    loss = 0.5 * weighted_sum(per_token, w.loss)
    metrics = {
        "loss": loss.item(),
        "clip_frac": weighted_sum(clipped_active.float(), w.stats).item(),
        "value_mean": weighted_sum(values.detach(), w.stats).item(),
    }
    return loss, metrics


# ----------------------------------------------------------------------------------------------
# The arithmetic of each estimator and policy loss, by the names in graphrl.schemas.algorithms


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read: rewards [N], the response mask [N, R], the critic's values [N, R]
    (None unless the estimator needs them), the group size and the node's settings; for KL reward
    shaping, per-token KL estimates [N, R] and their coefficient; and the sum over the batch's ranks."""

    rewards: Tensor
    mask: Tensor
    values: Tensor | None
    group_size: int
    spec: AdvantageNode
    kl: Tensor | None = None
    kl_coef: float = 0.0
    batch_sum: BatchSum = local_sum


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a policy loss may read: the current log-probs, the old policy's (None when the job has no
    old-logprob node), the generator's behaviour log-probs, per-token advantages, the mask, the settings
    and the aggregation's weights (None: the token mean over `mask`)."""

    logprobs: Tensor
    old_logprobs: Tensor | None
    behaviour_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    algorithm: AlgorithmSpec
    weights: TokenWeights | None = None


AdvantageFn = Callable[[AdvantageInputs], tuple[Tensor, Tensor]]
"""-> (advantages [N, R], returns [N, R])."""
PolicyLossFn = Callable[[PolicyLossInputs], tuple[Tensor, Metrics]]

ADVANTAGE_FNS: Registry[AdvantageFn] = Registry("advantage estimator")
POLICY_LOSS_FNS: Registry[PolicyLossFn] = Registry("policy loss")


@ADVANTAGE_FNS.register("grpo")
def _grpo(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    adv_n = grpo_advantages(x.rewards, x.group_size, x.spec.normalization, batch_sum=x.batch_sum)
    adv = broadcast_to_tokens(adv_n, x.mask)
    return adv, adv


@ADVANTAGE_FNS.register("rloo")
def _rloo(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    adv = broadcast_to_tokens(rloo_advantages(x.rewards, x.group_size), x.mask)
    return adv, adv


@ADVANTAGE_FNS.register("reinforce_pp")
def _reinforce_pp(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    adv = reinforce_pp_advantages(x.rewards, x.mask, kl=x.kl, kl_coef=x.kl_coef, gamma=x.spec.gamma,
                                  normalize=x.spec.normalization, batch_sum=x.batch_sum)
    return adv, adv


@ADVANTAGE_FNS.register("gae")
def _gae(x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    assert x.values is not None, "gae reads the critic's values"
    return gae(x.rewards, x.values, x.mask, x.spec.gamma, x.spec.lam, kl=x.kl, kl_coef=x.kl_coef,
               whiten=x.spec.normalization == "batch", batch_sum=x.batch_sum)


def _clipped_surrogate(x: PolicyLossInputs) -> tuple[Tensor, Metrics]:
    old = x.old_logprobs if x.old_logprobs is not None else x.behaviour_logprobs
    a = x.algorithm
    return policy_loss(x.logprobs, old, x.advantages, x.mask, a.clip_eps, clip_eps_high=a.clip_eps_high,
                       dual_clip_c=a.dual_clip_c, weights=x.weights)


POLICY_LOSS_FNS.add("ppo", _clipped_surrogate)
POLICY_LOSS_FNS.add("grpo", _clipped_surrogate)


@POLICY_LOSS_FNS.register("aipo")
def _aipo(x: PolicyLossInputs) -> tuple[Tensor, Metrics]:
    a = x.algorithm
    return aipo_loss(x.logprobs, x.behaviour_logprobs, x.advantages, x.mask, a.aipo_rho, weights=x.weights,
                     level=a.aipo_level, mode=a.aipo_mode)
