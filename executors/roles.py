"""Building the roles a rank holds, from the plan: one builder per role kind, chosen by a table.

A role is a copy of a model's weights for one purpose (`schemas/plan.py:RolePlacement`). Each rank
builds only the roles whose mesh holds it: a trained role wrapped as the plan lays it out (DDP, ZeRO-1,
FSDP2, tp x fsdp) with the optimizer the plan charges; a generation copy (tensor-parallel shards, fp8
block linears, or, colocated and unwrapped, the trainer's own module); a frozen model sharded as the
plan charges it. What kind of head, which learning rate: the plan's bindings say, nothing is inferred.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from graphrl.errors import RunError
from graphrl.schemas.capabilities import generator_reads_trainer
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.job import JobSpec
from graphrl.schemas.plan import Plan, RoleKind, RolePlacement
from graphrl.schemas.program import Generate, Programs

from graphrl.executors import fp8
from graphrl.executors.models.llama import Llama, LlamaCritic
from graphrl.executors.models.lora import adapt
from graphrl.executors.parallel import (build_optimizer, layer_units, shard_frozen, tensor_parallel_infer,
                                        trainer_mesh_groups, wrap_tensor_parallel_trainer, wrap_trainer)
from graphrl.executors.runtime import Runtime, collective_timeout_s
from graphrl.executors.tensor_parallel import TensorParallelGroup, TensorParallelLlama

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RoleState:
    """One role on this rank: its module, its trainable wrapper and optimizer, its weight version."""

    placement: RolePlacement
    module: nn.Module
    wrapped: nn.Module | None = None
    wrapping: str = "local"
    optimizer: torch.optim.Optimizer | None = None
    version: int = 0
    offloaded: set[str] = field(default_factory=set)
    reads: str | None = None
    """A generation copy that samples from this trained role's module (its own weights, none copied)."""


@dataclass
class RoleBuild:
    """What building a rank's roles reads: the plan, this rank's runtime, the roles built so far (a
    colocated generator may share its trainer's module) and the trainer meshes' process groups."""

    plan: Plan
    rt: Runtime
    roles: dict[str, RoleState]
    mesh_groups: dict[str, Any]

    @property
    def programs(self) -> Programs:
        assert self.plan.programs is not None
        return self.plan.programs

    def mesh(self, p: RolePlacement) -> Mesh:
        return self.plan.chosen.mesh(p.mesh)

    def new_module(self, p: RolePlacement, *, adapters: bool = True) -> nn.Module:
        """The role's model as every rank starts it (`initial_module`)."""
        assert self.plan.bindings is not None
        return initial_module(self.plan.job, p.model, critic=self.plan.bindings.roles[p.role].head == "value",
                              device=self.rt.device, adapters=adapters)

    def tensor_parallel_group(self, p: RolePlacement) -> TensorParallelGroup:
        """This rank's place in the group its Generate instructions name (one generator replica)."""
        rank = self.rt.rank
        name = next((ins.group for ins in self.programs.rank_stream(rank)
                     if isinstance(ins, Generate) and ins.role == p.role), None)
        ranks = self.programs.groups.get(name) if name is not None else None
        if ranks is None or len(ranks) != p.tp or rank not in ranks:
            raise RunError(f"rank {rank}: role {p.role} has tp={p.tp}, but its Generate instructions name "
                           f"group {name!r} with ranks {ranks}", fix="recompile the plan")
        return TensorParallelGroup(list(ranks).index(rank), p.tp, self.rt.group(name))


def initial_module(job: JobSpec, model: str, *, critic: bool = False, device: torch.device | str = "cpu",
                   adapters: bool = True) -> nn.Module:
    """Model `model` of `job` as a run starts it: initialised as every rank initialises it (seeded by the
    model it starts from), with the job's checkpoint loaded when it names one, and with its LoRA adapters
    (seeded too, so every copy draws the same) when it declares them and `adapters` is on."""
    spec = job.models[model]
    torch.manual_seed(job.run.seed * 7919 + sum(map(ord, spec.init_from or model)))
    dims = spec.resolved_dims()
    module = (LlamaCritic(dims) if critic else Llama(dims)).to(device=device, dtype=DTYPES[spec.dtype])
    if spec.checkpoint is not None:
        from graphrl.models.checkpoints import load_state

        _, state = load_state(spec.checkpoint)
        module.load_state_dict(state, strict=not critic)
    if spec.lora is not None and adapters:
        adapt(module, dims, spec.lora, seed=job.run.seed * 7919 + 1 + sum(map(ord, model)))
    return module


def build_train(b: RoleBuild, p: RolePlacement) -> RoleState:
    """A trained role: wrapped as the plan lays it out, with the optimizer the plan charges (float32
    master weights for a bf16 model, ZeRO-1's share of the state)."""
    assert b.plan.bindings is not None
    module = b.new_module(p)
    state = RoleState(p, module)
    a = b.plan.job.algorithm
    if p.tp > 1:
        state.wrapped, state.wrapping = wrap_tensor_parallel_trainer(
            module, p.sharding, tuple(b.mesh(p).devices), p.tp, b.mesh_groups[p.mesh], b.rt.device,
            pack=a.pack_sequences)
    else:
        state.wrapped, state.wrapping = wrap_trainer(module, p.sharding, b.rt.group("trainer"), b.rt.device,
                                                     pack=a.pack_sequences)
    state.optimizer = build_optimizer(module, p.sharding, state.wrapping, b.rt.group("trainer"),
                                      lr=b.plan.bindings.roles[p.role].lr or a.lr, betas=a.betas,
                                      weight_decay=a.weight_decay)
    return state


def build_generate(b: RoleBuild, p: RolePlacement) -> RoleState:
    """A generation copy: colocated with a trainer that holds its weights whole through each sync
    (`generator_reads_trainer`: replicated, or gathered by FSDP2 at the sync and kept through the next
    backward), the trainer's own module, nothing copied; otherwise its own, cut into tensor-parallel
    shards and stored in fp8 as the plan says."""
    trainer = b.roles.get(p.model)
    if trainer is not None and trainer.placement.kind == "train" and generator_reads_trainer(
            colocated=b.plan.chosen.strategy == "colocated", gen_tp=p.tp, precision=p.precision,
            train_tp=trainer.placement.tp, sharding=trainer.placement.sharding,
            one_unit=not layer_units(trainer.module.model.layers, tp=1)):
        return RoleState(p, trainer.module, reads=trainer.placement.role)
    lora = b.plan.job.models[p.model].lora
    lora = lora if lora is not None and not lora.merged else None  # merged syncs fill a plain model
    module = b.new_module(p, adapters=lora is not None)
    if p.tp > 1:
        module = TensorParallelLlama.from_full(module, b.tensor_parallel_group(p), lora=lora)
    if p.precision == "fp8":
        if lora is not None:
            raise RunError(f"role {p.role}: an fp8 generator cannot hold LoRA adapters (it quantizes the linears "
                           "they wrap)", fix="use precision bf16, or lora.sync: merged")
        module = fp8.quantize_generator(module)
    module.requires_grad_(False)
    return RoleState(p, module)


def build_infer(b: RoleBuild, p: RolePlacement) -> RoleState:
    """A frozen model on the trainer's mesh, sharded as the plan charges it: over tp as the trainer is,
    and its layers over the data-parallel ranks (`sharding: fsdp`)."""
    module = b.new_module(p)
    module.requires_grad_(False)
    state = RoleState(p, module)
    if p.tp > 1:
        state.wrapped = tensor_parallel_infer(module, b.mesh_groups[p.mesh], tuple(b.mesh(p).devices), p.tp,
                                              b.rt.device, pack=b.plan.job.algorithm.pack_sequences)
    elif p.sharding == "fsdp" and b.rt.group("trainer") is not None:
        from torch.distributed.device_mesh import DeviceMesh

        shard_frozen(module, DeviceMesh.from_group(b.rt.group("trainer"), b.rt.device.type))
    return state


BUILDERS: dict[RoleKind, Callable[[RoleBuild, RolePlacement], RoleState]] = {
    "train": build_train,
    "generate": build_generate,
    "infer": build_infer,
}
"""Role kind -> how a rank builds a role of that kind."""


def build_roles(plan: Plan, rt: Runtime) -> tuple[dict[str, RoleState], dict[str, Any]]:
    """The roles placed on this rank, in plan order (a trainer before its colocated generator), and the
    (fsdp, tp) process groups of every tensor-parallel trainer mesh."""
    b = RoleBuild(plan, rt, {}, {})
    # Creating a group is collective over the whole job: every rank makes them all, in plan order,
    # before building its roles (None off the mesh).
    for p in plan.chosen.placements:
        if p.kind != "generate" and p.tp > 1 and p.pp == 1 and p.mesh not in b.mesh_groups:
            b.mesh_groups[p.mesh] = trainer_mesh_groups(tuple(b.mesh(p).devices), p.tp, rt.rank, collective_timeout_s())
    for p in plan.chosen.placements:
        if rt.rank not in b.mesh(p).devices:
            continue
        if p.pp > 1:
            raise RunError(f"role {p.role} ({p.kind}): pipeline parallelism (pp={p.pp}) is not supported by this "
                           "executor", fix="pin pp: 1 for this role")
        b.roles[p.role] = BUILDERS[p.kind](b, p)
    return b.roles, b.mesh_groups


def role_group(role: RoleState, rt: Runtime) -> Any:
    """The process group over every rank that holds `role` (its mesh), or None on one rank."""
    if role.placement.tp > 1 or role.wrapping in ("ddp", "fsdp2"):
        return rt.group("trainer")
    return None


__all__ = ["BUILDERS", "DTYPES", "RoleBuild", "RoleState", "build_roles", "initial_module", "role_group"]
