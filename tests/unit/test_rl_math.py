"""The RL arithmetic against references written from the papers, on ragged masks, values and gradients.

Each reference below is a plain loop over responses and tokens, written from the paper's formula, not
from the vectorised code it checks: GRPO (Shao et al. 2024), Dr. GRPO (Liu et al. 2025), REINFORCE++
(Hu 2025), GAE (Schulman et al. 2016) with KL reward shaping (Ouyang et al. 2022), PPO's clipped
surrogate with clip-higher (DAPO, Yu et al. 2025) and dual clip (Ye et al. 2020), AIPO (LlamaRL), the
KL estimators k1/k2/k3 (Schulman 2020) and k3 with an importance weight (Tang & Munos 2025), and the
three loss aggregations. Batch statistics and aggregation weights are also checked to be the same when
the batch is split over ranks and micro-batches.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from graphrl.executors import algorithms as alg
from graphrl.executors import loss as loss_fns
from graphrl.executors.models.llama import Llama
from graphrl.executors.models.sampling import (generate, logprob_temperature_of, sampling_temperature,
                                               token_logprobs, token_logprobs_and_entropy)
from graphrl.schemas.job import AlgorithmSpec
from graphrl.schemas.model import MODEL_PRESETS

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def ragged_mask(num_rows: int, num_tokens: int, seed: int) -> torch.Tensor:
    """Each row real up to a random length in [1, num_tokens]."""
    lengths = torch.randint(1, num_tokens + 1, (num_rows,), generator=torch.Generator().manual_seed(seed))
    return torch.arange(num_tokens)[None, :] < lengths[:, None]


def split_batch_sum(fn, first: dict, second: dict):
    """Run `fn(**part, batch_sum=...)` on two parts of a batch as two ranks would: each part's sum is its
    local vector plus the other part's (recorded from a first pass)."""
    recorded: list[torch.Tensor] = []
    fn(**second, batch_sum=lambda x: recorded.append(x.clone()) or x)
    out_first = fn(**first, batch_sum=lambda x: x + recorded[0])
    recorded_first: list[torch.Tensor] = []
    fn(**first, batch_sum=lambda x: recorded_first.append(x.clone()) or x)
    out_second = fn(**second, batch_sum=lambda x: x + recorded_first[0])
    return out_first, out_second


# ---- GRPO: constant groups, the three normalisations


@pytest.mark.parametrize("group_size", [3, 6, 7, 8, 12, 16])
@pytest.mark.parametrize("reward", [0.1, 0.3, 0.7, 0.9])
@pytest.mark.parametrize("normalize", ["group", "batch", "none"])
def test_a_group_of_equal_rewards_gets_exactly_zero(group_size: int, reward: float, normalize: str) -> None:
    """Regression: the float32 mean of G equal rewards missed them by an ulp (~1e-8), and that ulp
    divided by std (~1e-8) + 1e-6 gave the whole group an advantage of up to ~0.19, all of one sign. The
    group sits beside a group with spread, so 'batch' has a nonzero std to divide by."""
    rewards = torch.tensor([reward] * group_size + [0.0] * (group_size - 1) + [1.0], dtype=torch.float32)
    adv = alg.grpo_advantages(rewards, group_size, normalize)  # type: ignore[arg-type]
    assert torch.equal(adv[:group_size], torch.zeros(group_size))
    assert adv[group_size:].abs().max() > 0.1


def test_the_float32_group_mean_was_off_for_these_rewards() -> None:
    """The cases above do catch the bug: the float32 arithmetic gives nonzero advantages for some."""
    nonzero = 0
    for group_size in (3, 6, 7, 8, 12, 16):
        for reward in (0.1, 0.3, 0.7, 0.9):
            groups = torch.full((1, group_size), reward, dtype=torch.float32)
            old = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
            nonzero += int(bool(old.abs().max() > 1e-3))
    assert nonzero >= 6


def test_random_constant_groups_are_all_exactly_zero() -> None:
    rewards = torch.rand(2000, generator=torch.Generator().manual_seed(0)).repeat_interleave(8)
    assert torch.equal(alg.grpo_advantages(rewards, 8), torch.zeros(16000))


@pytest.mark.parametrize("normalize", ["group", "batch", "none"])
def test_grpo_against_the_papers(normalize: str) -> None:
    """A_i = (r_i - mean_g) / (std_g + eps) (GRPO, unbiased std); / (std of all centred rewards + eps)
    (batch); r_i - mean_g (Dr. GRPO)."""
    g = 5
    rewards = torch.rand(4 * g, generator=torch.Generator().manual_seed(1))
    rs = [float(x) for x in rewards]
    centred = []
    for k in range(0, len(rs), g):
        group = rs[k:k + g]
        centred += [(r - statistics.fmean(group), statistics.stdev(group)) for r in group]
    batch_std = math.sqrt(sum(c * c for c, _ in centred) / len(centred))
    expected = [c / (s + alg.STD_EPS) if normalize == "group" else c / (batch_std + alg.STD_EPS)
                if normalize == "batch" else c for c, s in centred]
    adv = alg.grpo_advantages(rewards, g, normalize)  # type: ignore[arg-type]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=1e-7)


def test_grpo_batch_normalisation_is_the_same_split_over_ranks() -> None:
    rewards = torch.rand(24, generator=torch.Generator().manual_seed(2))
    whole = alg.grpo_advantages(rewards, 4, "batch")
    fn = lambda rewards, batch_sum: alg.grpo_advantages(rewards, 4, "batch", batch_sum=batch_sum)  # noqa: E731
    first, second = split_batch_sum(fn, {"rewards": rewards[:8]}, {"rewards": rewards[8:]})
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-6, atol=1e-7)


# ---- REINFORCE++ and GAE with KL reward shaping


def reinforce_pp_reference(rewards, mask, kl, kl_coef, gamma, normalize):
    """Hu 2025: r_t = -beta * KL_t (+ the reward on the last token); G_t = sum_s gamma^(s-t) r_s;
    A = (G - mean) / (std + eps) over every real token of the batch."""
    returns = []
    for i in range(mask.shape[0]):
        length = int(mask[i].sum())
        r = [-kl_coef * float(kl[i, t]) + (float(rewards[i]) if t == length - 1 else 0.0) for t in range(length)]
        returns.append([sum(gamma ** (s - t) * r[s] for s in range(t, length)) for t in range(length)])
    flat = [x for row in returns for x in row]
    mean, std = statistics.fmean(flat), statistics.pstdev(flat)
    out = torch.zeros(mask.shape)
    for i, row in enumerate(returns):
        for t, x in enumerate(row):
            out[i, t] = (x - mean) / (std + alg.STD_EPS) if normalize == "batch" else x
    return out


@pytest.mark.parametrize("normalize", ["batch", "none"])
def test_reinforce_pp_with_kl_shaping_against_the_paper(normalize: str) -> None:
    mask = ragged_mask(6, 5, seed=3)
    rewards, kl = torch.rand(6), torch.rand(6, 5) - 0.3
    adv = alg.reinforce_pp_advantages(rewards, mask, kl=kl, kl_coef=0.1, gamma=0.9, normalize=normalize)  # type: ignore[arg-type]
    torch.testing.assert_close(adv, reinforce_pp_reference(rewards, mask, kl, 0.1, 0.9, normalize), rtol=1e-5,
                               atol=1e-6)
    fn = lambda rewards, mask, kl, batch_sum: alg.reinforce_pp_advantages(  # noqa: E731
        rewards, mask, kl=kl, kl_coef=0.1, gamma=0.9, normalize=normalize, batch_sum=batch_sum)  # type: ignore[arg-type]
    first, second = split_batch_sum(fn, {"rewards": rewards[:2], "mask": mask[:2], "kl": kl[:2]},
                                    {"rewards": rewards[2:], "mask": mask[2:], "kl": kl[2:]})
    torch.testing.assert_close(torch.cat([first, second]), adv, rtol=1e-5, atol=1e-6)


def gae_reference(rewards, values, mask, kl, kl_coef, gamma, lam, whiten):
    """Schulman et al. 2016 with the reward on the last token and -beta * KL_t on every token."""
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    ret = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        length = int(mask[i].sum())
        for t in range(length):
            total = 0.0
            for s in range(t, length):
                r = -kl_coef * float(kl[i, s]) + (float(rewards[i]) if s == length - 1 else 0.0)
                v_next = float(values[i, s + 1]) if s + 1 < length else 0.0
                total += (gamma * lam) ** (s - t) * (r + gamma * v_next - float(values[i, s]))
            adv[i, t], ret[i, t] = total, total + float(values[i, t])
    if whiten:
        flat = adv[mask]
        mean, std = flat.mean(), flat.std(unbiased=False)
        adv = torch.where(mask, (adv - mean) / (std + alg.STD_EPS), 0.0)
    return adv.float(), ret.float()


@pytest.mark.parametrize("whiten", [False, True])
def test_gae_with_kl_shaping_and_whitening_against_the_paper(whiten: bool) -> None:
    mask = ragged_mask(5, 6, seed=4)
    rewards, values, kl = torch.rand(5), torch.randn(5, 6), torch.rand(5, 6)
    adv, ret = alg.gae(rewards, values, mask, 0.9, 0.8, kl=kl, kl_coef=0.2, whiten=whiten)
    want_adv, want_ret = gae_reference(rewards, values, mask, kl, 0.2, 0.9, 0.8, whiten)
    torch.testing.assert_close(adv, want_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, want_ret, rtol=1e-5, atol=1e-5)
    fn = lambda rewards, values, mask, kl, batch_sum: alg.gae(  # noqa: E731
        rewards, values, mask, 0.9, 0.8, kl=kl, kl_coef=0.2, whiten=whiten, batch_sum=batch_sum)
    (a1, _), (a2, _) = split_batch_sum(fn, {"rewards": rewards[:3], "values": values[:3], "mask": mask[:3], "kl": kl[:3]},
                                       {"rewards": rewards[3:], "values": values[3:], "mask": mask[3:], "kl": kl[3:]})
    torch.testing.assert_close(torch.cat([a1, a2]), adv, rtol=1e-5, atol=1e-5)


# ---- aggregation


def weights_reference(mask: torch.Tensor, agg: str) -> torch.Tensor:
    num_tokens = int(mask.sum())
    num_seqs = int(mask.any(1).sum())
    out = torch.zeros(mask.shape)
    for i in range(mask.shape[0]):
        length = int(mask[i].sum())
        for t in range(length):
            out[i, t] = {"token_mean": 1 / num_tokens, "seq_mean_token_mean": 1 / (num_seqs * length),
                         "seq_mean_token_sum_norm": 1 / (num_seqs * mask.shape[1])}[agg]
    return out


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_aggregation_weights_against_their_definitions_and_split_over_ranks(agg: str) -> None:
    mask = ragged_mask(7, 5, seed=5)
    whole = alg.token_weights(mask, agg)  # type: ignore[arg-type]
    torch.testing.assert_close(whole.loss, weights_reference(mask, agg))
    torch.testing.assert_close(whole.stats, weights_reference(mask, "token_mean"))
    counts = alg.batch_counts(mask[:3]) + alg.batch_counts(mask[3:])  # what the all-reduce adds up
    parts = [alg.token_weights(mask[rows], agg, counts) for rows in (slice(0, 3), slice(3, 7))]  # type: ignore[arg-type]
    torch.testing.assert_close(torch.cat([p.loss for p in parts]), whole.loss)


# ---- policy losses


def ppo_reference(logp, old, adv, mask, agg, eps_low, eps_high, dual_c):
    """-sum_t w_t obj_t, obj = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), and for A < 0 at least c A."""
    w = weights_reference(mask, agg)
    total = logp.new_zeros(())
    for i in range(mask.shape[0]):
        for t in range(int(mask[i].sum())):
            ratio = torch.exp(logp[i, t] - old[i, t])
            a = float(adv[i, t])
            obj = torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
            if dual_c is not None and a < 0:
                obj = torch.maximum(obj, torch.tensor(dual_c * a))
            total = total - float(w[i, t]) * obj
    return total


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("eps_high, dual_c", [(None, None), (0.28, None), (0.28, 3.0)])
def test_ppo_loss_value_and_gradient_against_the_papers(agg: str, eps_high, dual_c) -> None:
    torch.manual_seed(6)
    mask = ragged_mask(6, 5, seed=6)
    old = torch.randn(6, 5) * 0.1 - 1.0
    logp = old + torch.randn(6, 5) * 0.6  # ratios far enough out to clip
    adv = torch.randn(6, 5) * 2
    logp[0, 0], adv[0, 0] = old[0, 0] + 2.0, -1.5  # ratio e^2 > c = 3 on a negative advantage: dual-clipped
    logp.requires_grad_()
    loss, metrics = alg.policy_loss(logp, old, adv, mask, 0.2, clip_eps_high=eps_high, dual_clip_c=dual_c,
                                    weights=alg.token_weights(mask, agg))  # type: ignore[arg-type]
    ref_logp = logp.detach().clone().requires_grad_()
    want = ppo_reference(ref_logp, old, adv, mask, agg, 0.2, 0.2 if eps_high is None else eps_high, dual_c)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    loss.backward()
    want.backward()
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-5, atol=1e-7)
    assert metrics["clip_frac"] > 0
    if dual_c is not None:
        assert metrics["dual_clip_frac"] > 0


def test_approx_kl_is_k3_of_kl_from_the_old_policy_to_the_new() -> None:
    """Over tokens drawn from pi_old, the mean of (r - 1) - log r, r = pi / pi_old, is KL(pi_old || pi):
    the expectation, summed exactly over a small vocabulary, equals the divergence."""
    old = torch.log_softmax(torch.randn(7), 0)
    new = torch.log_softmax(torch.randn(7), 0)
    per_token = []
    for y in range(7):
        _, metrics = alg.policy_loss(new[y].view(1, 1), old[y].view(1, 1), torch.zeros(1, 1),
                                     torch.ones(1, 1, dtype=torch.bool), 0.2)
        per_token.append(metrics["approx_kl"])
    expectation = float((old.exp() * torch.tensor(per_token)).sum())
    assert expectation == pytest.approx(float((old.exp() * (old - new)).sum()), rel=1e-5)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_aipo_loss_against_llamarl(agg: str) -> None:
    """-sum_t w_t min(pi/mu, rho) A log pi, the weight detached."""
    mask = ragged_mask(5, 4, seed=7)
    behaviour = torch.randn(5, 4) * 0.1 - 1.0
    logp = (behaviour + torch.randn(5, 4)).requires_grad_()
    adv = torch.randn(5, 4)
    loss, _ = alg.aipo_loss(logp, behaviour, adv, mask, 2.0, weights=alg.token_weights(mask, agg))  # type: ignore[arg-type]
    w = weights_reference(mask, agg)
    is_weight = torch.clamp(torch.exp(logp.detach() - behaviour), max=2.0)
    torch.testing.assert_close(loss, -(w * is_weight * adv * logp).sum(), rtol=1e-5, atol=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, -w * is_weight * adv, rtol=1e-5, atol=1e-7)


def aipo_weight_reference(logp: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, rho: float, level: str,
                          mode: str) -> torch.Tensor:
    """The importance weight of each token, written out row by row: the ratio of the token, of the
    response (the product of its real tokens' ratios) or the response's geometric mean; capped at rho, or
    kept inside [1/rho, rho] and 0 outside."""
    out = torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        tokens = [j for j in range(logp.shape[1]) if mask[i, j]]
        ratios = [math.exp(float(logp[i, j] - behaviour[i, j])) for j in tokens]
        for j, r in zip(tokens, ratios):
            if level == "sequence":
                r = math.prod(ratios)
            elif level == "geometric":
                r = math.prod(ratios) ** (1 / len(ratios))
            out[i, j] = min(r, rho) if mode == "truncate" else (r if 1 / rho <= r <= rho else 0.0)
    return out


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_aipo_importance_levels_and_modes(agg: str, level: str, mode: str) -> None:
    """-sum_t w_t w_is A log pi with the weight of each level and mode as written out above (rows with an
    empty and a full response among ragged ones); clipped_frac counts the tokens whose weight changed."""
    mask = ragged_mask(8, 6, seed=11)
    mask[0], mask[1] = False, True
    behaviour = torch.randn(8, 6) * 0.1 - 1.0
    shift = torch.linspace(-1.2, 1.2, 8).unsqueeze(1)  # responses from far below to far above the trust region
    logp = (behaviour + shift + torch.randn(8, 6) * 0.3).requires_grad_()
    adv = torch.randn(8, 6)
    loss, metrics = alg.aipo_loss(logp, behaviour, adv, mask, 2.0, weights=alg.token_weights(mask, agg),  # type: ignore[arg-type]
                                  level=level, mode=mode)  # type: ignore[arg-type]
    w = weights_reference(mask, agg)
    is_weight = aipo_weight_reference(logp.detach(), behaviour, mask, 2.0, level, mode)
    torch.testing.assert_close(loss, -(w * is_weight * adv * logp).sum(), rtol=1e-5, atol=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, -w * is_weight * adv, rtol=1e-5, atol=1e-7)
    raw = aipo_weight_reference(logp.detach(), behaviour, mask, math.inf, level, "truncate")
    changed = ((raw != is_weight) & mask).float()
    assert metrics["clipped_frac"] == pytest.approx(float((weights_reference(mask, "token_mean") * changed).sum()))
    assert 0 < metrics["clipped_frac"] < 1


def test_aipo_sequence_weights_are_finite_where_the_product_of_ratios_overflows() -> None:
    """A long response whose tokens each have ratio e^2: the product (e^2000) overflows a float, its log
    does not; truncated to rho, masked to 0."""
    logp, behaviour = torch.full((1, 1000), -1.0), torch.full((1, 1000), -3.0)
    mask, adv = torch.ones(1, 1000, dtype=torch.bool), torch.ones(1, 1000)
    _, truncated = alg.aipo_loss(logp, behaviour, adv, mask, 2.0, level="sequence")
    _, masked = alg.aipo_loss(logp, behaviour, adv, mask, 2.0, level="sequence", mode="mask")
    assert truncated["weight_mean"] == pytest.approx(2.0) and masked["weight_mean"] == 0.0
    assert truncated["clipped_frac"] == masked["clipped_frac"] == pytest.approx(1.0)


# ---- KL estimators: values, and the direction of their expected gradients


def expected_kl_gradient(estimator: str, theta: torch.Tensor, ref: torch.Tensor,
                         sampler: torch.Tensor | None = None) -> torch.Tensor:
    """E_{y ~ q}[grad_theta k(y)] summed exactly over the vocabulary, q = pi (on-policy) or `sampler`."""
    theta = theta.clone().requires_grad_()
    logp = torch.log_softmax(theta, 0)
    q = logp.detach().exp() if sampler is None else sampler.exp()
    sampling = logp.detach() if sampler is None else sampler
    k = alg.kl_terms(logp, ref, estimator, sampling_logprobs=sampling)  # type: ignore[arg-type]
    (q * k).sum().backward()
    assert theta.grad is not None
    return theta.grad


def kl_gradient(theta: torch.Tensor, ref: torch.Tensor, direction: str) -> torch.Tensor:
    theta = theta.clone().requires_grad_()
    logp = torch.log_softmax(theta, 0)
    kl = (logp.exp() * (logp - ref)).sum() if direction == "pi||ref" else (ref.exp() * (ref - logp)).sum()
    kl.backward()
    assert theta.grad is not None
    return theta.grad


@pytest.mark.parametrize("estimator, direction", [("k1", None), ("k2", "pi||ref"), ("k3", "ref||pi"),
                                                  ("k3_is", "pi||ref")])
def test_each_kl_estimator_follows_the_gradient_its_docstring_names(estimator: str, direction) -> None:
    """Tang & Munos 2025: in the loss, k1's expected gradient is 0, k2's and k3_is's are those of
    KL(pi || ref), k3's that of KL(ref || pi)."""
    theta, ref = torch.randn(9), torch.log_softmax(torch.randn(9), 0)
    got = expected_kl_gradient(estimator, theta, ref)
    want = torch.zeros(9) if direction is None else kl_gradient(theta, ref, direction)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert direction is None or (kl_gradient(theta, ref, "pi||ref") - kl_gradient(theta, ref, "ref||pi")).abs().max() > 1e-3


def test_k3_is_keeps_the_gradient_of_kl_pi_ref_when_the_tokens_come_from_another_policy() -> None:
    theta, ref = torch.randn(9), torch.log_softmax(torch.randn(9), 0)
    sampler = torch.log_softmax(theta + 0.5 * torch.randn(9), 0)  # pi_old != pi
    torch.testing.assert_close(expected_kl_gradient("k3_is", theta, ref, sampler), kl_gradient(theta, ref, "pi||ref"),
                               rtol=1e-4, atol=1e-6)


def test_kl_estimator_values() -> None:
    """d = ref - logp: k1 = -d, k2 = d^2 / 2, k3 = e^d - d - 1; k3_is on-policy equals k3 in value; the
    expectation of k1, k3 and k3_is under pi is KL(pi || ref)."""
    logp = torch.log_softmax(torch.randn(6), 0)
    ref = torch.log_softmax(torch.randn(6), 0)
    d = ref - logp
    torch.testing.assert_close(alg.kl_terms(logp, ref, "k1"), -d)
    torch.testing.assert_close(alg.kl_terms(logp, ref, "k2"), d * d / 2)
    torch.testing.assert_close(alg.kl_terms(logp, ref, "k3"), torch.exp(d) - d - 1)
    torch.testing.assert_close(alg.kl_terms(logp, ref, "k3_is", logp), alg.kl_terms(logp, ref, "k3"))
    kl = float((logp.exp() * (logp - ref)).sum())
    for estimator in ("k1", "k3"):
        assert float((logp.exp() * alg.kl_terms(logp, ref, estimator)).sum()) == pytest.approx(kl, rel=1e-5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sampling policy"):
        alg.kl_terms(logp, ref, "k3_is")


# ---- micro-batches: the step of the whole batch, cut into pieces


def tiny_policy(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(MODEL_PRESETS["tiny-digits"])


def rollout_batch(num_rows: int = 10, prompt_len: int = 4, response_len: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    prompt_mask = torch.ones(num_rows, prompt_len, dtype=torch.bool)
    prompt_mask[::3, 0] = False  # some left padding
    return {"prompt_ids": torch.randint(0, 16, (num_rows, prompt_len), generator=g), "prompt_mask": prompt_mask,
            "response_ids": torch.randint(0, 16, (num_rows, response_len), generator=g),
            "response_mask": ragged_mask(num_rows, response_len, seed=9)}


def policy_step_gradients(model: Llama, r: dict[str, torch.Tensor], algorithm: AlgorithmSpec, num_micro: int,
                          temperature: float) -> tuple[float, dict[str, torch.Tensor]]:
    """The train step's loss and gradients, its rows in `num_micro` micro-batches, gradients accumulated."""
    model.zero_grad(set_to_none=True)
    mask = r["response_mask"]
    g = torch.Generator().manual_seed(10)
    noise = lambda: torch.randn(mask.shape, generator=g) * 0.3  # noqa: E731
    with torch.no_grad(), sampling_temperature(model, temperature):
        current, _ = token_logprobs_and_entropy(model, r["prompt_ids"], r["prompt_mask"], r["response_ids"], mask)
    old, behaviour, ref = current + noise(), current + noise(), current + noise()
    advantages = torch.where(mask, torch.randn(mask.shape, generator=g), 0.0)
    weights = alg.token_weights(mask, algorithm.loss_agg)
    total = 0.0
    for rows in loss_fns.micro_batch_slices(mask.shape[0], num_micro):
        with sampling_temperature(model, temperature):
            logprobs, entropy = token_logprobs_and_entropy(model, r["prompt_ids"][rows], r["prompt_mask"][rows],
                                                           r["response_ids"][rows], mask[rows])
        batch = loss_fns.PolicyBatch(logprobs, entropy, old[rows], behaviour[rows], ref[rows], advantages[rows],
                                     mask[rows], weights.rows(rows))
        loss, _ = loss_fns.policy_objective(batch, "ppo", algorithm)
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_the_micro_batched_step_is_the_whole_batch_step(agg: str) -> None:
    """PPO with clip-higher, dual clip, an importance-corrected KL in the loss and an entropy bonus, at
    temperature 0.7: 1 micro-batch against 3 (sizes 4, 3, 3) and 10 (one response each)."""
    algorithm = AlgorithmSpec(loss_agg=agg, clip_eps_high=0.28, dual_clip_c=3.0, kl_coef=0.1, kl_estimator="k3_is",
                              entropy_coef=0.01)
    model, r = tiny_policy(), rollout_batch()
    whole_loss, whole = policy_step_gradients(model, r, algorithm, 1, 0.7)
    for num_micro in (3, 10):
        loss, grads = policy_step_gradients(model, r, algorithm, num_micro, 0.7)
        assert loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
        for name, grad in whole.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-7)


def test_micro_batch_slices_cover_the_rows_with_sizes_at_most_the_micro_batch_size() -> None:
    for rows, size in [(10, 3), (16, 4), (7, 7), (5, 0), (9, 2)]:
        num_micro = loss_fns.num_micro_batches(rows, size)
        slices = loss_fns.micro_batch_slices(rows, num_micro)
        assert [i for s in slices for i in range(rows)[s]] == list(range(rows))
        assert size == 0 or max(s.stop - s.start for s in slices) <= size
    # A rank with fewer rows than its group's micro-batch count still runs that many (some smaller).
    assert [s.stop - s.start for s in loss_fns.micro_batch_slices(7, 3)] == [3, 2, 2]


# ---- one temperature convention


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3, 0.0])
def test_behaviour_and_trainer_logprobs_are_of_the_sampling_distribution(temperature: float) -> None:
    """The sampler's behaviour log-probs equal the trainer's recomputation under `sampling_temperature`,
    and both equal log softmax(logits / T) (T = 1 for greedy decoding)."""
    model = tiny_policy(1).eval()
    r = rollout_batch(6)
    out = generate(model, r["prompt_ids"], r["prompt_mask"], 5, temperature=temperature,
                   uniforms=torch.rand(6, 5, generator=torch.Generator().manual_seed(11)))
    with torch.no_grad(), sampling_temperature(model, temperature):
        trainer = token_logprobs(model, r["prompt_ids"], r["prompt_mask"], out.response_ids, out.response_mask)
    torch.testing.assert_close(out.logprobs, trainer, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ids = torch.cat([r["prompt_ids"], out.response_ids], 1)
        logits = model(ids, torch.cat([r["prompt_mask"], out.response_mask], 1))[:, 3:-1]
        want = torch.log_softmax(logits / logprob_temperature_of(temperature), -1)
        want = want.gather(-1, out.response_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(trainer, torch.where(out.response_mask, want, 0.0), rtol=1e-5, atol=1e-5)


def test_sampling_temperature_leaves_the_model_as_it_was() -> None:
    model = tiny_policy(2)
    r = rollout_batch(3)
    args = (r["prompt_ids"], r["prompt_mask"], r["response_ids"], r["response_mask"])
    before = token_logprobs(model, *args)
    with sampling_temperature(model, 0.5):
        tempered = token_logprobs(model, *args)
    assert not torch.allclose(tempered, before)
    torch.testing.assert_close(token_logprobs(model, *args), before)
