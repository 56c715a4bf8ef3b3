"""Train/inference mismatch: how far the generator's behaviour log-probs are from the trainer's own.

An engine computes log-probs with other kernels (and on vLLM often another dtype) than the trainer, so
even at the same weights the two disagree; AIPO's truncated importance weights min(pi/mu, rho) absorb
it, and these figures say how much there is to absorb. They compare the same quantity on both sides:
log-probs of the sampled tokens under the sampling distribution, logits / T (the convention of
`executors/engines` and the trainer).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def logprob_mismatch(engine_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor, rho: float) -> dict[str, float]:
    """Mean and max |engine - trainer| over the response tokens, and the fraction of tokens whose ratio
    pi_trainer / mu_engine lies outside [1/rho, rho]. Both log-prob tensors are [B, R] at the same weights."""
    if rho <= 1.0:
        raise ValueError(f"rho must be > 1, got {rho}")
    mask_br = mask.to(torch.bool)
    diff = (trainer_logprobs.detach().double() - engine_logprobs.detach().double())[mask_br]
    if diff.numel() == 0:
        return {"mismatch_abs_mean": 0.0, "mismatch_abs_max": 0.0, "mismatch_outside_rho": 0.0}
    bound = math.log(rho)
    return {"mismatch_abs_mean": float(diff.abs().mean()), "mismatch_abs_max": float(diff.abs().max()),
            "mismatch_outside_rho": float((diff.abs() > bound).double().mean())}


__all__ = ["logprob_mismatch"]
