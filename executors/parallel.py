"""Training parallelism as the plan says: torch's FSDP2 (`fully_shard`), DDP, or DDP with ZeRO-1.

The RL losses need per-token log-probabilities (or values) of the response positions only, computed
through the model's trunk; DDP and FSDP2 hook a module's `forward`, so the trainable module handed to
them is a thin adapter whose forward is exactly that computation. Its parameters are the model's.
Every sharding here is one the capability table (`graphrl.schemas.capabilities`) lists, held as the
plan's memory accounting charges it:

- `sharding: fsdp` with more than one data-parallel rank (ZeRO-3): the decoder layers, in units of
  consecutive layers (`layer_units`: a layer a unit once a layer holds `FSDP_UNIT_BYTES`; one unit with
  the root for a smaller model, whose collectives cost their latency), and then the adapter are
  `fully_shard`ed on a device mesh made from the trainer's process group (parameters become DTensors
  sharded on dim 0, o/down weights by column blocks as `fsdp_shard_dim` says, so a weight sync into
  tensor-parallel shards moves whole blocks; gathered unit by unit in forward and backward).
- `zero2`: the same `fully_shard`, with `reshard_after_forward=False`: gradients and optimizer state are
  sharded, the weights are gathered once per step and kept from forward through backward.
- `zero1`: DDP, and torch's `ZeroRedundancyOptimizer`: each rank keeps the optimizer state of its share
  of the parameters, steps it, and broadcasts the updated parameters to the others.
- `none`: DDP over the trainer's group (bucketed gradient all-reduce overlapped with backward).
- one data-parallel rank: the adapter as it is.
- `tp > 1` (`wrap_tensor_parallel_trainer`): a 2-D `DeviceMesh` (fsdp, tp) over the trainer's ranks as
  the plan lays them out (tp fastest); `parallelize_module` shards the weights over tp as the plan's
  `llama_param_layout` says (q/k/v/gate/up colwise, o/down rowwise, embedding and head by vocabulary
  rows), then `fully_shard` on the fsdp dimension, unit by unit, as above (zero2 or fsdp). Log-
  probabilities come back replicated over tp, so every tp rank computes the same loss; gradients are
  reduced over fsdp.

Mixed precision (`build_optimizer`): a bfloat16 model trains with bf16 weights and gradients (the ones
every forward, weight sync and checkpoint reads) and `MasterWeightAdamW` keeps float32 master weights
and AdamW moments of the parameters (or shards) this rank updates; a float32 model uses torch's AdamW.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from graphrl.schemas.sharding import (LLAMA_EMBEDDING, ModuleSpec, TpStyle, fsdp_layer_units, fsdp_shard_dim, llama_modules,
                                      is_adapter, tp_split_dim, tp_split_problem)
from graphrl.executors.models.llama import LlamaCritic, PackedSequences
from graphrl.executors.models.lora import Adapted, merged_weights
from graphrl.executors.models.sampling import token_logprobs_and_entropy, token_values


def _parallel_style(spec: ModuleSpec, name: str, adapted: bool = False) -> Any:
    """The `parallelize_module` style of module `name`, from its style in the model's sharding description.
    The vocabulary-parallel modules differ by position: the embedding looks rows up and returns whole
    activations, the head multiplies and returns whole logits. An `adapted` projection (LoRA) also places
    its adapters (`_adapted_style`)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if spec is LLAMA_EMBEDDING:
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if spec.tp is TpStyle.VOCAB:
        return ColwiseParallel(output_layouts=Replicate())
    style = ColwiseParallel if spec.tp is TpStyle.COLWISE else RowwiseParallel
    return _adapted_style(style, name)() if adapted else style()


def _adapted_style(style: type, name: str) -> type:
    """`style` (column- or row-parallel) for the LoRA-adapted projection `name`: its weight and bias are cut as
    the style cuts them, and its adapters as the model's sharding description says (`tp_split_dim`: A whole
    and B's rows under a column-parallel weight, A's columns and B whole under a row-parallel one), all as
    DTensors, so the adapters' gradients are reduced over tp where they are partial. torch's styles cut every
    parameter of a linear the same way, and only a module's own: the adapters are submodules."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def partition(self: Any, sub: str, module: nn.Module, device_mesh: Any) -> None:
        for kind, param in list(module.named_parameters(recurse=False)):
            dim = tp_split_dim(f"{name}.{sub}.{kind}" if sub else f"{name}.{kind}")
            placed = distribute_tensor(param, device_mesh, [Replicate() if dim is None else Shard(dim)])
            module.register_parameter(kind, nn.Parameter(placed, requires_grad=param.requires_grad))

    return type(f"Adapted{style.__name__}", (style,), {"_partition_linear_fn": partition})


class PolicyForward(nn.Module):
    """forward(prompt_ids, prompt_mask, response_ids, response_mask) -> (logprobs, entropy) [B, R]; with
    `pack` (the job's `algorithm.pack_sequences`) the rows run as packed sequences, with the same result."""

    def __init__(self, model: nn.Module, *, pack: bool = False) -> None:
        super().__init__()
        self.model = model
        self.pack = pack

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                response_mask: Tensor, routes: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return token_logprobs_and_entropy(self.model, prompt_ids, prompt_mask, response_ids, response_mask,
                                          pack=self.pack, routes=routes)


class _WholeLogits:
    """What `token_logprobs_and_entropy` reads of a tensor-parallel model: its hidden states (plain,
    replicated over tp), and logits over the whole vocabulary as a plain tensor. An untied head's
    parallel style already returns them whole; a tied head multiplies by the vocab-sharded embedding
    DTensor, whose product is gathered here, so no DTensor reaches the loss (or its backward)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model.hidden_states(input_ids, attention_mask)

    def packed_hidden_states(self, packed: PackedSequences) -> Tensor:
        return self.model.packed_hidden_states(packed)

    def logits(self, hidden_bth: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        if self.model.lm_head is not None:  # through the module, so its parallel style gathers the vocabulary
            return self.model.lm_head(hidden_bth).float()
        weight = self.model.model.embed_tokens.weight
        if not isinstance(weight, DTensor):
            return self.model.logits(hidden_bth)
        mesh = weight.device_mesh
        x = DTensor.from_local(hidden_bth, mesh, [Replicate()] * mesh.ndim)
        return F.linear(x, weight).redistribute(placements=[Replicate()] * mesh.ndim).to_local().float()


class TensorParallelPolicyForward(PolicyForward):
    """`PolicyForward` of a tensor-parallel model: (logprobs, entropy) [B, R], plain and replicated over tp."""

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                response_mask: Tensor, routes: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return token_logprobs_and_entropy(_WholeLogits(self.model), prompt_ids, prompt_mask,  # type: ignore[arg-type]
                                          response_ids, response_mask, pack=self.pack, routes=routes)


class CriticForward(nn.Module):
    """forward(prompt_ids, prompt_mask, response_ids, response_mask) -> values [B, R]; `pack` as for
    `PolicyForward`."""

    def __init__(self, model: nn.Module, *, pack: bool = False) -> None:
        super().__init__()
        self.model = model
        self.pack = pack

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor) -> Tensor:
        return token_values(self.model, prompt_ids, prompt_mask, response_ids, response_mask, pack=self.pack)


def wrap_trainer(model: nn.Module, sharding: str, group: Any, device: torch.device, *,
                 pack: bool = False) -> tuple[nn.Module, str]:
    """The trainable module for `model` and the name of the wrapping used ('fsdp2', 'ddp' or 'local');
    zero1's optimizer-state sharding is `build_optimizer`'s. `pack`: its forward packs sequences."""
    adapter: nn.Module = (CriticForward(model, pack=pack) if isinstance(model, LlamaCritic)
                          else PolicyForward(model, pack=pack))
    if group is None:
        return adapter, "local"
    if sharding in ("fsdp", "zero2"):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, device.type)
        reshard = sharding == "fsdp"
        for unit in layer_units(model.model.layers, tp=1):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard,
                        shard_placement_fn=_fsdp_placements(unit, mesh.size()))
        # The root (embedding, final norm, head, and the layers of a model smaller than one unit) is
        # gathered for backward right after forward: FSDP2's default (None) keeps it; zero2 keeps every unit.
        fully_shard(adapter, mesh=mesh, reshard_after_forward=None if reshard else False,  # type: ignore[arg-type]
                    shard_placement_fn=_fsdp_placements([adapter], mesh.size()))
        return adapter, "fsdp2"
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(adapter, process_group=group, device_ids=device_ids), "ddp"


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW that updates float32 master copies of lower-precision (bf16) parameters.

    The parameters and their gradients stay in the model's dtype; this optimizer's state holds, per
    parameter it steps, a float32 `master` copy and the two float32 moments (4 + 4 + 4 bytes per
    parameter beside the 2 + 2 of the model). A step reads each gradient in float32, runs torch's AdamW
    on the masters and rounds them back into the parameters. Parameters that are DTensors (FSDP2 shards)
    get DTensor masters of the same placement, so the state is sharded as the parameters are."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        from torch.optim.adamw import adamw

        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params, masters, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)  # fused: on the device
                    state["master"] = p.detach().to(torch.float32, copy=True)
                    state["exp_avg"] = torch.zeros_like(state["master"])
                    state["exp_avg_sq"] = torch.zeros_like(state["master"])
                params.append(p)
                masters.append(state["master"])
                grads.append(p.grad.to(torch.float32))
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["betas"]
            adamw(masters, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, beta1=beta1, beta2=beta2,
                  lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                  fused=runs_fused(masters))
            del grads  # the float32 gradients live for the step only
            for p, master in zip(params, masters):
                p.copy_(master)
        return loss


def runs_fused(params: list[Tensor]) -> bool:
    """Whether AdamW's fused kernel takes `params` in one call: all plain tensors, or all DTensors of one
    1-D mesh (FSDP2 with tp 1). DTensor refuses a call that mixes them with plain tensors (a tp trainer's
    replicated norms, the step counters beside a 2-D mesh's shards)."""
    meshes = {_mesh_of(p) for p in params}
    return meshes == {None} or (len(meshes) == 1 and next(iter(meshes)).ndim == 1)


def _mesh_of(t: Tensor) -> Any:
    """The device mesh of a DTensor; None for a plain tensor."""
    from torch.distributed.tensor import DTensor

    return t.device_mesh if isinstance(t, DTensor) else None


def build_optimizer(module: nn.Module, sharding: str, wrapping: str, group: Any, *, lr: float,
                    betas: tuple[float, float], weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer of a trained role, holding its state as the plan charges it: AdamW on a float32
    model, `MasterWeightAdamW` (float32 master weights and moments) on a bf16 one; with `zero1` over a
    DDP group, torch's `ZeroRedundancyOptimizer` around it, so each rank keeps the state of its share of
    the parameters. Under FSDP2 the parameters are shards already, and so is the state.

    AdamW runs fused (one kernel over every tensor) where it can (`runs_fused`): its foreach form launches
    about ten ops, and on FSDP2's DTensor shards each pays DTensor's dispatch (a 2-rank zero2 step of
    grpo_tiny: 3.4 ms foreach, 0.7 ms fused; 1.1 and 0.3 ms on plain tensors)."""
    params = [p for p in module.parameters() if p.requires_grad]
    mixed = any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
    optimizer_class: type[torch.optim.Optimizer] = MasterWeightAdamW if mixed else torch.optim.AdamW
    fused = {} if mixed else {"fused": runs_fused(params)}  # MasterWeightAdamW decides for itself
    if sharding == "zero1" and wrapping == "ddp":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=group,
                                       parameters_as_bucket_view=True, lr=lr,
                                       betas=betas, weight_decay=weight_decay, **fused)
    return optimizer_class(params, lr=lr, betas=betas, weight_decay=weight_decay, **fused)


def layer_units(layers: nn.ModuleList, *, tp: int) -> list[list[nn.Module]]:
    """The decoder layers of each FSDP2 unit, as the plan charges them (`fsdp_layer_units`: consecutive
    layers up to `FSDP_UNIT_BYTES` a unit; none when the model is smaller than one). `tp`: the layers'
    tensor-parallel degree (a DTensor's `numel` is the whole tensor's)."""
    layer_bytes = sum(p.numel() * p.element_size() for p in layers[0].parameters()) / tp if len(layers) else 0.0
    return [[layers[i] for i in unit] for unit in fsdp_layer_units(len(layers), layer_bytes)]


def _fsdp_placements(modules: list[nn.Module], fsdp: int) -> Any:
    """`fully_shard`'s placement for each parameter of a unit's modules: the dim the plan's layout cuts it
    along (`fsdp_shard_dim`: o/down weights by column blocks where that splits evenly)."""
    from torch.distributed.tensor import Shard

    dims = {id(p): fsdp_shard_dim(name, p.shape, fsdp, 1) for m in modules for name, p in m.named_parameters()}
    return lambda param: Shard(dims[id(param)])


def trainer_mesh_groups(ranks: tuple[int, ...], tp: int, rank: int, timeout_s: float) -> tuple[Any, Any] | None:
    """The (fsdp, tp) process groups of a tensor-parallel trainer laid out as rows of `tp` consecutive
    ranks; `new_group` is collective over the whole job, so every rank calls this, in the same order.
    This rank's (fsdp group, tp group), or None when it is not a trainer rank."""
    grid = [list(ranks[i:i + tp]) for i in range(0, len(ranks), tp)]
    timeout = timedelta(seconds=timeout_s)
    fsdp_groups = [dist.new_group([row[j] for row in grid], timeout=timeout) for j in range(tp)]
    tp_groups = [dist.new_group(row, timeout=timeout) for row in grid]
    if rank not in ranks:
        return None
    i = ranks.index(rank)
    return fsdp_groups[i % tp], tp_groups[i // tp]


def parallelize_llama(model: nn.Module, tp_mesh: Any, *, pack: bool = False) -> nn.Module:
    """Shard a Llama or critic in place over a 1-D tensor-parallel mesh, as the model's sharding description
    (`schemas/sharding.py`) says: q/k/v/gate/up colwise, o/down rowwise, the embedding and an untied head
    by vocabulary rows; norms and a critic's value head replicated (a Qwen3's per-head q/k norms, applied to
    each rank's own heads, sum their gradients over tp). Return the adapter whose forward gives the role's
    per-token outputs as plain tensors replicated over tp (packing sequences with `pack`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from graphrl.errors import RunError

    # DTensor logs every multi-step redistribution of a 2-D parameter (gathers for a checkpoint, the
    # gradient norm); they are expected here, one line per rank and tensor.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    tp, dims = tp_mesh.size(), model.dims
    if (why := tp_split_problem(dims, tp, "train")) is not None:
        raise RunError(f"a trained or frozen model cannot be split {tp} ways: {why}", fix="pin a smaller tp for the trainer")
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.num_heads //= tp  # the reshapes see this rank's heads only
        attn.num_kv_heads //= tp
        for norm in (attn.q_norm, attn.k_norm):  # whole on every rank, applied to its own heads
            if norm is not None:
                norm.grad_group = tp_mesh.get_group()
    head = "value" if isinstance(model, LlamaCritic) else "lm"
    plan = {name: _parallel_style(spec, name, isinstance(model.get_submodule(name), Adapted))
            for name, spec, _ in llama_modules(dims, head) if spec.tp is not TpStyle.REPLICATE}
    parallelize_module(model, tp_mesh, plan)
    if isinstance(model, LlamaCritic):
        return CriticForward(model, pack=pack)
    return TensorParallelPolicyForward(model, pack=pack)


def wrap_tensor_parallel_trainer(model: nn.Module, sharding: str, ranks: tuple[int, ...], tp: int,
                                 groups: tuple[Any, Any], device: torch.device, *,
                                 pack: bool = False) -> tuple[nn.Module, str]:
    """The trainable module of a tp > 1 trainer (fsdp x tp; see the module docstring) and its wrapping name.

    Data-parallel ranks always go through `fully_shard` on the fsdp dimension (DDP does not take 2-D
    DTensors): ZeRO-3 for `sharding: fsdp`; for zero2 the gathered weights stay through backward
    (`reshard_after_forward=False`). The capability table does not offer none or zero1 here (their
    replicated state is not what `fully_shard` holds)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    data_parallel = len(ranks) // tp
    grid = torch.tensor(ranks).view(data_parallel, tp)
    mesh = DeviceMesh.from_group(list(groups), device.type, mesh=grid, mesh_dim_names=("fsdp", "tp"))
    adapter = parallelize_llama(model, mesh["tp"], pack=pack)
    if data_parallel == 1:
        return adapter, "tp"
    reshard = sharding == "fsdp"
    for unit in layer_units(model.model.layers, tp=tp):
        fully_shard(unit, mesh=mesh["fsdp"], reshard_after_forward=reshard)
    fully_shard(adapter, mesh=mesh["fsdp"], reshard_after_forward=reshard)
    return adapter, "fsdp2+tp"


def tensor_parallel_infer(model: nn.Module, groups: tuple[Any, Any], ranks: tuple[int, ...], tp: int,
                          device: torch.device, *, pack: bool = False) -> nn.Module:
    """A frozen model of a tensor-parallel trainer's mesh (reference, reward model): sharded over each tp
    row of `ranks` as the trainer is, and its decoder layers over the fsdp dimension (`shard_frozen`);
    the adapter gives its replicated per-token outputs."""
    from torch.distributed.device_mesh import DeviceMesh

    data_parallel = len(ranks) // tp
    grid = torch.tensor(ranks).view(data_parallel, tp)
    mesh = DeviceMesh.from_group(list(groups), device.type, mesh=grid, mesh_dim_names=("fsdp", "tp"))
    adapter = parallelize_llama(model, mesh["tp"], pack=pack)
    if data_parallel > 1:
        shard_frozen(model, mesh["fsdp"])
    return adapter


def shard_frozen(model: nn.Module, mesh: Any) -> None:
    """Shard a frozen model's decoder layers over the data-parallel `mesh` with FSDP2, each layer gathered
    for its own forward and freed after it (`reshard_after_forward=True`, also for layers that are FSDP
    roots: a unit of several sibling layers would have no root to run it). The embedding, final norm and
    head stay whole on every rank: a frozen role's forward reads them outside any one wrapped module (a
    reward model's values go through the model's trunk directly), and the plan charges them whole."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True,
                    shard_placement_fn=_fsdp_placements([layer], mesh.size()))


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` that also takes gradients on several device meshes (an fsdp x tp
    trainer: tp-sharded weights live on the 2-D mesh, norms on its fsdp dimension only): the norm is
    computed per mesh, made whole, and combined. Gradients that are all shards on one 1-D mesh (FSDP2
    with tp 1) are clipped on their local tensors, with one all-reduce of the squared norm: the same
    result without DTensor's dispatch per op (1.8 against 0.4 ms a step of grpo_tiny on 2 ranks). The
    total 2-norm before clipping."""
    from torch.distributed.tensor import DTensor, Shard

    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict[Any, list[Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(_mesh_of(g), []).append(g)
    mesh = next(iter(by_mesh), None)
    if len(by_mesh) == 1 and mesh is not None and mesh.ndim == 1 and all(isinstance(g.placements[0], Shard)
                                                                         for g in grads):
        return _clip_local_shards(grads, max_norm)  # every gradient a shard (no replica, no partial sum)
    if len(by_mesh) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    squares = 0.0
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        squares += float(norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2
    total = squares ** 0.5
    coef = min(max_norm / (total + 1e-6), 1.0)
    for group in by_mesh.values():
        torch._foreach_mul_(group, coef)
    return total


@torch.no_grad()
def _clip_local_shards(grads: list[Tensor], max_norm: float) -> float:
    """Clip DTensor shards of one 1-D mesh in place: each rank's sum of squares over its local shards,
    summed over the mesh, is the square of the whole gradient's norm."""
    local = [g.to_local() for g in grads]
    squares = torch.stack(torch._foreach_norm(local)).double().square().sum()
    dist.all_reduce(squares, group=grads[0].device_mesh.get_group())  # type: ignore[attr-defined]
    total = float(squares.sqrt())
    coef = min(max_norm / (total + 1e-6), 1.0)
    torch._foreach_mul_(local, coef)
    return total


def full_state_dict(model: nn.Module, *, keep: bool = True, to_host: bool = False) -> dict[str, Tensor]:
    """Unsharded weights, gathered tensor by tensor (a collective per tensor over the shard group when
    the model is sharded, so every rank of it calls this). `keep=False`: take part in the gathers but
    keep nothing (a rank that does not write them); `to_host`: move each full tensor to host memory as
    soon as it is gathered, so the device holds one full tensor at a time, never the whole model."""
    out = {}
    for name, tensor in model.state_dict().items():
        full = _full(tensor)
        if keep:
            out[name] = full.to("cpu") if to_host else full
    return out


def full_weights(model: nn.Module, wrapper: nn.Module | None = None) -> Iterator[tuple[str, Tensor]]:
    """(name, whole tensor) of each of `model`'s parameters, for reading only (`wrapper`: the module
    FSDP2 wraps `model` in, when that is not `model` itself). An FSDP2-sharded model is gathered a unit at
    a time by FSDP2's own `unshard` (one all-gather per unit, the next unit's started while this one's
    tensors are read) and resharded after, so no more than two units are whole at once; a
    tensor-parallel DTensor left after that is gathered alone. Every rank of the model's groups calls
    this (the gathers are collectives)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = dict(model.named_parameters())
    units = [m for m in (wrapper if wrapper is not None else model).modules() if isinstance(m, FSDPModule)]
    done: set[str] = set()

    def whole(gathered_only: bool) -> Iterator[tuple[str, Tensor]]:
        for name, p in model.named_parameters():
            if name not in done and not (gathered_only and p is sharded[name]):
                done.add(name)
                yield name, _full(p)

    pending = units[0].unshard(async_op=True) if units else None
    for i, unit in enumerate(units):
        if pending is not None:
            pending.wait()
        pending = units[i + 1].unshard(async_op=True) if i + 1 < len(units) else None
        yield from whole(gathered_only=True)
        unit.reshard()
    yield from whole(gathered_only=False)  # what no unit manages, gathered tensor by tensor


def fsdp_units_of(wrapper: nn.Module) -> list[Any]:
    """The FSDP2 units of a wrapped trainer, root last (empty for DDP or an unwrapped module)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in wrapper.modules() if isinstance(m, FSDPModule)][::-1]


def gather_in_place(wrapper: nn.Module) -> None:
    """Gather an FSDP2 trainer's weights whole on every rank and leave them so: its module's parameters
    are then the whole tensors, which a colocated generator samples from and the next forward finds
    gathered (`generator_reads_trainer`). One all-gather per unit, the next started before this one is
    waited for; a unit gathered already costs nothing, so every rank of the trainer calls this at the
    same points (it is collective where a unit is sharded). The units reshard after the next backward."""
    units = fsdp_units_of(wrapper)
    pending = [unit.unshard(async_op=True) for unit in units]
    for handle in pending:
        if handle is not None:
            handle.wait()


def release_gathered(wrapper: nn.Module) -> None:
    """Free the gathered weights of an FSDP2 trainer's units (local, no collective): its resting state."""
    for unit in fsdp_units_of(wrapper):
        unit.reshard()


def copy_full_weights(dst: nn.Module, src: nn.Module, wrapper: nn.Module | None = None) -> None:
    """`dst`'s weights (whole tensors) := `src`'s, gathered by `full_weights` and copied in place, so no
    full copy of the model exists beside the two modules."""
    target = dict(dst.named_parameters())
    weights, names = weights_for(target, src, wrapper)
    if set(target) != names:
        raise RuntimeError(f"weights differ: {sorted(set(target) ^ names)[:4]}")
    with torch.no_grad():
        for name, full in weights:
            target[name].copy_(full)


def weights_for(target: Iterable[str], src: nn.Module, wrapper: nn.Module | None = None
                ) -> tuple[Iterator[tuple[str, Tensor]], set[str]]:
    """`src`'s whole weights (`full_weights`) as a copy with parameters `target` takes them, and their names: a
    plain copy of a LoRA model (`lora.sync: merged`) takes them with the adapters folded in."""
    names = {name for name, _ in src.named_parameters()}
    weights = full_weights(src, wrapper)
    if any(map(is_adapter, names)) and not any(map(is_adapter, target)):
        return merged_weights(weights, src), {n for n in names if not is_adapter(n)}
    return weights, names


def _full(tensor: Tensor) -> Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()
