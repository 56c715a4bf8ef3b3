"""The training loss of one `train` node over a typed batch, and the micro-batches a rank runs it in.

The executor's `train_step` reads its inputs, cuts its rows into micro-batches and calls
`policy_objective` / `critic_objective` on each; everything here is pure arithmetic (no processes), so
the whole-batch step and the micro-batched step are compared in unit tests. The objective of a
micro-batch is its exact share of the batch's loss: the aggregation's token weights (`TokenWeights`)
come from the whole batch's counts, so the shares of every micro-batch on every rank add up to the
loss of the batch held on one rank, and so do the gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from graphrl.executors import algorithms as alg
from graphrl.schemas.job import AlgorithmSpec


@dataclass(frozen=True)
class PolicyBatch:
    """A policy loss's tensors for some responses, [n, R] each: the current log-probs and entropy (of the
    sampling distribution, logits / T), the old policy's and the reference's log-probs (None when the
    job has no such node), the generator's behaviour log-probs, the advantages, the mask, the
    aggregation's weights and, with `kl_in: reward`, the per-token KL the rewards were shaped with
    (reported, not differentiated)."""

    logprobs: Tensor
    entropy: Tensor
    old_logprobs: Tensor | None
    behaviour_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    mask: Tensor
    weights: alg.TokenWeights
    reward_kl: Tensor | None = None


def policy_objective(batch: PolicyBatch, loss_name: str, algorithm: AlgorithmSpec) -> tuple[Tensor, alg.Metrics]:
    """The policy loss `loss_name` + kl_coef * KL (when the KL is in the loss) - entropy_coef * entropy,
    all aggregated with the same weights. Metrics: the loss's own, kl (in the loss, or the token mean of
    the KL the rewards were shaped with), entropy, loss (the total)."""
    a = algorithm
    inputs = alg.PolicyLossInputs(batch.logprobs, batch.old_logprobs, batch.behaviour_logprobs, batch.advantages,
                                  batch.mask, a, batch.weights)
    loss, metrics = alg.POLICY_LOSS_FNS[loss_name](inputs)
    if batch.ref_logprobs is not None and a.kl_coef > 0 and a.kl_in == "loss":
        sampling = batch.old_logprobs if batch.old_logprobs is not None else batch.behaviour_logprobs
        kl, kl_metrics = alg.kl_penalty(batch.logprobs, batch.ref_logprobs, batch.mask, a.kl_estimator,
                                        sampling_logprobs=sampling, weights=batch.weights)
        loss = loss + a.kl_coef * kl
        metrics["kl"] = kl_metrics["kl"]
    if batch.reward_kl is not None:
        metrics["kl"] = alg.weighted_sum(batch.reward_kl, batch.weights.stats).item()
    entropy_loss, entropy_metrics = alg.entropy_bonus(batch.entropy, batch.mask, weights=batch.weights)
    if a.entropy_coef > 0:
        loss = loss + a.entropy_coef * entropy_loss
    metrics["entropy"] = entropy_metrics["entropy"]
    metrics["loss"] = float(loss.detach())
    return loss, metrics


def critic_objective(values: Tensor, old_values: Tensor | None, returns: Tensor, mask: Tensor,
                     weights: alg.TokenWeights, algorithm: AlgorithmSpec) -> tuple[Tensor, alg.Metrics]:
    """The clipped value loss, aggregated with `weights`."""
    return alg.critic_loss(values, old_values, returns, mask, algorithm.value_clip, weights=weights)


def num_micro_batches(num_rows: int, micro_batch_size: int) -> int:
    """How many micro-batches of at most `micro_batch_size` rows hold `num_rows` (0: one, the whole)."""
    if micro_batch_size <= 0 or num_rows <= micro_batch_size:
        return 1
    return math.ceil(num_rows / micro_batch_size)


def micro_batch_slices(num_rows: int, num_micro: int) -> list[slice]:
    """`num_rows` rows cut into `num_micro` contiguous slices whose sizes differ by at most one. Ranks of
    one data-parallel group agree on `num_micro` (the largest any of them needs), since every
    micro-batch's forward runs collectives there; a rank with fewer rows runs smaller micro-batches, none
    larger than the micro-batch size."""
    base, extra = divmod(num_rows, num_micro)
    bounds = [0]
    for k in range(num_micro):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
    return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def num_packed_micro_batches(tokens_per_row: list[int], budget: int) -> int:
    """How many micro-batches of packed sequences hold rows of `tokens_per_row` real tokens: contiguous
    rows, filled greedily up to `budget` tokens each (a row longer than it alone); budget 0: one, the whole."""
    if budget <= 0:
        return 1
    return len(_greedy_bounds(tokens_per_row, budget)) - 1


def packed_micro_batch_slices(tokens_per_row: list[int], num_micro: int) -> list[slice]:
    """The rows cut into `num_micro` contiguous slices whose largest token count is as small as it can be.
    Ranks of one data-parallel group agree on `num_micro` (the most any of them needs for the token
    budget, `num_packed_micro_batches`), so no slice holds more tokens than the budget: a cut into more
    slices than a rank needs is at most as large as its greedy cut. With fewer rows than slices, the
    last slices are empty."""
    lo, hi = max(tokens_per_row, default=0), sum(tokens_per_row)
    while lo < hi:  # the smallest cap that greedy filling meets in num_micro slices or fewer
        cap = (lo + hi) // 2
        if len(_greedy_bounds(tokens_per_row, cap)) - 1 <= num_micro:
            hi = cap
        else:
            lo = cap + 1
    bounds = _greedy_bounds(tokens_per_row, lo)
    while len(bounds) - 1 < num_micro:  # fewer slices than agreed: halve the one of most rows, or add empty ones
        k = max(range(len(bounds) - 1), key=lambda i: bounds[i + 1] - bounds[i])
        if bounds[k + 1] - bounds[k] < 2:
            bounds.append(bounds[-1])
        else:
            bounds.insert(k + 1, (bounds[k] + bounds[k + 1]) // 2)
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _greedy_bounds(tokens_per_row: list[int], cap: int) -> list[int]:
    """Bounds of contiguous groups filled greedily up to `cap` tokens (a longer row alone); one group
    (perhaps empty) at least."""
    bounds, filled = [0], 0
    for i, tokens in enumerate(tokens_per_row):
        if filled + tokens > cap and i > bounds[-1]:
            bounds.append(i)
            filled = 0
        filled += tokens
    bounds.append(len(tokens_per_row))
    return bounds


__all__ = ["PolicyBatch", "critic_objective", "micro_batch_slices", "num_micro_batches", "num_packed_micro_batches",
           "packed_micro_batch_slices", "policy_objective"]
