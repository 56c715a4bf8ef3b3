"""Advantage estimators and losses checked against numbers worked out by hand (in each docstring)."""

from __future__ import annotations

import math

import pytest
import torch

from graphrl.executors.algorithms import (
    aipo_loss,
    broadcast_to_tokens,
    critic_loss,
    entropy_bonus,
    gae,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
)

T, F = True, False
SQRT_HALF = math.sqrt(0.5)
LN2, LN3 = math.log(2.0), math.log(3.0)


def close(actual: torch.Tensor, expected: list | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# ---- helpers


def test_masked_mean_ignores_masked_slots_even_nan() -> None:
    """(1 + 3) / 2; the NaN and the 100 sit in masked slots."""
    x = torch.tensor([[1.0, float("nan")], [3.0, 100.0]])
    mask = torch.tensor([[T, F], [T, F]])
    close(masked_mean(x, mask), 2.0)


def test_masked_mean_of_empty_mask_is_zero() -> None:
    close(masked_mean(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool)), 0.0)


def test_broadcast_to_tokens() -> None:
    mask = torch.tensor([[T, T, F], [T, F, F]])
    close(broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask), [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])


# ---- advantages


def test_grpo_two_groups_of_two() -> None:
    """Groups [1, 0] and [0, 1]: mean 0.5, unbiased std sqrt(0.5) -> +-0.5 / sqrt(0.5) = +-sqrt(0.5)."""
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2)
    close(adv, [SQRT_HALF, -SQRT_HALF, -SQRT_HALF, SQRT_HALF])


def test_grpo_group_of_four() -> None:
    """[1, 0, 0, 0]: mean 0.25, unbiased var (0.5625 + 3 * 0.0625) / 3 = 0.25, std 0.5."""
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    close(adv, [1.5, -0.5, -0.5, -0.5])


def test_grpo_without_normalization_and_with_equal_rewards() -> None:
    close(grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, normalize="none"), [0.5, -0.5, -0.5, 0.5])
    close(grpo_advantages(torch.tensor([1.0, 1.0, 3.0, 3.0]), 2), [0.0, 0.0, 0.0, 0.0])


def test_grpo_rejects_ragged_groups() -> None:
    with pytest.raises(ValueError, match="groups of 2"):
        grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), group_size=2)


def test_rloo() -> None:
    """Group of 2: r - other. Group of 4 [1,0,0,0]: 1 - 0 = 1; 0 - 1/3 = -1/3."""
    close(rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2), [1.0, -1.0, -1.0, 1.0])
    close(rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4), [1.0, -1 / 3, -1 / 3, -1 / 3])


def test_reinforce_pp_equal_lengths() -> None:
    """Tokens carry returns 1,1 | 0,0 | 0,0 | 0,0: mean 0.25, population std sqrt(0.25*0.75) = sqrt(3)/4.

    (1 - 0.25) / (sqrt(3)/4) = sqrt(3); (0 - 0.25) / (sqrt(3)/4) = -1/sqrt(3).
    """
    mask = torch.ones(4, 2, dtype=torch.bool)
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), mask)
    s = math.sqrt(3.0)
    close(adv, [[s, s], [-1 / s, -1 / s], [-1 / s, -1 / s], [-1 / s, -1 / s]])


def test_reinforce_pp_normalizes_over_real_tokens_only() -> None:
    """Real tokens 1,1,1 | 0: mean 0.75, std sqrt(3)/4 -> 1/sqrt(3) and -sqrt(3); pads stay 0."""
    mask = torch.tensor([[T, T, T], [T, F, F]])
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask)
    s = math.sqrt(3.0)
    close(adv, [[1 / s, 1 / s, 1 / s], [-s, 0.0, 0.0]])


def test_reinforce_pp_kl_shaping_and_discount_unnormalized() -> None:
    """kl 0.5, 1.0 at coef 0.1 -> token rewards -0.05, -0.1 + 1; gamma 1 -> returns 0.85, 0.9.

    gamma 0.5: 0.9 at the end, -0.05 + 0.5 * 0.9 = 0.4 before it.
    """
    mask = torch.tensor([[T, T, F]])
    kl = torch.tensor([[0.5, 1.0, 7.0]])
    adv = reinforce_pp_advantages(torch.tensor([1.0]), mask, kl=kl, kl_coef=0.1, normalize="none")
    close(adv, [[0.85, 0.9, 0.0]])
    adv = reinforce_pp_advantages(torch.tensor([1.0]), mask, kl=kl, kl_coef=0.1, gamma=0.5, normalize="none")
    close(adv, [[0.4, 0.9, 0.0]])


def test_gae_gamma_lam_one_is_reward_minus_value() -> None:
    """gamma = lam = 1: A_t = R - V_t = 1 - 0.5, 1 - 0.25; returns = 1; the pad's value 9 is ignored."""
    values = torch.tensor([[0.5, 0.25, 9.0]])
    mask = torch.tensor([[T, T, F]])
    adv, ret = gae(torch.tensor([1.0]), values, mask, gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.75, 0.0]])
    close(ret, [[1.0, 1.0, 0.0]])


def test_gae_discounted() -> None:
    """gamma = lam = 0.5. t=1: delta = 1 - 0.25 = 0.75 = A_1.
    t=0: delta = 0 + 0.5 * 0.25 - 0.5 = -0.375; A_0 = -0.375 + 0.25 * 0.75 = -0.1875.
    returns = A + V = 0.3125, 1.0.
    """
    values = torch.tensor([[0.5, 0.25, 9.0], [2.0, 0.0, 0.0]])
    mask = torch.tensor([[T, T, F], [T, F, F]])
    adv, ret = gae(torch.tensor([1.0, 0.0]), values, mask, gamma=0.5, lam=0.5)
    # Row 2: a single token with reward 0 and value 2 -> A = -2, return 0.
    close(adv, [[-0.1875, 0.75, 0.0], [-2.0, 0.0, 0.0]])
    close(ret, [[0.3125, 1.0, 0.0], [0.0, 0.0, 0.0]])


# ---- losses


def test_policy_loss_clipping_value_and_gradient() -> None:
    """eps 0.2, ratios 1.5, 0.5, 1.0 (and a masked 9), advantages 1, 1, -1.
    Token 1: min(1.5, 1.2) = 1.2, clipped. Token 2: min(0.5, 0.8) = 0.5. Token 3: -1.
    loss = -(1.2 + 0.5 - 1) / 3. d loss / d logp = -ratio * A / 3 unless clipped: 0, -1/6, 1/3, 0.
    """
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.0, 9.0]])).requires_grad_()
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, 2.0]])
    mask = torch.tensor([[T, T, T, F]])
    loss, metrics = policy_loss(logprobs, old, adv, mask, clip_eps=0.2)
    close(loss, -0.7 / 3)
    assert metrics["clip_frac"] == pytest.approx(1 / 3)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["loss"] == pytest.approx(-0.7 / 3)
    loss.backward()
    close(logprobs.grad, [[0.0, -1 / 6, 1 / 3, 0.0]])


def test_policy_loss_on_policy_is_minus_mean_advantage() -> None:
    adv = torch.tensor([[2.0, -1.0], [4.0, 0.0]])
    mask = torch.tensor([[T, T], [T, F]])
    loss, metrics = policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), adv, mask, clip_eps=0.2)
    close(loss, -(2.0 - 1.0 + 4.0) / 3)
    assert metrics["clip_frac"] == 0.0 and metrics["approx_kl"] == 0.0


def test_aipo_loss_truncates_weight() -> None:
    """rho 2, ratios 3 and 0.5 -> w = 2, 0.5; A = 1, -2; logp = ln 3, ln 0.5.
    loss = -(2 * 1 * ln3 + 0.5 * -2 * -ln2) / 2 = -(2 ln3 + ln2) / 2; grad = -w * A / 2 = -1, 0.5.
    """
    logprobs = torch.tensor([[LN3, -LN2, 5.0]], requires_grad=True)
    behaviour = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    mask = torch.tensor([[T, T, F]])
    loss, metrics = aipo_loss(logprobs, behaviour, adv, mask, rho=2.0)
    close(loss, -(2 * LN3 + LN2) / 2)
    assert metrics["clipped_frac"] == pytest.approx(0.5)
    assert metrics["weight_mean"] == pytest.approx(1.25)
    loss.backward()
    close(logprobs.grad, [[-1.0, 0.5, 0.0]])


def test_kl_penalty_k1_and_k3() -> None:
    """logp 0, ref +-ln2. k1 = -ln2, ln2 -> mean 0. k3 = (2 - ln2 - 1) and (0.5 + ln2 - 1) -> mean 0.25."""
    logprobs = torch.zeros(1, 3)
    ref = torch.tensor([[LN2, -LN2, 10.0]])
    mask = torch.tensor([[T, T, F]])
    k1, _ = kl_penalty(logprobs, ref, mask, "k1")
    k3, metrics = kl_penalty(logprobs, ref, mask, "k3")
    close(k1, 0.0)
    close(k3, 0.25)
    assert metrics["kl"] == pytest.approx(0.25)


def test_kl_penalty_rejects_unknown_estimator() -> None:
    with pytest.raises(ValueError, match="k3_is"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), "k4")  # type: ignore[arg-type]


def test_entropy_bonus() -> None:
    loss, metrics = entropy_bonus(torch.tensor([[1.0, 2.0, 50.0]]), torch.tensor([[T, T, F]]))
    close(loss, -1.5)
    assert metrics["entropy"] == pytest.approx(1.5)


def test_critic_loss_clipped_and_unclipped() -> None:
    """clip 0.2. Token 1: v 1.0, old 0.5, R 1.0: unclipped 0, v_clip 0.7 -> 0.09 wins (clipped).
    Token 2: v 0, old 0, R 1: both 1. loss = 0.5 * (0.09 + 1) / 2 = 0.2725.
    Without old values: 0.5 * (0 + 1) / 2 = 0.25.
    """
    values = torch.tensor([[1.0, 0.0, 3.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, 0.0]])
    mask = torch.tensor([[T, T, F]])
    loss, metrics = critic_loss(values, old, returns, mask, clip=0.2)
    close(loss, 0.2725)
    assert metrics["clip_frac"] == pytest.approx(0.5)
    loss.backward()
    # Token 1's loss comes from the clipped branch, constant in v -> no gradient; token 2: 0.5 * 2 * (0 - 1) / 2.
    close(values.grad, [[0.0, -0.5, 0.0]])
    loss, metrics = critic_loss(values.detach(), None, returns, mask, clip=0.2)
    close(loss, 0.25)
    assert metrics["clip_frac"] == 0.0
