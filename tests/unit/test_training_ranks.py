"""Mini-batches and packed sequences on two real ranks (gloo, one spawn for every case).

- Data parallel (DDP, and FSDP2 packed): each rank holds half of the 12 responses; with mini_batch_size
  6, optimizer step k takes the k-th 3 rows of each rank, its loss aggregated over those 6 responses
  (counts all-reduced). That must be the update of one rank holding the whole batch ordered as the
  mini-batches take it, to float32 rounding (data-parallel gradients are summed in another order).
- A zero2 trainer with every decoder layer an FSDP2 unit of its own gathers each unit once per optimizer
  step, however many micro-batches the step takes. A colocated generator that samples from its module
  (`generator_reads_trainer`): gathered in place, the module scores and samples as the
  one-rank model with the same weights, and the trainer's next update (whose forward finds the weights
  gathered, after the generation ran every unit's hooks) is still the one-rank update.
- Tensor parallel: the generator's `TensorParallelLlama` (explicit shards) and the trainer's
  `parallelize_llama` (DTensor) score packed sequences as the full model scores padded ones, and a packed
  tp=2 update with mini-batches equals the padded update of the full model on one rank.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

from graphrl.executors.local_world import run_on_ranks
from graphrl.executors import training
from graphrl.executors import parallel
from graphrl.executors.models.llama import Llama
from graphrl.executors.models.sampling import generate, token_logprobs_and_entropy
from graphrl.executors.parallel import (build_optimizer, full_state_dict, gather_in_place, trainer_mesh_groups,
                                        wrap_tensor_parallel_trainer, wrap_trainer)
from graphrl.executors.roles import RoleState
from graphrl.executors.runtime import Runtime
from graphrl.executors.tensor_parallel import TensorParallelGroup, TensorParallelLlama
from graphrl.schemas.job import AlgorithmSpec
from graphrl.schemas.model import MODEL_PRESETS
from graphrl.schemas.plan import MemoryBytes, RolePlacement
from test_training import rollouts  # the single-rank tests' ragged rows (one empty, one full response)

pytestmark = pytest.mark.slow

DIMS = MODEL_PRESETS["tiny-digits"]  # 4 query heads over 2 KV heads: one KV head per tp rank
NUM_ROWS, PROMPT_LEN, RESPONSE_LEN = 12, 5, 6
TEMPERATURE = 0.7
LR = 1e-3
# AdamW moves each weight by about lr per step whatever the size of its gradient, so a weight whose
# gradient is almost 0 turns the rounding of another summation order (data-parallel, tp) into a few
# percent of lr (measured up to 8e-6 here); another sequence of optimizer steps moves weights by ~lr.
WEIGHT_ATOL = 5e-5
LOGPROB_ATOL = 1e-5
# One rank holding the whole batch takes mini-batch k = rows k*3..k*3+2 of each rank's half.
MINI_BATCH_ORDER = [0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11]


def policy() -> Llama:
    torch.manual_seed(0)
    return Llama(DIMS)


def algorithm(**settings: Any) -> AlgorithmSpec:
    return AlgorithmSpec(**{"lr": LR, "loss_agg": "seq_mean_token_mean", "entropy_coef": 0.01,
                            "mini_batch_size": 6, "micro_batch_size": 2, **settings})


def rows_of(r: dict[str, torch.Tensor], advantages: torch.Tensor, rows: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return {k: (v if k == "version" else v[rows]) for k, v in r.items()}, advantages[rows]


def role(model: torch.nn.Module, wrapped: torch.nn.Module, wrapping: str, sharding: str, group: Any,
         a: AlgorithmSpec) -> RoleState:
    optimizer = build_optimizer(wrapped, sharding, wrapping, group, lr=a.lr, betas=a.betas, weight_decay=a.weight_decay)
    placement = RolePlacement(role="policy", model="policy", kind="train", ops=["train"], mesh="trainer",
                              sharding=sharding, memory_bytes=MemoryBytes())
    return RoleState(placement, model, wrapped, wrapping, optimizer)


def update(state: RoleState, r: dict[str, torch.Tensor], advantages: torch.Tensor, a: AlgorithmSpec, group: Any,
           rt: Runtime) -> dict[str, float]:
    return training.update(state, "grpo", a, r, {"advantages": advantages}, None, None, temperature=TEMPERATURE,
                           group=group, rt=rt, node="update", step=0)


def one_rank_update(model: Llama, r: dict[str, torch.Tensor], advantages: torch.Tensor,
                    a: AlgorithmSpec) -> dict[str, float]:
    wrapped, wrapping = wrap_trainer(model, "none", None, torch.device("cpu"))
    return update(role(model, wrapped, wrapping, "none", None, a), r, advantages, a, None,
                  Runtime(0, 1, torch.device("cpu"), {}))


def max_diff(state: dict[str, torch.Tensor], model: torch.nn.Module) -> float:
    return max(float((state[name] - p.detach()).abs().max()) for name, p in model.state_dict().items())


def worst(value: float) -> float:
    """The largest `value` over the ranks (every rank checks its own copy)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def data_parallel_case(rank: int, sharding: str, pack: bool) -> dict[str, float]:
    model, a = policy(), algorithm(pack_sequences=pack)
    r, advantages = rollouts(model)
    whole = copy.deepcopy(model)
    want = one_rank_update(whole, *rows_of(r, advantages, MINI_BATCH_ORDER), algorithm())
    group = dist.group.WORLD
    wrapped, wrapping = wrap_trainer(model, sharding, group, torch.device("cpu"), pack=pack)
    rt = Runtime(rank, 2, torch.device("cpu"), {})
    half = slice(6 * rank, 6 * rank + 6)
    got = update(role(model, wrapped, wrapping, sharding, group, a), *rows_of(r, advantages, half), a, group, rt)
    other_order = policy()
    one_rank_update(other_order, r, advantages, algorithm())
    weights = full_state_dict(model)
    return {"weight_diff": worst(max_diff(weights, whole)), "other_order_diff": worst(max_diff(weights, other_order)),
            "loss_diff": worst(abs(_mean_over_ranks(got["loss"]) - want["loss"])),
            "grad_norm_diff": worst(abs(got["grad_norm"] - want["grad_norm"]))}


def _mean_over_ranks(value: float) -> float:
    """A rank's loss is its share times the data-parallel size; the executor reports the mean over ranks."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


class _counting_gathers:
    """Counts FSDP2's unit gathers (one `foreach_all_gather` per unit) until `restore`."""

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group

        self.module, self.count = _fsdp_param_group, 0
        self.original = _fsdp_param_group.foreach_all_gather

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return self.original(*args, **kwargs)

        _fsdp_param_group.foreach_all_gather = counted

    def restore(self) -> None:
        self.module.foreach_all_gather = self.original


def generator_reads_trainer_case(rank: int) -> dict[str, float]:
    model, a = policy(), algorithm()
    r, advantages = rollouts(model)
    whole = copy.deepcopy(model)
    group = dist.group.WORLD
    rt = Runtime(rank, 2, torch.device("cpu"), {})
    half = slice(6 * rank, 6 * rank + 6)
    one_unit_each = parallel.layer_units
    parallel.layer_units = lambda layers, tp: [[layer] for layer in layers]  # a unit per layer, as in a large model
    try:
        wrapped, wrapping = wrap_trainer(model, "zero2", group, torch.device("cpu"))
    finally:
        parallel.layer_units = one_unit_each
    units = len(parallel.fsdp_units_of(wrapped))
    trainer = role(model, wrapped, wrapping, "zero2", group, a)
    one_rank = role(whole, *wrap_trainer(whole, "none", None, torch.device("cpu")), "none", None, a)
    one_rt = Runtime(0, 1, torch.device("cpu"), {})
    gathers = _counting_gathers()
    try:
        update(trainer, *rows_of(r, advantages, half), a, group, rt)
    finally:
        gathers.restore()
    update(one_rank, *rows_of(r, advantages, MINI_BATCH_ORDER), a, None, one_rt)

    gather_in_place(wrapped)  # the weight sync of a generator that samples from the trainer's module
    whole_tensors = all(type(p) is torch.nn.Parameter for p in model.parameters())
    args = [r[k] for k in training.ROW_FIELDS]
    prompts = (r["prompt_ids"], r["prompt_mask"])
    with torch.no_grad():
        got_lp, _ = token_logprobs_and_entropy(model, *args)
        want_lp, _ = token_logprobs_and_entropy(whole, *args)
    sampled = generate(model, *prompts, RESPONSE_LEN, generator=torch.Generator().manual_seed(1)).response_ids
    expected = generate(whole, *prompts, RESPONSE_LEN, generator=torch.Generator().manual_seed(1)).response_ids

    update(trainer, *rows_of(r, advantages, half), a, group, rt)  # the forward finds the weights gathered
    update(one_rank, *rows_of(r, advantages, MINI_BATCH_ORDER), a, None, one_rt)
    steps = training.optimizer_steps(rows_of(r, advantages, half)[0], a, group, rt)[0]
    return {"units": float(units), "gathers_per_optimizer_step": gathers.count / len(steps),
            "micro_batches": float(len(steps[0].micro)), "whole_tensors": float(worst(0.0 if whole_tensors else 1.0) == 0.0),
            "logprob_diff": worst(float((got_lp - want_lp).abs().max())),
            "samples_differ": worst(float((sampled != expected).sum())),
            "second_update_weight_diff": worst(max_diff(full_state_dict(model), whole))}


def tensor_parallel_case(rank: int) -> dict[str, float]:
    full = policy()
    r, advantages = rollouts(full)
    args = [r[k] for k in training.ROW_FIELDS]
    with torch.no_grad():
        want_lp, want_ent = token_logprobs_and_entropy(full, *args)
        generator = TensorParallelLlama.from_full(full, TensorParallelGroup(rank, 2, dist.group.WORLD))
        gen_lp, gen_ent = token_logprobs_and_entropy(generator, *args, pack=True)
    out = {"generator_logprob_diff": worst(float(torch.cat([(gen_lp - want_lp).abs(), (gen_ent - want_ent).abs()]).max()))}

    # The trainer's DTensor layout, packed: its scores, then a mini-batched update against one full rank.
    a = algorithm(pack_sequences=True)
    whole = copy.deepcopy(full)
    one_rank_update(whole, r, advantages, algorithm())
    fsdp_group, tp_group = trainer_mesh_groups((0, 1), 2, rank, 60.0)  # type: ignore[misc]
    wrapped, wrapping = wrap_tensor_parallel_trainer(full, "fsdp", (0, 1), 2, (fsdp_group, tp_group),
                                                     torch.device("cpu"), pack=True)
    with torch.no_grad():
        lp, ent = wrapped(*args)
    out["trainer_logprob_diff"] = worst(float(torch.cat([(lp - want_lp).abs(), (ent - want_ent).abs()]).max()))
    update(role(full, wrapped, wrapping, "fsdp", fsdp_group, a), r, advantages, a, fsdp_group,
           Runtime(rank, 2, torch.device("cpu"), {}))
    out["tp_weight_diff"] = worst(max_diff(full_state_dict(full), whole))
    return out


def measure(rank: int, world: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    assert world == 2
    return {"ddp": data_parallel_case(rank, "none", pack=False),
            "fsdp2 packed": data_parallel_case(rank, "fsdp", pack=True),
            "generator reads zero2": generator_reads_trainer_case(rank),
            "tp": tensor_parallel_case(rank)}


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, float]]:
    return run_on_ranks(2, measure)[0]


@pytest.mark.parametrize("layout", ["ddp", "fsdp2 packed"])
def test_two_data_parallel_ranks_with_mini_batches_take_the_one_rank_steps(layout: str, reports) -> None:
    got = reports[layout]
    assert got["weight_diff"] < WEIGHT_ATOL, got
    # One rank taking rows 0-5 first (not the k-th rows of each rank) trains another update.
    assert got["other_order_diff"] > 10 * WEIGHT_ATOL, got
    assert got["loss_diff"] < 1e-6 and got["grad_norm_diff"] < 1e-5, got


def test_tensor_parallel_models_score_packed_sequences_as_the_full_model(reports) -> None:
    got = reports["tp"]
    assert got["generator_logprob_diff"] < LOGPROB_ATOL, got
    assert got["trainer_logprob_diff"] < LOGPROB_ATOL, got
    assert got["tp_weight_diff"] < WEIGHT_ATOL, got


def test_a_generator_samples_from_a_zero2_trainers_gathered_weights_as_from_its_own_copy(reports) -> None:
    got = reports["generator reads zero2"]
    assert got["units"] == DIMS.num_layers + 1, got  # every layer a unit, and the root
    # Micro-batches accumulate with the weights kept gathered: each optimizer step gathers every unit once.
    assert got["micro_batches"] > 1 and got["gathers_per_optimizer_step"] == got["units"], got
    assert got["whole_tensors"] == 1.0, got  # gathered in place: the module's parameters are plain tensors
    assert got["logprob_diff"] < LOGPROB_ATOL and got["samples_differ"] == 0, got
    assert got["second_update_weight_diff"] < WEIGHT_ATOL, got
