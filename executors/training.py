"""One update of a trained role on this rank: its share of the batch in micro-batches, gradients
accumulated and reduced once, the loss aggregated over the whole batch whatever the layout.

The loss terms are `executors/loss.py`'s; this module decides how a rank's rows are cut and weighted so
that every layout and rank count takes the step one rank would take on the whole batch: the
aggregation's token weights come from the batch's counts (one all-reduce), each rank backpropagates its
share times the data-parallel size (the wrappers average), and the ranks of a group agree on the number
of micro-batches (every forward of a wrapped model runs collectives).
"""

from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from graphrl.schemas.algorithms import LOSSES
from graphrl.schemas.job import AlgorithmSpec

from graphrl.executors import algorithms as alg
from graphrl.executors import loss as loss_fns
from graphrl.executors.guards import check_update
from graphrl.executors.mismatch import logprob_mismatch
from graphrl.executors.models.llama import sampling_temperature
from graphrl.executors.parallel import clip_grad_norm
from graphrl.executors.roles import RoleState
from graphrl.executors.runtime import Runtime

ROW_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def data_parallel_group(role: RoleState, mesh_groups: dict[str, Any], rt: Runtime) -> Any:
    """The group over which `role`'s gradients are averaged (its tp ranks share their data)."""
    if role.placement.tp > 1:
        return mesh_groups[role.placement.mesh][0]
    return rt.group("trainer")


def micro_batches(rows: Mapping[str, Tensor], algorithm: AlgorithmSpec, group: Any, rt: Runtime) -> list[slice]:
    """This rank's `rows` (the row fields of some responses) cut into micro-batches of at most
    `micro_batch_size` rows, or, with `pack_sequences`, contiguous micro-batches of at most
    micro_batch_size x (P + R) real tokens (the room of micro_batch_size padded rows), counted greedily
    and cut balanced (`loss.packed_micro_batch_slices`). Over a data-parallel `group` (a trained role's,
    or a frozen model's sharded over it) the ranks agree on the count, the largest any rank needs: their
    forwards run collectives together. No group: the role's forwards run no collectives, or only over
    tensor-parallel ranks that hold the same rows, which agree already. `micro_batch_size` 0: the rows
    in one micro-batch."""
    size = algorithm.micro_batch_size
    num_rows = rows["response_mask"].shape[0]
    if algorithm.pack_sequences:
        tokens_per_row = sequence_tokens(rows).tolist()
        budget = size * (rows["prompt_ids"].shape[1] + rows["response_ids"].shape[1])
        num_micro = loss_fns.num_packed_micro_batches(tokens_per_row, budget)
    else:
        num_micro = loss_fns.num_micro_batches(num_rows, size)
    if group is not None and size > 0:
        count = torch.tensor([num_micro], dtype=torch.int64, device=rt.comm_device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        num_micro = int(count.item())
    if algorithm.pack_sequences:
        return loss_fns.packed_micro_batch_slices(tokens_per_row, num_micro)
    return loss_fns.micro_batch_slices(num_rows, num_micro)


def sequence_tokens(rows: Mapping[str, Tensor]) -> Tensor:
    """Real tokens (prompt and response) of each row: its length as a packed sequence."""
    return (rows["prompt_mask"].to(torch.bool).sum(1) + rows["response_mask"].to(torch.bool).sum(1)).cpu()


def batch_sum(x: Tensor, group: Any, rt: Runtime) -> Tensor:
    """`x` summed over the data-parallel ranks of `group` (each holds a part of the batch)."""
    if group is None:
        return x
    total = x.detach().to(device=rt.comm_device, dtype=torch.float64).clone()
    dist.all_reduce(total, group=group)
    return total.to(x.device)


def loss_weights(mask: Tensor, loss_agg: str, group: Any, rt: Runtime) -> tuple[alg.TokenWeights, int]:
    """The aggregation's token weights of this rank's responses, from the counts of the whole batch, and
    the size of the data-parallel group.

    A loss aggregated with them is this rank's share of the batch's loss; the data-parallel wrappers
    average gradients over the n ranks, so each rank backpropagates n times its share, and the
    averaged gradient (and the reported mean loss) is the batch's, as on one rank."""
    counts = alg.batch_counts(mask)
    if group is None:
        return alg.token_weights(mask, loss_agg, counts), 1
    packed = torch.cat([counts, torch.ones(1, dtype=torch.float64)]).to(rt.comm_device)
    dist.all_reduce(packed, group=group)
    packed = packed.cpu()
    weights = alg.token_weights(mask.cpu(), loss_agg, packed[:2])
    return alg.TokenWeights(weights.loss.to(mask.device), weights.stats.to(mask.device)), int(packed[2])


def update(role: RoleState, loss_name: str, a: AlgorithmSpec, rollouts: dict[str, Tensor], advantages: dict[str, Tensor],
           old: Tensor | None, ref: Tensor | None, *, temperature: float, group: Any, rt: Runtime, node: str,
           step: int) -> dict[str, float]:
    """`a.updates_per_step` optimizer steps of `role` on its rows; the step's metrics (summed over its
    micro-batches as shares of the batch). `old` is the old log-probs (a policy) or values (a critic)."""
    assert role.wrapped is not None and role.optimizer is not None
    module, mask = role.wrapped, rollouts["response_mask"]
    critic = LOSSES[loss_name].trains == "critic"
    weights, dp_size = loss_weights(mask, a.loss_agg, group, rt)
    slices = micro_batches({key: rollouts[key] for key in ROW_FIELDS}, a, group, rt)
    # When the trainer holds the weights the rollouts were sampled with (a synchronous step), its first
    # pass's log-probs against the generator's give the train/inference mismatch.
    same_weights = not critic and int(rollouts["version"].item()) == role.version
    first_pass: list[Tensor] = []
    metrics: dict[str, float] = {}
    for update in range(a.updates_per_step):
        role.optimizer.zero_grad(set_to_none=True)
        metrics = {}
        for k, rows in enumerate(slices):
            b = {key: rollouts[key][rows] for key in ROW_FIELDS}
            part = None if old is None else old[rows]
            with _gradient_sync(module, enabled=k == len(slices) - 1):
                if critic:
                    values = module(*(b[key] for key in ROW_FIELDS))
                    loss, part_metrics = loss_fns.critic_objective(values, part, advantages["returns"][rows],
                                                                   b["response_mask"], weights.rows(rows), a)
                else:
                    with sampling_temperature(role.module, temperature):
                        logprobs, entropy = module(*(b[key] for key in ROW_FIELDS))
                    if update == 0 and same_weights:
                        first_pass.append(logprobs.detach())
                    batch = loss_fns.PolicyBatch(
                        logprobs, entropy, part, rollouts["behaviour_logprobs"][rows],
                        None if ref is None else ref[rows], advantages["advantages"][rows], b["response_mask"],
                        weights.rows(rows), advantages["kl"][rows] if "kl" in advantages else None)
                    loss, part_metrics = loss_fns.policy_objective(batch, loss_name, a)
                # DDP / FSDP2 average gradients over the data-parallel ranks; each rank's loss is its share.
                (loss * dp_size).backward()
            for key, value in part_metrics.items():
                metrics[key] = metrics.get(key, 0.0) + value * dp_size
        grad_norm = clip_grad_norm(list(role.module.parameters()), a.max_grad_norm)
        check_update(float(loss.detach()), float(grad_norm), node=node, step=step)
        role.optimizer.step()
        metrics["grad_norm"] = float(grad_norm)
    if first_pass:
        metrics.update(logprob_mismatch(rollouts["behaviour_logprobs"], torch.cat(first_pass), mask, a.aipo_rho))
    return metrics


def _gradient_sync(module: nn.Module, *, enabled: bool) -> Any:
    """A context in which `module`'s backward does (or, for all but a step's last micro-batch, does not)
    reduce gradients over the data-parallel ranks: DDP's `no_sync`, FSDP2's
    `set_requires_gradient_sync`; nothing for a module without a wrapper."""
    if enabled:
        return contextlib.nullcontext()
    if hasattr(module, "no_sync"):
        return module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):
        return _FsdpNoSync(module)
    return contextlib.nullcontext()


class _FsdpNoSync:
    """FSDP2's gradient reduction switched off for the block (gradients accumulate unsharded)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.module.set_requires_gradient_sync(False)  # type: ignore[operator]

    def __exit__(self, *exc: object) -> None:
        self.module.set_requires_gradient_sync(True)  # type: ignore[operator]


__all__ = ["batch_sum", "data_parallel_group", "loss_weights", "micro_batches", "sequence_tokens", "update"]
