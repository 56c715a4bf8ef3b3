"""One update of a trained role on this rank: each pass over the batch takes one optimizer step per
mini-batch, each step on its share of the rows in micro-batches, gradients accumulated and reduced once
per step, the loss aggregated over the step's mini-batch whatever the layout.

The loss terms are `executors/loss.py`'s; this module decides how a rank's rows are cut and weighted so
that every layout and rank count takes the steps one rank would take: optimizer step k of a pass uses
the k-th contiguous chunk of every data-parallel rank's rows (together, the mini-batch); the
aggregation's token weights come from the mini-batch's counts (one all-reduce), each rank
backpropagates its share times the data-parallel size (the wrappers average), and the ranks of a group
agree on the number of micro-batches (every forward of a wrapped model runs collectives).
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from graphrl.errors import RunError
from graphrl.schemas.algorithms import LOSSES
from graphrl.ops import LOSS_MASK_FIELD, ROUTES_FIELD
from graphrl.schemas.job import AlgorithmSpec
from graphrl.schemas.model import ModelDims

from graphrl.executors import algorithms as alg
from graphrl.executors import loss as loss_fns
from graphrl.executors.guards import check_update
from graphrl.executors.mismatch import logprob_mismatch
from graphrl.executors.models.llama import Routing, routing
from graphrl.executors.models.sampling import sampling_temperature
from graphrl.executors.parallel import clip_grad_norm
from graphrl.executors.roles import RoleState
from graphrl.executors.runtime import Runtime

ROW_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def loss_mask(rollouts: Mapping[str, Tensor]) -> Tensor:
    """The tokens losses, advantages and metrics count: the model's (an episode's environment tokens are real
    tokens of the sequence, attended to, but not the model's)."""
    mask = rollouts.get(LOSS_MASK_FIELD)
    return rollouts["response_mask"] if mask is None else mask


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


def mini_batches(num_rows: int, mini_batch_size: int, group: Any, rt: Runtime) -> list[slice]:
    """This rank's rows cut into one pass's optimizer steps: the batch (the rows of every rank of the
    data-parallel `group`) makes batch / mini_batch_size steps, and step k takes the k-th of as many
    contiguous chunks of each rank's rows (`loss.micro_batch_slices`: mini_batch_size / dp rows each
    when dp divides mini_batch_size, sizes differing by one otherwise). 0: one step on the whole batch."""
    if mini_batch_size == 0:
        return [slice(0, num_rows)]
    rows_per_rank = [num_rows]
    if group is not None:
        gathered = [torch.zeros(1, dtype=torch.int64, device=rt.comm_device)
                    for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, torch.tensor([num_rows], dtype=torch.int64, device=rt.comm_device), group=group)
        rows_per_rank = [int(n.item()) for n in gathered]
    batch = sum(rows_per_rank)
    if batch % mini_batch_size:
        raise RunError(f"mini_batch_size {mini_batch_size} does not divide the batch of {batch} responses",
                       fix=f"set algorithm.mini_batch_size to a divisor of {batch}, or 0")
    num_steps = batch // mini_batch_size
    if min(rows_per_rank) < num_steps:
        raise RunError(f"mini_batch_size {mini_batch_size} is smaller than the {len(rows_per_rank)} data-parallel "
                       f"ranks that share each optimizer step: some ranks hold none of a mini-batch's responses",
                       fix=f"set algorithm.mini_batch_size to a multiple of {len(rows_per_rank)}")
    return loss_fns.micro_batch_slices(num_rows, num_steps)


def batch_sum(x: Tensor, group: Any, rt: Runtime) -> Tensor:
    """`x` summed over the data-parallel ranks of `group` (each holds a part of the batch)."""
    if group is None:
        return x
    total = x.detach().to(device=rt.comm_device, dtype=torch.float64).clone()
    dist.all_reduce(total, group=group)
    return total.to(x.device)


def loss_weights(mask: Tensor, loss_agg: str, group: Any, rt: Runtime) -> tuple[alg.TokenWeights, int]:
    """The aggregation's token weights of this rank's responses `mask`, from the counts of the responses
    of every rank of `group` (an optimizer step's mini-batch), and the size of the data-parallel group.

    A loss aggregated with them is this rank's share of the mini-batch's loss; the data-parallel wrappers
    average gradients over the n ranks, so each rank backpropagates n times its share, and the
    averaged gradient (and the reported mean loss) is the mini-batch's, as on one rank."""
    counts = alg.batch_counts(mask)
    if group is None:
        return alg.token_weights(mask, loss_agg, counts), 1
    packed = torch.cat([counts, torch.ones(1, dtype=torch.float64)]).to(rt.comm_device)
    dist.all_reduce(packed, group=group)
    packed = packed.cpu()
    weights = alg.token_weights(mask.cpu(), loss_agg, packed[:2])
    return alg.TokenWeights(weights.loss.to(mask.device), weights.stats.to(mask.device)), int(packed[2])


@dataclass(frozen=True)
class OptimizerStep:
    """One optimizer step of a pass on this rank: its rows (this rank's chunk of the mini-batch), their
    token weights (from the mini-batch's counts) and its micro-batches (slices of `rows`)."""

    rows: slice
    weights: alg.TokenWeights
    micro: list[slice]

    def micro_rows(self, micro: slice) -> slice:
        """A micro-batch's rows among the rank's rows."""
        return slice(self.rows.start + micro.start, self.rows.start + micro.stop)


def optimizer_steps(rollouts: Mapping[str, Tensor], algorithm: AlgorithmSpec, group: Any,
                    rt: Runtime) -> tuple[list[OptimizerStep], int]:
    """The optimizer steps of one pass over this rank's rows (the same for every pass: the weights read
    only masks), and the data-parallel size."""
    mask, steps, dp_size = loss_mask(rollouts), [], 1
    for rows in mini_batches(mask.shape[0], algorithm.mini_batch_size, group, rt):
        weights, dp_size = loss_weights(mask[rows], algorithm.loss_agg, group, rt)
        micro = micro_batches({key: rollouts[key][rows] for key in ROW_FIELDS}, algorithm, group, rt)
        steps.append(OptimizerStep(rows, weights, micro))
    return steps, dp_size


def update(role: RoleState, loss_name: str, a: AlgorithmSpec, rollouts: dict[str, Tensor], advantages: dict[str, Tensor],
           old: Tensor | None, ref: Tensor | None, *, temperature: float, group: Any, rt: Runtime, node: str,
           step: int) -> dict[str, float]:
    """`a.updates_per_step` passes over `role`'s rows, each one optimizer step per mini-batch; the step's
    metrics: the mean over the last pass's optimizer steps of each one's loss terms (summed over its
    micro-batches as shares of its mini-batch) and of its gradient norm. `old` is the old log-probs (a
    policy) or values (a critic)."""
    assert role.wrapped is not None and role.optimizer is not None
    module, mask = role.wrapped, loss_mask(rollouts)
    critic = LOSSES[loss_name].trains == "critic"
    steps, dp_size = optimizer_steps(rollouts, a, group, rt)
    # When the trainer holds the weights the rollouts were sampled with (a synchronous step), its log-probs
    # before the first optimizer step against the generator's give the train/inference mismatch.
    same_weights = not critic and int(rollouts["version"].item()) == role.version
    first_step: list[Tensor] = []
    last_pass: list[dict[str, float]] = []
    dims = getattr(role.module, "dims", None)
    moe = not critic and dims is not None and dims.is_moe
    routes = rollouts.get(ROUTES_FIELD) if moe else None
    own_routes: dict[tuple[int, int], Tensor] = {}  # R2: each micro-batch's routing in the first pass
    router = RouterStats()
    for pass_index in range(a.updates_per_step):
        last_pass = []
        for s, opt_step in enumerate(steps):
            role.optimizer.zero_grad(set_to_none=True)
            metrics: dict[str, float] = {}
            for k, micro in enumerate(opt_step.micro):
                rows = opt_step.micro_rows(micro)
                b = {key: rollouts[key][rows] for key in ROW_FIELDS}
                part = None if old is None else old[rows]
                weights = opt_step.weights.rows(micro)
                with _gradient_sync(module, enabled=k == len(opt_step.micro) - 1,
                                    keep_gathered=role.placement.sharding == "zero2"):
                    if critic:
                        values = module(*(b[key] for key in ROW_FIELDS))
                        loss, part_metrics = loss_fns.critic_objective(values, part, advantages["returns"][rows],
                                                                       mask[rows], weights, a)
                    else:
                        # The generator's routes: imposed under R3; on the first step on the generator's
                        # weights, at least compared with the router's own (the routing mismatch).
                        first = pass_index == 0 and s == 0 and same_weights
                        given = routes[rows] if routes is not None and (a.router_replay == "R3" or first) else None
                        with sampling_temperature(role.module, temperature), \
                                _routing(role.module, moe, own_routes.get((s, k)), a.router_replay == "R3") as log:
                            logprobs, entropy = module(*(b[key] for key in ROW_FIELDS), routes=given)
                        if first:
                            first_step.append(logprobs.detach())
                        batch = loss_fns.PolicyBatch(
                            logprobs, entropy, part, rollouts["behaviour_logprobs"][rows],
                            None if ref is None else ref[rows], advantages["advantages"][rows], mask[rows],
                            weights, advantages["kl"][rows] if "kl" in advantages else None)
                        loss, part_metrics = loss_fns.policy_objective(batch, loss_name, a)
                        if log is not None:
                            loss = router.account(log, loss, dims, a, measured=first and given is not None,
                                                  share=(rows.stop - rows.start) / (opt_step.rows.stop - opt_step.rows.start))
                            if a.router_replay == "R2" and pass_index == 0:
                                own_routes[(s, k)] = torch.stack(log.chosen)
                    # DDP / FSDP2 average gradients over the data-parallel ranks; each rank's loss is its share.
                    (loss * dp_size).backward()
                for key, value in part_metrics.items():
                    metrics[key] = metrics.get(key, 0.0) + value * dp_size
            grad_norm = clip_grad_norm(list(role.module.parameters()), a.max_grad_norm)
            check_update(float(loss.detach()), float(grad_norm), node=node, step=step)
            role.optimizer.step()
            metrics["grad_norm"] = float(grad_norm)
            last_pass.append(metrics)
    metrics = {key: sum(m[key] for m in last_pass) / len(last_pass) for key in last_pass[0]}
    if first_step:
        rows = steps[0].rows
        metrics.update(logprob_mismatch(rollouts["behaviour_logprobs"][rows], torch.cat(first_step), mask[rows],
                                        a.aipo_rho))
    metrics.update(router.metrics())
    return metrics


@contextmanager
def _routing(model: nn.Module, moe: bool, replay: Tensor | None, impose_given: bool) -> Iterator[Routing | None]:
    """A mixture of experts' routing log around a training forward (its router logits kept for the
    load-balancing loss; `replay` imposed: R2's first-pass routes; the generator's routes imposed with
    `impose_given`, R3, else only compared), or nothing for a dense model."""
    if not moe:
        yield None
        return
    with routing(model, keep_logits=True, replay=replay, impose_given=impose_given) as log:
        yield log


@dataclass
class RouterStats:
    """A mixture of experts' training: its load-balancing loss added to each micro-batch's, and the share of
    the generator's router decisions the trainer's router makes otherwise (the routing mismatch, measured
    where the trainer holds the generator's weights)."""

    aux: float = 0.0
    aux_parts: int = 0
    differing: float = 0.0
    decisions: float = 0.0

    def account(self, log: Routing, loss: Tensor, dims: ModelDims, a: AlgorithmSpec, *, measured: bool,
                share: float) -> Tensor:
        """`loss` with a micro-batch's load-balancing loss added (`share`: its part of the optimizer step's
        rows); its router figures counted (the mismatch where `measured`)."""
        aux = log.router_loss(dims.num_experts, dims.experts_per_token)
        self.aux += float(aux.detach())
        self.aux_parts += 1
        if measured:
            self.differing += float(log.differing)
            self.decisions += float(log.decisions)
        coef = dims.router_aux_loss_coef if a.router_aux_loss_coef is None else a.router_aux_loss_coef
        return loss + coef * share * aux if coef else loss

    def metrics(self) -> dict[str, float]:
        out = {}
        if self.aux_parts:
            out["router_aux_loss"] = self.aux / self.aux_parts
        if self.decisions:
            out["router_mismatch"] = self.differing / self.decisions
        return out


def _gradient_sync(module: nn.Module, *, enabled: bool, keep_gathered: bool = False) -> Any:
    """A context in which `module`'s backward does (or, for all but a step's last micro-batch, does not)
    reduce gradients over the data-parallel ranks: DDP's `no_sync`, FSDP2's
    `set_requires_gradient_sync`; nothing for a module without a wrapper. `keep_gathered` (zero2): FSDP2
    also keeps the weights gathered after such a backward, so the next micro-batch's forward gathers
    nothing and the step gathers its weights once, as the plan charges zero2."""
    if enabled:
        return contextlib.nullcontext()
    if hasattr(module, "no_sync"):
        return module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):
        return _FsdpNoSync(module, keep_gathered)
    return contextlib.nullcontext()


class _FsdpNoSync:
    """FSDP2's gradient reduction switched off for the block (gradients accumulate unsharded) and, with
    `keep_gathered`, its resharding after backward."""

    def __init__(self, module: nn.Module, keep_gathered: bool) -> None:
        self.module = module
        self.keep_gathered = keep_gathered

    def __enter__(self) -> None:
        self.module.set_requires_gradient_sync(False)  # type: ignore[operator]
        if self.keep_gathered:
            self.module.set_reshard_after_backward(False)  # type: ignore[operator]

    def __exit__(self, *exc: object) -> None:
        self.module.set_requires_gradient_sync(True)  # type: ignore[operator]
        if self.keep_gathered:
            self.module.set_reshard_after_backward(True)  # type: ignore[operator]


__all__ = ["loss_mask", "OptimizerStep", "batch_sum", "data_parallel_group", "loss_weights", "micro_batches", "mini_batches",
           "optimizer_steps", "sequence_tokens", "update"]
