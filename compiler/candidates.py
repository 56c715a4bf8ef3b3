"""Placement candidates: the search problem of one job on one cluster (`Problem`, over the `SearchSpace` the
enumeration reads), the trainer and generator halves a layout combines (`TrainCfg`, `GenCfg`), their
enumeration within the pins and the capability table, the checks of the pins against that enumeration
(`check_pins`, the one place they are checked: typecheck and the search both call it), and a full
candidate's evaluation record (`Evaluated`)."""


from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from graphrl.errors import PlacementError
from graphrl.engine_support import ENGINE_PRECISIONS, VLLM_INSTALL, engine_available
from graphrl.ir import JobGraph
from graphrl.schemas.capabilities import Target, hardware_has_fp8, precision_refusal, train_layout_refusal
from graphrl.schemas.cluster import ClusterSpec
from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.job import (PRECISIONS, SHARDINGS, Engine, PlacementHints, RoleHint, ScheduleMode, Sharding,
                                 parse_device_range)
from graphrl.schemas.mesh import Mesh

from graphrl.compiler.cost import fp8_dequantizes, group_spans_nodes
from graphrl.compiler.hardware import resolve_hardware
from graphrl.compiler.roles import JobShape, Role, Workload, derive_roles, derive_workload
from graphrl.compiler.layouts import device_splits, generate_shapes, tp_split_problem, train_shapes


GB = 1e9
# Bytes of one response in flight between meshes: prompt and response ids (int64), masks (bool),
# behaviour log-probs (fp32) and, per response, a reward and an advantage per token (fp32).
# The search meets the most sharded training state first (the order its ties and its refusals come in).
SHARDING_SEARCH_ORDER: tuple[Sharding, ...] = SHARDINGS[::-1]
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
# The search space and the search problem: everything fixed for one job and cluster


@dataclass(frozen=True)
class SearchSpace:
    """What the enumeration reads: the job's roles, the cluster and its hardware, the user's pins and what
    the layouts are for. The pin checks enumerate over it too, so they accept exactly what the search can
    lay out."""

    roles: tuple[Role, ...]
    cluster: ClusterSpec
    hw: HardwareSpec
    hints: PlacementHints
    target: Target
    """`run`: only layouts the executors run (`graphrl.schemas.capabilities`); `preview`: also a
    preview-only choice the user pinned (a pp > 1)."""
    mini_batch: int
    """`algorithm.mini_batch_size`: every data-parallel rank holds rows of every mini-batch, so a trainer
    has at most this many data-parallel ranks (0: no limit)."""

    @property
    def num_devices(self) -> int:
        return self.cluster.num_devices

    @property
    def per_node(self) -> int:
        return self.cluster.devices_per_node

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

    def engine_of(self, role: str) -> Engine:
        """The engine a generation role runs on: its pin, else the native sampler."""
        return self.hint(role).engine or "native"


@dataclass(frozen=True)
class Problem(SearchSpace):
    """The search problem: the search space and what each candidate is costed by (the workload of one
    step and the schedule's mode)."""

    workload: Workload
    mode: ScheduleMode

    @property
    def usable(self) -> float:
        return self.hw.usable_memory_bytes

    @property
    def shape(self) -> JobShape:
        """What the passes after placement may read of the problem."""
        return JobShape(self.roles, self.workload, self.num_devices, self.per_node, self.hw)

    def spans(self, first: int, n: int) -> bool:
        return group_spans_nodes(range(first, first + n), self.per_node)

    def tp_group_spans(self, tp: int) -> bool:
        return tp > self.per_node


# ------------------------------------------------------------------------------------------------
# Enumeration


def strategies(p: SearchSpace) -> list[Strategy]:
    """The families of layouts the search ranks: both, or the one that `strategy` or a colocate group of the
    policy and its generator forces."""
    hints = p.hints
    gen = p.generator
    forced: Strategy | None = None if hints.strategy == "auto" else hints.strategy  # type: ignore[assignment]
    for group in hints.colocate:
        if gen is not None and gen.name in group and p.policy.name in group:
            if forced == "disaggregated":
                raise PlacementError(
                    f"colocate group {group} puts {gen.name!r} with {p.policy.name!r}, but strategy is disaggregated",
                    path=("placement", "colocate"), fix="drop the group or set strategy: colocated")
            forced = "colocated"
    if gen is None:
        return ["colocated"]
    return [forced] if forced else ["colocated", "disaggregated"]


def train_cfgs(p: SearchSpace, first: int, n: int) -> list[TrainCfg]:
    """Trainer layouts over devices [first, first+n) that respect the policy's pins and that the executors
    run (the capability table); for a preview, a preview-only choice the user pinned is laid out too."""
    role = p.policy
    hint = p.hint(role.name)
    shardings = [hint.sharding] if hint.sharding else list(SHARDING_SEARCH_ORDER)
    offloads = [hint.offload] if hint.offload is not None else [False, True]
    out = []
    for tp, pp, dp, fsdp in train_shapes(role, hint, n, p.per_node):
        if p.mini_batch and dp * fsdp > p.mini_batch:
            continue  # a data-parallel rank would hold no row of a mini-batch
        for sharding in shardings:
            refusal = train_layout_refusal(dp=dp, fsdp=fsdp, tp=tp, pp=pp, sharding=sharding)
            if refusal is not None and not (p.target == "preview" and refusal.field == "pp" and hint.pp == pp):
                continue
            for recompute in (False, True):
                for offload in offloads:
                    out.append(TrainCfg(first, n, dp, fsdp, tp, pp, sharding, recompute, offload))
    return out


def gen_cfgs(p: SearchSpace, first: int, n: int) -> list[GenCfg]:
    role = p.generator
    assert role is not None
    hint = p.hint(role.name)
    # fp8 runs where the hardware has it (the capability table); the search offers it on its own where it
    # runs on fp8 matmul units, and where it is dequantized at use (CPU) it only saves memory, so it is
    # run when pinned.
    fp8 = hardware_has_fp8(p.hw)
    offered = list(PRECISIONS) if fp8 and not fp8_dequantizes(p.hw) else ["bf16"]
    precisions = [prec for prec in ([hint.precision] if hint.precision else offered)
                  if precision_refusal("generate", prec, hardware_fp8=fp8, moe=role.dims.is_moe,
                                       lora=role.lora is not None) is None
                  and prec in ENGINE_PRECISIONS[p.engine_of(role.name)]]
    return [GenCfg(first, n, tp, prec) for tp in generate_shapes(role, hint, n, p.per_node) for prec in precisions]


def splits(p: SearchSpace) -> list[tuple[int, int, int, int]]:
    """(gen_first, gen_n, train_first, train_n) device splits for disaggregated layouts."""
    gen_hint = p.hint(p.generator.name) if p.generator else RoleHint()
    return device_splits(p.num_devices, p.per_node, gen_hint.devices, p.hint(p.policy.name).devices)


def mesh_pairs(p: SearchSpace) -> list[tuple[tuple[int, int], tuple[int, int] | None]]:
    """((first, n) of the trainer, (first, n) of the generator or None) of every pair of meshes the search
    lays out: the whole cluster for both when colocated, and each device split when disaggregated."""
    n, families = p.num_devices, strategies(p)
    pairs: list[tuple[tuple[int, int], tuple[int, int] | None]] = []
    if "colocated" in families:
        pairs.append(((0, n), (0, n) if p.generator else None))
    if "disaggregated" in families:
        pairs += [((t_first, t_n), (g_first, g_n)) for g_first, g_n, t_first, t_n in splits(p)]
    return pairs


# ------------------------------------------------------------------------------------------------
# Pins: accepted exactly when the enumeration above can lay them out; each refusal names its field

# Which pins each kind of role's layout reads: a trainer mesh is dp x fsdp x tp x pp with a sharding and
# optional offload; a generator is dp replicas of tp shards in some precision, on an engine.
_AXES = {"train": ("dp", "fsdp", "tp", "pp"), "generate": ("dp", "tp")}
_USED = {"train": {"devices", "dp", "fsdp", "tp", "pp", "sharding", "offload"},
         "generate": {"devices", "dp", "tp", "precision", "engine"}}


def check_pins(graph: JobGraph, cluster: ClusterSpec | None, target: Target = "preview",
               hw: HardwareSpec | None = None) -> tuple[str, ...]:
    """Refuse every pin under `placement` the search would not lay out, naming its field; return warnings
    about pins no layout reads. A pin is checked against the model (tp splits its heads, pp its layers),
    against what the executors run for `target` (`graphrl.schemas.capabilities`: a ZeRO stage on one
    data-parallel rank, an fp8 trainer and, for `run`, a pp > 1; `compile` still lays out a pinned pp for
    the preview) and, once the cluster is known (`compile`, or `validate` of a job that names its cluster),
    against the meshes this module enumerates on it and its hardware (`hw`, or the cluster's, resolved as
    `compile` does: fp8 generation needs fp8 hardware). Typecheck (`validate` and the first pass of
    `compile`) and the search (`make_problem`) both call it."""
    job = graph.job
    roles = {r.name: r for r in derive_roles(graph)}
    for i, group in enumerate(job.placement.colocate):
        for name in group:
            if name not in roles:
                raise PlacementError(f"unknown role {name!r} in a colocate group", path=("placement", "colocate", i),
                                     fix=f"roles of this job: {', '.join(roles)}")
    # The search lays out the first trained model's mesh (every train and frozen role shares it) and the
    # first generator; a pin on any other role is not read.
    policy = next((r for r in roles.values() if r.kind == "train"), None)
    generator = next((r for r in roles.values() if r.kind == "generate"), None)
    space = None
    if cluster is not None and policy is not None:
        hw = hw if hw is not None else resolve_hardware(cluster)
        space = SearchSpace(tuple(roles.values()), cluster, hw, job.placement, target,
                            job.algorithm.mini_batch_size)
    warnings: list[str] = []
    for key, hint in job.placement.roles.items():
        path = ("placement", "roles", key)
        role = roles.get(key)
        if role is None:
            raise PlacementError(f"unknown role {key!r}", path=path,
                                 fix=f"roles of this job: {', '.join(roles)} (a model's training copy is named "
                                     "after the model, its generation copy '<model>/generate')")
        _check_generation_only_pins(role, hint, path)
        pinned = {f for f, v in hint.model_dump().items() if v is not None}
        if policy is None or role not in (policy, generator):
            if pinned:
                owner = policy.name if policy is not None else "the trainer"
                warnings.append(f"{'.'.join(path)}: ignored: {key!r} runs on the trainer's mesh in the layout "
                                f"of {owner!r}; pin {owner!r} instead")
            continue
        unused = sorted(pinned - _USED[role.kind])
        if unused:
            warnings.append(f"{'.'.join(path)}: {', '.join(unused)} ignored: a {role.kind} role's layout has no "
                            f"{'/'.join(unused)}")
        if hint.devices is not None and job.placement.strategy == "colocated":
            warnings.append(f"{'.'.join(path)}.devices: ignored: a colocated layout puts every role on every device")
        _check_pin_values(role, hint, path, target, space.hw if space is not None else None)
        if space is not None:
            _check_pin_meshes(space, role, hint, path)
    if space is not None and generator is not None:
        _check_common_split(space)
    return tuple(warnings)


def _check_generation_only_pins(role: Role, hint: RoleHint, path: tuple[str, ...]) -> None:
    """A precision and an engine are choices of a generation copy."""
    if hint.precision is not None and role.kind != "generate":
        refusal = precision_refusal(role.kind, hint.precision, hardware_fp8=True)
        raise PlacementError(f"only generation copies have a precision{f' ({refusal.why})' if refusal else ''}",
                             path=path + ("precision",), fix=f"pin precision on '{role.model}/generate'")
    if hint.engine is not None and role.kind != "generate":
        raise PlacementError(f"only generation copies run on an engine; {role.name!r} is a {role.kind} role",
                             path=path + ("engine",), fix=f"pin engine on '{role.model}/generate'")


def _check_pin_values(role: Role, hint: RoleHint, path: tuple[str, ...], target: Target,
                      hw: HardwareSpec | None) -> None:
    """Each pinned value is one the enumeration takes for this role whatever the mesh: an engine that holds
    the other pins (installed here, for `run`: a preview of a GPU cluster is made anywhere), a tp that splits the model, a pp within its layers (and none for `run`), a
    precision the hardware computes in (once the hardware is known)."""
    if hint.engine is not None:
        engine = hint.engine
        if engine == "vllm" and role.dims.is_moe:
            raise PlacementError(f"engine 'vllm' does not run {role.model!r}, a mixture of experts, here: a reload of "
                                 "new weights into vLLM's experts is not verified (its CPU build's reload leaves them "
                                 "wrong)", path=path + ("engine",), fix="use engine: native (it shares the experts "
                                 "out over its tp group and records the routes routing replay needs)")
        if target == "run" and not engine_available(engine):
            raise PlacementError(f"engine {engine!r} is not installed here (the vllm package cannot be imported)",
                                 path=path + ("engine",), fix=f"{VLLM_INSTALL}; or use engine: native")
        if hint.precision is not None and hint.precision not in ENGINE_PRECISIONS[engine]:
            raise PlacementError(f"engine {engine!r} does not run precision {hint.precision!r}",
                                 path=path + ("precision",),
                                 fix=f"use precision: {' or '.join(ENGINE_PRECISIONS[engine])}, or engine: native")
    if role.kind == "train" and hint.pp is not None and target == "run" and \
            (refusal := train_layout_refusal(dp=1, fsdp=1, tp=1, pp=hint.pp, sharding="none")) is not None:
        raise PlacementError(refusal.why, path=path + ("pp",), fix=refusal.fix)
    if hint.tp is not None and (why := tp_split_problem(role.dims, hint.tp, role.kind)) is not None:
        valid = [t for t in range(1, role.dims.num_heads + 1) if tp_split_problem(role.dims, t, role.kind) is None]
        raise PlacementError(f"{why} (model {role.model!r})", path=path + ("tp",),
                             fix=f"use a tp that splits this model: {', '.join(map(str, valid))}")
    if role.kind == "train" and hint.pp is not None and hint.pp > role.dims.num_layers:
        raise PlacementError(f"pp {hint.pp} is larger than the {role.dims.num_layers} layers of {role.model}",
                             path=path + ("pp",), fix=f"use pp <= {role.dims.num_layers}")
    if hint.precision is not None and hw is not None and \
            (refusal := precision_refusal(role.kind, hint.precision, hardware_fp8=hardware_has_fp8(hw),
                                          moe=role.dims.is_moe, lora=role.lora is not None)) is not None:
        raise PlacementError(f"{refusal.why} (hardware {hw.name})", path=path + ("precision",), fix=refusal.fix)


def _check_pin_meshes(p: SearchSpace, role: Role, hint: RoleHint, path: tuple[str, ...]) -> None:
    """The role's pinned range lies in the cluster, and the enumeration lays out the role on some mesh the
    search gives it; if on none, the refusal names the pin that leaves it nothing."""
    n = p.num_devices
    if hint.devices is not None and parse_device_range(hint.devices)[1] > n:
        raise PlacementError(f"device range {hint.devices!r} is outside the cluster's {n} devices (0-{n - 1})",
                             path=path + ("devices",), fix="pin a range inside the cluster")
    pairs = mesh_pairs(p)
    meshes = [t for t, _ in pairs] if role is p.policy else [g for _, g in pairs if g is not None]
    if not meshes:
        raise PlacementError(f"the device ranges leave {role.name!r} no devices", path=path + ("devices",),
                             fix="pin ranges that split the cluster between the trainer and the generator")
    cfgs = train_cfgs if role is p.policy else gen_cfgs
    if any(cfgs(p, first, size) for first, size in meshes):
        return
    sizes = {size for _, size in meshes}
    where = _where(sizes, hint.devices, strategies(p) == ["colocated"])
    axes = {a: getattr(hint, a) for a in _AXES[role.kind] if getattr(hint, a) is not None}
    for axis, size in axes.items():
        if size > max(sizes):
            raise PlacementError(f"{axis} {size} needs {size} devices; the mesh of {role.name!r} has {where}",
                                 path=path + (axis,), fix=f"pin {axis} <= {max(sizes)}, or use a larger cluster")
    product = math.prod(axes.values())
    spelled = " x ".join(f"{a} {v}" for a, v in axes.items())
    if not any(s % product == 0 for s in sizes):
        if len(axes) == 1:
            (axis,) = axes
            raise PlacementError(f"{axis} {product} does not divide {where}", path=path + (axis,),
                                 fix="pin a size that divides the mesh's devices")
        raise PlacementError(f"{spelled} = {_devices(product)} do not divide {where}", path=path,
                             fix="pin axes whose product divides the mesh's devices")
    if len(axes) == len(_AXES[role.kind]) and product not in sizes:
        raise PlacementError(f"{spelled} = {_devices(product)}, but the mesh of {role.name!r} has {where}", path=path,
                             fix=f"make the product of {', '.join(_AXES[role.kind])} equal the mesh's devices, "
                                 "or leave one axis unpinned")
    if role.kind == "train" and p.mini_batch:
        shapes = [(dp, fsdp) for s in sorted(sizes) for _, _, dp, fsdp in train_shapes(role, hint, s, p.per_node)]
        if shapes and all(dp * fsdp > p.mini_batch for dp, fsdp in shapes):
            dp, fsdp = shapes[0]
            raise PlacementError(
                f"the pins give {dp * fsdp} data-parallel ranks, more than mini_batch_size {p.mini_batch}: a rank "
                "would hold no response of a mini-batch", path=("algorithm", "mini_batch_size"),
                fix=f"use a mini_batch_size of at least {dp * fsdp}, or pin fewer data-parallel ranks")
    if role.kind == "train":  # trainer meshes of the pinned shape exist, and the capability table refuses them
        shardings = [hint.sharding] if hint.sharding else SHARDING_SEARCH_ORDER
        refusals = [r for s in sorted(sizes) for tp, pp, dp, fsdp in train_shapes(role, hint, s, p.per_node)
                    for sharding in shardings
                    if (r := train_layout_refusal(dp=dp, fsdp=fsdp, tp=tp, pp=pp, sharding=sharding)) is not None]
        if refusals:
            refusal = refusals[0]
            field_ = refusal.field if getattr(hint, refusal.field, None) is not None else "sharding"
            raise PlacementError(f"{refusal.why}; the executors do not run it on {where}", path=path + (field_,),
                                 fix=refusal.fix)
    raise PlacementError(f"no {' x '.join(_AXES[role.kind])} layout of {where} holds these pins", path=path,
                         fix="loosen one of the pinned axes")


def _check_common_split(p: SearchSpace) -> None:
    """Each role's pins hold on some mesh of their own; both must hold on the same pair of meshes."""
    generator = p.generator
    assert generator is not None
    pairs = [(t, g) for t, g in mesh_pairs(p) if g is not None]
    if any(train_cfgs(p, *t) and gen_cfgs(p, *g) for t, g in pairs):
        return
    spelled = ", ".join(f"both on {t[1]}" if t == g else f"{t[1]}+{g[1]}" for t, g in pairs)
    raise PlacementError(f"the pins of {p.policy.name!r} and {generator.name!r} fit no common split of the "
                         f"{p.num_devices} devices (trainer+generator: {spelled})", path=("placement", "roles"),
                         fix="loosen the pins of one of the two roles")


def _where(sizes: set[int], own_range: str | None, colocated_only: bool) -> str:
    if colocated_only:
        return f"the {max(sizes)} devices of the cluster (a colocated layout uses them all)"
    if own_range is not None and len(sizes) == 1:
        return f"the {_devices(max(sizes))} of its range {own_range!r}"
    return f"{' or '.join(map(str, sorted(sizes)))} devices"


def _devices(n: int) -> str:
    return f"{n} device" if n == 1 else f"{n} devices"


def make_problem(graph: JobGraph, cluster: ClusterSpec, hw: HardwareSpec, target: Target = "preview") -> Problem:
    roles = derive_roles(graph)
    if not any(r.kind == "train" for r in roles):
        raise PlacementError("the job trains no model", path=("nodes",), fix="add a train node")
    check_pins(graph, cluster, target, hw)
    # The calibrated figures of this job's ranks: their threads, the trained models' width, a rank's tokens.
    workload = derive_workload(graph)
    hw = hw.for_rank(graph.job.run.threads_per_rank, max(r.dims.hidden_size for r in roles if r.kind == "train"),
                     workload.tokens / cluster.num_devices)
    return Problem(roles=tuple(roles), cluster=cluster, hw=hw, hints=graph.job.placement, target=target,
                   mini_batch=workload.mini_batch, workload=workload, mode=graph.job.schedule.mode)
