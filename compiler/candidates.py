"""Placement candidates: the search problem of one job on one cluster (`Problem`), the trainer and generator
halves a layout combines (`TrainCfg`, `GenCfg`), their enumeration within the pins and the capability
table, and a full candidate's evaluation record (`Evaluated`)."""


from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from graphrl.errors import PlacementError
from graphrl.engine_support import ENGINE_PRECISIONS
from graphrl.ir import JobGraph
from graphrl.schemas.capabilities import Target, hardware_has_fp8, precision_refusal, train_layout_refusal
from graphrl.schemas.cluster import ClusterSpec
from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.job import PlacementHints, RoleHint, parse_device_range
from graphrl.schemas.mesh import Mesh

from graphrl.compiler import cost, timing
from graphrl.compiler.roles import JobShape, Role, Workload, derive_roles, derive_workload
from graphrl.compiler.layouts import device_splits, generate_shapes, tp_split_problem, train_shapes


GB = 1e9
# Bytes of one response in flight between meshes: prompt and response ids (int64), masks (bool),
# behaviour log-probs (fp32) and, per response, a reward and an advantage per token (fp32).
SHARDINGS: tuple[str, ...] = ("fsdp", "zero2", "zero1", "none")
Strategy = Literal["colocated", "disaggregated"]


# ------------------------------------------------------------------------------------------------
# Candidate halves


@dataclass(frozen=True)
class TrainCfg:
    """A candidate trainer: its mesh's shape and the training choices made on it. Every train role (and
    every frozen role beside it) uses that mesh."""

    first: int
    n: int
    dp: int
    fsdp: int
    tp: int
    pp: int
    sharding: str
    recompute: bool
    offload: bool  # offload idle roles' optimizer state / frozen weights to host

    @property
    def label(self) -> str:
        axes = "x".join(f"{k}{v}" for k, v in (("dp", self.dp), ("fsdp", self.fsdp), ("tp", self.tp), ("pp", self.pp)) if v > 1) or "single"
        return f"train[{axes} {self.sharding}{' rc' if self.recompute else ''}{' off' if self.offload else ''}]"

    def mesh(self, name: str) -> Mesh:
        return Mesh.contiguous([("dp", self.dp), ("fsdp", self.fsdp), ("tp", self.tp), ("pp", self.pp)], self.first,
                               name=name)


@dataclass(frozen=True)
class GenCfg:
    """A candidate generator: replicas of `tp` shards over `n` devices from `first`, at a precision."""

    first: int
    n: int
    tp: int
    precision: str

    @property
    def dp(self) -> int:
        return self.n // self.tp

    @property
    def label(self) -> str:
        return f"gen[tp{self.tp}x dp{self.dp} {self.precision}]"

    def mesh(self, name: str) -> Mesh:
        return Mesh.contiguous([("dp", self.dp), ("tp", self.tp)], self.first, name=name)


@dataclass
class Evaluated:
    """A full candidate with its verdict; `fits` False carries the reason and the overflow."""

    strategy: Strategy
    train: TrainCfg
    gen: GenCfg | None
    fits: bool
    step_time_s: float = math.inf
    phases: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    overflow: float = 0.0  # needed / available on the worst device (> 1 when it does not fit)
    worst_role: str | None = None
    needed_bytes: float = 0.0
    available_bytes: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.strategy} {self.train.label}" + (f" {self.gen.label}" if self.gen else "")

    def key(self) -> tuple[float, str]:
        return (self.step_time_s, self.label)


# ------------------------------------------------------------------------------------------------
# The search context: everything fixed for one job and cluster


@dataclass(frozen=True)
class Problem:
    roles: tuple[Role, ...]
    workload: Workload
    cluster: ClusterSpec
    hw: HardwareSpec
    hints: PlacementHints
    mode: Literal["sync", "async"]
    target: Target = "preview"
    """`run`: only layouts the executors run (`graphrl.schemas.capabilities`); `preview`: also a
    preview-only choice the user pinned (a pp > 1)."""

    @property
    def num_devices(self) -> int:
        return self.cluster.num_devices

    @property
    def per_node(self) -> int:
        return self.cluster.devices_per_node

    @property
    def usable(self) -> float:
        return self.hw.usable_memory_bytes

    def roles_of(self, *kinds: str) -> list[Role]:
        return [r for r in self.roles if r.kind in kinds]

    @property
    def generator(self) -> Role | None:
        gens = self.roles_of("generate")
        return gens[0] if gens else None

    @property
    def policy(self) -> Role:
        return self.roles_of("train")[0]

    def hint(self, role: str) -> RoleHint:
        return self.hints.roles.get(role, RoleHint())

    @property
    def shape(self) -> JobShape:
        """What the passes after placement may read of the problem."""
        return JobShape(self.roles, self.workload, self.num_devices, self.per_node, self.hw)

    def spans(self, first: int, n: int) -> bool:
        return timing.group_spans_nodes(range(first, first + n), self.per_node)

    def tp_group_spans(self, tp: int) -> bool:
        return tp > self.per_node


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_ok(role: Role, tp: int) -> bool:
    return tp_split_problem(role.dims, tp, role.kind) is None


# ------------------------------------------------------------------------------------------------
# Enumeration


def train_cfgs(p: Problem, first: int, n: int) -> list[TrainCfg]:
    """Trainer layouts over devices [first, first+n) that respect the policy's pins and that the executors
    run (the capability table); for a preview, a preview-only choice the user pinned is laid out too."""
    role = p.policy
    hint = p.hint(role.name)
    shardings = [hint.sharding] if hint.sharding else list(SHARDINGS)
    offloads = [hint.offload] if hint.offload is not None else [False, True]
    out = []
    for tp, pp, dp, fsdp in train_shapes(role, hint, n, p.per_node):
        for sharding in shardings:
            refusal = train_layout_refusal(dp=dp, fsdp=fsdp, tp=tp, pp=pp, sharding=sharding)
            if refusal is not None and not (p.target == "preview" and refusal.field == "pp" and hint.pp == pp):
                continue
            for recompute in (False, True):
                for offload in offloads:
                    out.append(TrainCfg(first, n, dp, fsdp, tp, pp, sharding, recompute, offload))
    return out


def gen_cfgs(p: Problem, first: int, n: int) -> list[GenCfg]:
    role = p.generator
    assert role is not None
    hint = p.hint(role.name)
    # fp8 runs where the hardware has it (the capability table); the search offers it on its own where it
    # runs on fp8 matmul units, and where it is dequantized at use (CPU) it only saves memory, so it is
    # run when pinned.
    fp8 = hardware_has_fp8(p.hw)
    offered = ["bf16", "fp8"] if fp8 and not cost.fp8_dequantizes(p.hw) else ["bf16"]
    precisions = [prec for prec in ([hint.precision] if hint.precision else offered)
                  if precision_refusal("generate", prec, hardware_fp8=fp8) is None
                  and prec in ENGINE_PRECISIONS[hint.engine or "native"]]
    return [GenCfg(first, n, tp, prec) for tp in generate_shapes(role, hint, n, p.per_node) for prec in precisions]


def splits(p: Problem) -> list[tuple[int, int, int, int]]:
    """(gen_first, gen_n, train_first, train_n) device splits for disaggregated layouts."""
    gen_hint = p.hint(p.generator.name) if p.generator else RoleHint()
    return device_splits(p.num_devices, p.per_node, gen_hint.devices, p.hint(p.policy.name).devices)


# ------------------------------------------------------------------------------------------------
# Pins: checked up front, each error names its field


def check_pins(p: Problem) -> None:
    names = {r.name: r for r in p.roles}
    for key, hint in p.hints.roles.items():
        path = ("placement", "roles", key)
        role = names.get(key)
        if role is None:
            raise PlacementError(f"unknown role {key!r}", path=path,
                                 fix=f"use one of the roles: {', '.join(names)}")
        if hint.tp and not _tp_ok(role, hint.tp):
            raise PlacementError(
                f"tp {hint.tp} does not divide the {role.dims.num_heads} attention heads / "
                f"{role.dims.num_kv_heads} KV heads of {role.model}", path=path + ("tp",),
                fix="use a tp that divides the number of heads (1, 2, 4, 8 ...)")
        if hint.pp and hint.pp > role.dims.num_layers:
            raise PlacementError(f"pp {hint.pp} is larger than the {role.dims.num_layers} layers of {role.model}",
                                 path=path + ("pp",), fix=f"use pp <= {role.dims.num_layers}")
        if hint.devices:
            first, stop = parse_device_range(hint.devices)
            if stop > p.num_devices:
                raise PlacementError(
                    f"device range {hint.devices!r} is outside the cluster's {p.num_devices} devices "
                    f"(0-{p.num_devices - 1})", path=path + ("devices",), fix="pin a range inside the cluster")
        if hint.precision is not None and (refusal := precision_refusal(
                role.kind, hint.precision, hardware_fp8=hardware_has_fp8(p.hw))) is not None:
            raise PlacementError(f"{refusal.why} (hardware {p.hw.name})", path=path + ("precision",), fix=refusal.fix)
    for i, group in enumerate(p.hints.colocate):
        for name in group:
            if name not in names:
                raise PlacementError(f"unknown role {name!r} in colocate group", path=("placement", "colocate", i),
                                     fix=f"use roles: {', '.join(names)}")


def make_problem(graph: JobGraph, cluster: ClusterSpec, hw: HardwareSpec, target: Target = "preview") -> Problem:
    roles = derive_roles(graph)
    if not any(r.kind == "train" for r in roles):
        raise PlacementError("the job trains no model", path=("nodes",), fix="add a train node")
    # The calibrated figures of this job's ranks: their threads, the trained models' width.
    hw = hw.for_rank(graph.job.run.threads_per_rank, max(r.dims.hidden_size for r in roles if r.kind == "train"))
    p = Problem(tuple(roles), derive_workload(graph), cluster, hw, graph.job.placement, graph.job.schedule.mode,
                target)
    check_pins(p)
    return p
