"""`training.update` against hand-written loops: mini-batches (`algorithm.mini_batch_size`) are
sequential optimizer steps, each the step of its mini-batch alone; micro-batches and packed sequences
inside them change nothing but float32 rounding.

The references below are what a reader would write: for each mini-batch, its loss aggregated over its
own responses (token weights from its own counts), backward, clip, AdamW step. One process, the
trainer unwrapped (`wrap_trainer` without a group), so the update and its reference run the same
arithmetic; the data-parallel case is `test_training_ranks.py`.
"""

from __future__ import annotations

import copy

import pytest
import torch

from graphrl.executors import algorithms as alg
from graphrl.executors import loss as loss_fns
from graphrl.executors import training
from graphrl.executors.models.llama import Llama, LlamaCritic
from graphrl.executors.models.sampling import sampling_temperature, token_logprobs_and_entropy, token_values
from graphrl.executors.parallel import build_optimizer, wrap_trainer
from graphrl.executors.roles import RoleState
from graphrl.executors.runtime import Runtime
from graphrl.schemas.job import AlgorithmSpec
from graphrl.schemas.model import MODEL_PRESETS
from graphrl.schemas.plan import MemoryBytes, RolePlacement

DIMS = MODEL_PRESETS["tiny-digits"]
NUM_ROWS, PROMPT_LEN, RESPONSE_LEN = 12, 5, 6
TEMPERATURE = 0.7
RT = Runtime(0, 1, torch.device("cpu"), {})
# AdamW moves every weight by about lr per step whatever its gradient: the same steps agree to float32
# rounding of that (WEIGHT_ATOL: micro-batches, each cut to the columns its rows use, sum the gradient in
# another order, and AdamW's first step amplifies that on near-zero gradients to about 1% of lr), a
# different sequence of steps differs by about lr (more than DIFFERENT).
LR = 1e-3
WEIGHT_ATOL = 1e-5
DIFFERENT = 1e-4


def policy(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(DIMS)


def trained(model: torch.nn.Module, a: AlgorithmSpec) -> RoleState:
    """`model` as the executor trains it on one rank: its adapter (packing as `a` says) and AdamW."""
    wrapped, wrapping = wrap_trainer(model, "none", None, torch.device("cpu"), pack=a.pack_sequences)
    optimizer = build_optimizer(wrapped, "none", wrapping, None, lr=a.lr, betas=a.betas, weight_decay=a.weight_decay)
    placement = RolePlacement(role="policy", model="policy", kind="train", ops=["train"], mesh="trainer",
                              memory_bytes=MemoryBytes())
    return RoleState(placement, model, wrapped, wrapping, optimizer)


def rollouts(model: Llama, seed: int = 5) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A batch with left-padded prompts and responses of 0 to RESPONSE_LEN tokens, its behaviour log-probs
    those of `model` at the sampling temperature (the weights it was sampled with), and advantages."""
    g = torch.Generator().manual_seed(seed)
    prompt_real = torch.randint(1, PROMPT_LEN + 1, (NUM_ROWS,), generator=g)
    response_real = torch.randint(0, RESPONSE_LEN + 1, (NUM_ROWS,), generator=g)
    response_real[0], response_real[1] = 0, RESPONSE_LEN
    r = {"prompt_ids": torch.randint(0, 16, (NUM_ROWS, PROMPT_LEN), generator=g),
         "prompt_mask": torch.arange(PROMPT_LEN)[None] >= PROMPT_LEN - prompt_real[:, None],
         "response_ids": torch.randint(0, 16, (NUM_ROWS, RESPONSE_LEN), generator=g),
         "response_mask": torch.arange(RESPONSE_LEN)[None] < response_real[:, None],
         "version": torch.tensor([0])}
    with torch.no_grad(), sampling_temperature(model, TEMPERATURE):
        r["behaviour_logprobs"], _ = token_logprobs_and_entropy(model, *(r[k] for k in training.ROW_FIELDS))
    advantages = torch.where(r["response_mask"], torch.randn(r["response_mask"].shape, generator=g), 0.0)
    return r, advantages


def algorithm(**settings: object) -> AlgorithmSpec:
    return AlgorithmSpec(**{"lr": LR, "loss_agg": "seq_mean_token_mean", "entropy_coef": 0.01, **settings})


def reference_policy_steps(model: Llama, r: dict[str, torch.Tensor], advantages: torch.Tensor, a: AlgorithmSpec,
                           num_mini: int) -> list[float]:
    """`a.updates_per_step` passes of `num_mini` AdamW steps, step k on the k-th contiguous block of rows
    alone; the gradient norms of the last pass."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=a.betas, weight_decay=a.weight_decay)
    norms: list[float] = []
    for _ in range(a.updates_per_step):
        norms = []
        for rows in loss_fns.micro_batch_slices(NUM_ROWS, num_mini):
            optimizer.zero_grad(set_to_none=True)
            mask = r["response_mask"][rows]
            with sampling_temperature(model, TEMPERATURE):
                logprobs, entropy = token_logprobs_and_entropy(model, *(r[k][rows] for k in training.ROW_FIELDS))
            batch = loss_fns.PolicyBatch(logprobs, entropy, None, r["behaviour_logprobs"][rows], None, advantages[rows],
                                         mask, alg.token_weights(mask, a.loss_agg))
            loss, _ = loss_fns.policy_objective(batch, "grpo", a)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_grad_norm)))
            optimizer.step()
    return norms


def update_policy(model: Llama, r: dict[str, torch.Tensor], advantages: torch.Tensor,
                  a: AlgorithmSpec) -> dict[str, float]:
    return training.update(trained(model, a), "grpo", a, r, {"advantages": advantages}, None, None,
                           temperature=TEMPERATURE, group=None, rt=RT, node="update", step=0)


def max_weight_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    other = dict(b.named_parameters())
    return max(float((p.detach() - other[name].detach()).abs().max()) for name, p in a.named_parameters())


@pytest.mark.parametrize(("mini", "passes", "micro"), [(4, 1, 0), (6, 2, 0), (4, 2, 3), (3, 1, 2)])
def test_each_mini_batch_is_one_optimizer_step_on_its_responses_alone(mini: int, passes: int, micro: int) -> None:
    """12 responses in mini-batches of `mini`: 12 / mini sequential AdamW steps per pass, each with the
    loss aggregated over its own responses (micro-batches inside a mini-batch add up to it). The
    reported grad_norm is the mean over the last pass's steps."""
    model = policy()
    r, advantages = rollouts(model)
    a = algorithm(mini_batch_size=mini, updates_per_step=passes, micro_batch_size=micro)
    reference = copy.deepcopy(model)
    norms = reference_policy_steps(reference, r, advantages, a, NUM_ROWS // mini)
    whole = copy.deepcopy(model)
    reference_policy_steps(whole, r, advantages, a.model_copy(update={"updates_per_step": 1}), 1)
    metrics = update_policy(model, r, advantages, a)
    assert max_weight_diff(model, reference) < WEIGHT_ATOL
    assert max_weight_diff(model, whole) > DIFFERENT  # one whole-batch step is another update
    assert metrics["grad_norm"] == pytest.approx(sum(norms) / len(norms), rel=1e-5)


def test_mini_batch_size_0_and_the_whole_batch_are_todays_single_step() -> None:
    model = policy()
    r, advantages = rollouts(model)
    reference = copy.deepcopy(model)
    norms = reference_policy_steps(reference, r, advantages, algorithm(), 1)
    results = []
    for mini in (0, NUM_ROWS):
        trained_model = copy.deepcopy(model)
        results.append((trained_model, update_policy(trained_model, r, advantages, algorithm(mini_batch_size=mini))))
    (zero, zero_metrics), (whole, whole_metrics) = results
    assert max_weight_diff(zero, whole) == 0.0 and zero_metrics == whole_metrics
    assert max_weight_diff(zero, reference) < WEIGHT_ATOL
    assert zero_metrics["grad_norm"] == pytest.approx(norms[0], rel=1e-6)


def test_the_mismatch_is_measured_before_the_first_optimizer_step() -> None:
    """The behaviour log-probs are the trainer's own at the sampling weights, so the train/inference
    mismatch is 0 on the rows scored before the first optimizer step. Log-probs of a later mini-batch
    (after a step of lr 1e-2) differ by about 1e-2: measuring them would report a mismatch."""
    model = policy()
    r, advantages = rollouts(model)
    metrics = update_policy(model, r, advantages, algorithm(mini_batch_size=4, updates_per_step=2, lr=1e-2))
    assert metrics["mismatch_abs_max"] < 1e-6


@pytest.mark.parametrize(("mini", "micro"), [(0, 0), (6, 2), (12, 5)])
def test_a_packed_update_is_the_padded_update(mini: int, micro: int) -> None:
    """Packing changes the micro-batches (cut by a token budget) and the forward (one packed row), not
    the step: weights and metrics agree with the padded update's to float32 rounding."""
    model = policy()
    r, advantages = rollouts(model)
    padded, packed = copy.deepcopy(model), copy.deepcopy(model)
    want = update_policy(padded, r, advantages, algorithm(mini_batch_size=mini, micro_batch_size=micro))
    got = update_policy(packed, r, advantages,
                        algorithm(mini_batch_size=mini, micro_batch_size=micro, pack_sequences=True))
    assert max_weight_diff(packed, padded) < WEIGHT_ATOL
    assert max_weight_diff(packed, model) > DIFFERENT
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("pack", [False, True])
def test_critic_mini_batches_are_sequential_steps_too(pack: bool) -> None:
    torch.manual_seed(3)
    critic = LlamaCritic(DIMS)
    r, _ = rollouts(policy())
    g = torch.Generator().manual_seed(6)
    returns = torch.where(r["response_mask"], torch.randn(r["response_mask"].shape, generator=g), 0.0)
    with torch.no_grad():
        old_values = token_values(critic, *(r[k] for k in training.ROW_FIELDS))
    a = algorithm(mini_batch_size=4, micro_batch_size=3, pack_sequences=pack)
    reference = copy.deepcopy(critic)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=a.lr, betas=a.betas, weight_decay=a.weight_decay)
    for rows in loss_fns.micro_batch_slices(NUM_ROWS, 3):
        optimizer.zero_grad(set_to_none=True)
        mask = r["response_mask"][rows]
        values = token_values(reference, *(r[k][rows] for k in training.ROW_FIELDS))
        loss, _ = loss_fns.critic_objective(values, old_values[rows], returns[rows], mask,
                                            alg.token_weights(mask, a.loss_agg), a)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), a.max_grad_norm)
        optimizer.step()
    training.update(trained(critic, a), "critic", a, r, {"returns": returns}, old_values, None,
                    temperature=TEMPERATURE, group=None, rt=RT, node="critic", step=0)
    assert max_weight_diff(critic, reference) < WEIGHT_ATOL
