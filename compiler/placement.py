"""Placement search: where every role lives, in what layout, and whether it fits.

Two families of layouts are enumerated:

- **colocated** (the layout of DeepSpeed-Chat-like systems, and LlamaRL's colocated mode): every role on
  every device. The trainer is sharded over all devices; each step the generator's tensor-parallel
  weights are gathered from the trainer's shards in place, generation runs, then the frozen models and
  the trainer take their turns. Phases run one after another (synchronous). State of idle roles may be
  offloaded to host memory to make room.
- **disaggregated**: the generator on its own devices, the trainer (with the frozen models beside it)
  on the rest. The generator gets new weights by DDMA point-to-point transfers; with an `async`
  schedule generation of step i+1 overlaps training of step i.

Each candidate fixes dp/fsdp/tp/pp, sharding, recompute, generator precision and offload. Candidates
that do not fit memory are dropped with the reason; the rest are ranked by predicted step time
(analytical model of `graphrl.compiler.cost`). For large clusters the generator and trainer halves are
ranked separately per device split and only the best few of each are combined (a beam), which keeps the
405B-on-1024-GPUs search to about a second; `exhaustive=True` combines every pair. Ties break on the
candidate's label, so the same job and cluster always give the same plan.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Literal

from graphrl.engine_support import ENGINE_PRECISIONS
from graphrl.errors import PlacementError
from graphrl.ir import JobGraph
from graphrl.schemas.cluster import ClusterSpec
from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.job import PlacementHints, RoleHint, parse_device_range
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.model import ModelDims
from graphrl.schemas.plan import (
    CandidateSummary,
    DeviceMemory,
    Layout,
    MemoryBytes,
    Operation,
    RolePlacement,
    StepEstimate,
)
from graphrl.schemas.program import CostKey

from graphrl.compiler import cost
from graphrl.ops import rollout_bytes_per_response
from graphrl.schemas.sharding import llama_params, region_size, shard_bounds
from graphrl.compiler.roles import JobShape, Role, Workload, derive_roles, derive_workload, effective_mode
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
        return cost.group_spans_nodes(range(first, first + n), self.per_node)

    def tp_group_spans(self, tp: int) -> bool:
        return tp > self.per_node


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_ok(role: Role, tp: int) -> bool:
    return tp_split_problem(role.dims, tp, role.kind) is None


# ------------------------------------------------------------------------------------------------
# Memory of one mesh at its peak phase


def _micro_tokens(p: Problem, cfg: TrainCfg) -> int:
    w = p.workload
    local = max(1, math.ceil(w.responses / (cfg.dp * cfg.fsdp)))
    per_micro = min(local, w.micro_batch) if w.micro_batch else local
    return per_micro * w.seq_len


def _train_state(p: Problem, role: Role, cfg: TrainCfg) -> tuple[cost.MemoryBreakdown, cost.MemoryBreakdown]:
    """(device, host) bytes of a train role while it trains (optimizer offloaded between steps if cfg.offload)."""
    return cost.training_memory(
        role.dims, dp=cfg.dp, fsdp=cfg.fsdp, tp=cfg.tp, pp=cfg.pp, sharding=cfg.sharding,  # type: ignore[arg-type]
        micro_batch_tokens=_micro_tokens(p, cfg), seq_len=p.workload.seq_len, recompute=cfg.recompute,
    )


def _infer_state(p: Problem, role: Role, cfg: TrainCfg) -> cost.MemoryBreakdown:
    """A frozen model beside the trainer: weights sharded like the trainer's (ZeRO-3 inference)."""
    w = p.workload
    local = max(1, math.ceil(w.responses / (cfg.dp * cfg.fsdp)))
    micro = min(local, w.micro_batch) if w.micro_batch else local
    mem = cost.inference_memory(role.dims, tp=cfg.tp, pp=cfg.pp, precision="bf16", batch=micro,
                                context_len=w.seq_len, generator=False)
    d = cfg.dp * cfg.fsdp
    if d > 1:
        layer = cost.layer_params(role.dims) / cfg.tp * cost.BF16_BYTES
        mem = replace(mem, params=mem.params / d + 2 * layer)
    return mem


@dataclass(frozen=True)
class MeshMemory:
    """Per-role device bytes at the mesh's peak, the peak itself, and host bytes."""

    peak: float
    roles: dict[str, cost.MemoryBreakdown]
    host: dict[str, cost.MemoryBreakdown]
    offloaded: dict[str, tuple[str, ...]]


def _idle(mem: cost.MemoryBreakdown, offloaded: tuple[str, ...]) -> float:
    """Bytes an idle role keeps on the device: its state minus what is offloaded, no activations."""
    keep = {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer}
    return sum(v for k, v in keep.items() if k not in offloaded)


def resident_while_generating(mem: MeshMemory) -> float:
    """Bytes per device the trainer mesh keeps while a colocated generator runs on it: every role's
    idle state, minus what the candidate offloads. The search, the plan's layout and its predicted
    Generate duration all leave the generator the rest."""
    return sum(_idle(m, mem.offloaded[name]) for name, m in mem.roles.items())


def trainer_mesh_memory(p: Problem, cfg: TrainCfg, extra_resident: float = 0.0) -> MeshMemory:
    """Peak bytes per device of the trainer mesh: the train roles and the frozen roles beside them.

    Phases run one at a time: the frozen models' forwards, then each train role's update. In a phase the
    active role holds its full state plus activations; idle roles hold their state minus what the
    candidate offloads (optimizer and gradients of idle train roles, weights of idle frozen roles).
    `extra_resident` is memory held by another role in every phase (the colocated generator, say).
    """
    roles: dict[str, cost.MemoryBreakdown] = {}
    host: dict[str, cost.MemoryBreakdown] = {}
    offloaded: dict[str, tuple[str, ...]] = {}
    for role in p.roles_of("train"):
        dev, h = _train_state(p, role, cfg)
        roles[role.name], host[role.name] = dev, h
        offloaded[role.name] = ("grads", "optimizer") if cfg.offload else ()
    for role in p.roles_of("infer"):
        roles[role.name] = _infer_state(p, role, cfg)
        host[role.name] = cost.MemoryBreakdown()
        offloaded[role.name] = ("params",) if cfg.offload else ()
    # Train roles that also run forwards (a critic's values, the old policy's log-probs) keep their
    # weights in every phase anyway (only their gradients and optimizer state are offloaded).
    phases = [[r.name for r in p.roles_of("infer")]] + [[r.name] for r in p.roles_of("train")]
    peak = 0.0
    for active in phases:
        total = extra_resident
        for name, mem in roles.items():
            total += mem.total if name in active else _idle(mem, offloaded[name])
        peak = max(peak, total)
    return MeshMemory(peak, roles, host, offloaded)


def _gen_per_sequence(p: Problem, role: Role, tp: int) -> float:
    """Device bytes one in-flight sequence adds to a generator: its KV cache and decode activations."""
    one = cost.inference_memory(role.dims, tp=tp, pp=1, precision="bf16", batch=1,
                                context_len=p.workload.seq_len, generator=True)
    return one.kv_cache + one.activations


def _gen_weights(role: Role, tp: int, precision: str) -> float:
    """A generator's weight bytes per device: the model's own dtype (a float32 CPU model stores 4 bytes per
    weight); with fp8, the block linears at 1 byte plus their scales and the rest still at the dtype."""
    dtype_bytes = max(role.weight_bytes, cost.BF16_BYTES)
    if precision == "fp8":
        return cost.weight_bytes(role.dims, cost.PRECISION_BYTES["fp8"], dtype_bytes) / tp
    return cost.weight_bytes(role.dims, dtype_bytes) / tp


# ------------------------------------------------------------------------------------------------
# Time of the halves


def generation_time(p: Problem, gen: GenCfg, free_bytes: float) -> tuple[float, int] | None:
    """(seconds, concurrent sequences per replica) of generating one step's responses; None if no
    sequence fits next to the weights. Replicas run in parallel; a replica that cannot hold its whole
    share of sequences at once generates them in waves."""
    role = p.generator
    assert role is not None
    w = p.workload
    per_seq = _gen_per_sequence(p, role, gen.tp)
    room = free_bytes - _gen_weights(role, gen.tp, gen.precision)
    concurrent = int(room // per_seq) if per_seq > 0 else 0
    if concurrent < 1:
        return None
    share = math.ceil(w.responses / gen.dp)
    waves = math.ceil(share / concurrent)
    batch = math.ceil(share / waves)
    t = waves * cost.generation_time(role.dims, batch, w.prompt_len, w.response_len, gen.tp,
                                     gen.precision, p.hw, intra_node=not p.tp_group_spans(gen.tp))  # type: ignore[arg-type]
    t *= cost.engine_time_factor(p.hw, p.hint(role.name).engine or "native")
    return t + p.hw.op_overhead_s, min(concurrent, share)


# One float64 per reported metric (reward sum and count, tokens, loss, KL, entropy, grad norm, ...).
METRICS_BYTES = 16 * 8


def role_times(p: Problem, cfg: TrainCfg) -> dict[CostKey, float]:
    """Seconds per step of each op kind of each role on the trainer mesh, keyed by (kind, role)
    (e.g. TrainStep of policy, Forward of reference); the instruction durations the simulator uses."""
    w = p.workload
    spans_dp = p.spans(cfg.first, cfg.n) if cfg.dp * cfg.fsdp > 1 else False
    common = dict(seq_len=w.seq_len, hw=p.hw, dp=cfg.dp, fsdp=cfg.fsdp, tp=cfg.tp, pp=cfg.pp,
                  intra_node_tp=not p.tp_group_spans(cfg.tp), dp_spans_nodes=spans_dp)
    # Micro-batches per data-parallel rank: the job's micro-batch size splits the local share (one
    # micro-batch when unset); pipelines need at least pp of them in flight.
    local = max(1, math.ceil(w.responses / (cfg.dp * cfg.fsdp)))
    micro = max(1, math.ceil(local / w.micro_batch)) if w.micro_batch else 1
    common["microbatches"] = max(micro, 4 * cfg.pp) if cfg.pp > 1 else micro
    out: dict[CostKey, float] = {}
    for role in p.roles_of("infer", "train"):
        forward = cost.forward_time(role.dims, tokens=w.tokens, **common).total_s + p.hw.op_overhead_s
        if role.kind == "infer":
            out[CostKey("Forward", role.name)] = forward
            continue
        step = cost.training_step_time(
            role.dims, tokens=w.tokens, seq_len=w.seq_len, dp=cfg.dp, fsdp=cfg.fsdp, tp=cfg.tp, pp=cfg.pp,
            sharding=cfg.sharding, recompute=cfg.recompute, hw=p.hw,  # type: ignore[arg-type]
            intra_node_tp=not p.tp_group_spans(cfg.tp), dp_spans_nodes=spans_dp, microbatches=common["microbatches"],
        )
        out[CostKey("TrainStep", role.name)] = step.total_s * w.updates_per_step + p.hw.op_overhead_s
        if role is p.policy:  # the step's metrics (reward, loss, ...) are all-reduced over the trainer ranks
            out[CostKey("TrainStep", role.name)] += cost.collective_time(
                "all_reduce", METRICS_BYTES, cfg.n, p.hw, p.spans(cfg.first, cfg.n))
        # Critics (and any train role besides the policy) also run a forward for their values.
        if role is not p.policy:
            out[CostKey("Forward", role.name)] = forward
    return out


def offload_bytes(p: Problem, cfg: TrainCfg) -> float:
    """Bytes per device moved to host (and back) each step when the candidate offloads idle state."""
    if not cfg.offload:
        return 0.0
    moved = 0.0
    for role in p.roles_of("train"):
        dev, _ = _train_state(p, role, cfg)
        moved += dev.grads + dev.optimizer
    for role in p.roles_of("infer"):
        moved += _infer_state(p, role, cfg).params
    return moved


def trainer_times(p: Problem, cfg: TrainCfg) -> dict[str, float]:
    """Seconds per step of the trainer mesh's phases: frozen forwards ('infer'), updates ('train') and
    moving idle state to host and back ('offload')."""
    per_role = role_times(p, cfg)
    return {
        "infer": sum(v for k, v in per_role.items() if k.kind == "Forward"),
        "train": sum(v for k, v in per_role.items() if k.kind == "TrainStep"),
        "offload": 2 * cost.offload_time(offload_bytes(p, cfg), p.hw),
    }


def weight_sync_time(p: Problem, train: TrainCfg, gen: GenCfg) -> tuple[float, float]:
    """(seconds, bytes on links) for DDMA: every generator replica receives the full bf16 weights,
    split over its tp ranks; all trainer ranks send in parallel. The slower of the receive side (one
    generator rank's share) and the send side (all bytes over all trainer ranks) bounds the time."""
    role = p.policy
    weights = cost.weight_bytes(role.dims, cost.BF16_BYTES)
    total = weights * gen.dp
    spans = p.spans(min(train.first, gen.first), train.n + gen.n)
    bw = (p.hw.inter_node_bandwidth if spans else p.hw.intra_node_bandwidth) * p.hw.link_efficiency
    per_receiver = weights / gen.tp
    per_sender = total / train.n
    return max(per_receiver, per_sender) / bw + p.hw.link_latency_s, total


def reshard_in_place_time(p: Problem, train: TrainCfg, gen: GenCfg) -> tuple[float, float]:
    """Colocated: each device gathers its generator tp shard from the trainer's shards, one all-gather
    per weight tensor. Replicated trainer weights (no FSDP) with the generator's tp are read in place.
    An fsdp trainer exactly as wide as one tp generator already holds, on each device, that device's tp
    shard of every tensor whose cuts line up (`fsdp_shard_dim`): only the others are gathered."""
    role = p.policy
    weights = cost.weight_bytes(role.dims, cost.BF16_BYTES)
    group = train.dp * train.fsdp
    if (group <= 1 or train.sharding != "fsdp") and train.tp == gen.tp:
        return 0.0, 0.0
    group = max(group, 2)
    spans = p.spans(0, p.num_devices)
    if train.tp == 1 and train.dp == 1 and train.sharding == "fsdp" and train.fsdp == gen.tp == gen.n:
        shard_bytes, tensors = unaligned_tp_shards(role.dims, gen.tp)
        if not tensors:
            return 0.0, 0.0
        return cost.chunked_collective_time("all_gather", shard_bytes, tensors, group, p.hw, spans), shard_bytes
    t = cost.chunked_collective_time("all_gather", weights / gen.tp, cost.param_tensor_count(role.dims), group,
                                     p.hw, spans)
    return t, weights * gen.dp


@functools.lru_cache(maxsize=64)
def unaligned_tp_shards(dims: ModelDims, tp: int) -> tuple[float, int]:
    """(bf16 bytes of one device's tp shards, tensor count) of the tensors whose tp shard is not what an
    fsdp shard over the same `tp` devices holds: the norms (tp replicates them, fsdp cuts them),
    replicated KV heads, row-parallel weights whose columns do not split evenly."""
    fsdp = Mesh.contiguous([("dp", 1), ("fsdp", tp), ("tp", 1), ("pp", 1)], 0)
    gen = Mesh.contiguous([("dp", 1), ("fsdp", 1), ("tp", tp), ("pp", 1)], 0)
    shard_bytes, tensors = 0.0, 0
    for param in llama_params(dims):
        if param.layer not in (None, 0):
            continue  # every layer is laid out as layer 0
        if all(shard_bounds(param, fsdp, r) == shard_bounds(param, gen, r) for r in range(tp)):
            continue
        copies = dims.num_layers if param.layer == 0 else 1
        region = shard_bounds(param, gen, 0)
        assert region is not None
        shard_bytes += copies * region_size(region) * cost.BF16_BYTES
        tensors += copies
    return shard_bytes, tensors


def rollout_transfer_time(p: Problem, spans: bool) -> tuple[float, float]:
    w = p.workload
    total = w.responses * rollout_bytes_per_response(w.prompt_len, w.response_len)
    return cost.collective_time("p2p", total, 2, p.hw, spans), total


# ------------------------------------------------------------------------------------------------
# Enumeration


def _train_cfgs(p: Problem, first: int, n: int) -> list[TrainCfg]:
    """Trainer layouts over devices [first, first+n) that respect the policy's pins."""
    role = p.policy
    hint = p.hint(role.name)
    shardings = [hint.sharding] if hint.sharding else list(SHARDINGS)
    offloads = [hint.offload] if hint.offload is not None else [False, True]
    out = []
    for tp, pp, dp, fsdp in train_shapes(role, hint, n, p.per_node):
        for sharding in shardings:
            if sharding != "none" and dp * fsdp == 1 and len(shardings) > 1:
                continue  # nothing to shard over; 'none' covers it
            for recompute in (False, True):
                for offload in offloads:
                    out.append(TrainCfg(first, n, dp, fsdp, tp, pp, sharding, recompute, offload))
    return out


def _gen_cfgs(p: Problem, first: int, n: int) -> list[GenCfg]:
    role = p.generator
    assert role is not None
    hint = p.hint(role.name)
    # fp8 is searched where it runs on fp8 matmul units; where it is dequantized at use (CPU) it only
    # saves memory, so it is run when pinned.
    native_fp8 = p.hw.peak_fp8_flops > 0 and not cost.fp8_dequantizes(p.hw)
    precisions = [hint.precision] if hint.precision else (["bf16", "fp8"] if native_fp8 else ["bf16"])
    precisions = [prec for prec in precisions if prec in ENGINE_PRECISIONS[hint.engine or "native"]]
    return [GenCfg(first, n, tp, prec) for tp in generate_shapes(role, hint, n, p.per_node) for prec in precisions]


def _splits(p: Problem) -> list[tuple[int, int, int, int]]:
    """(gen_first, gen_n, train_first, train_n) device splits for disaggregated layouts."""
    gen_hint = p.hint(p.generator.name) if p.generator else RoleHint()
    return device_splits(p.num_devices, p.per_node, gen_hint.devices, p.hint(p.policy.name).devices)


# ------------------------------------------------------------------------------------------------
# Evaluation of full candidates


def _reject(ev: Evaluated, role: str, needed: float, available: float, why: str) -> Evaluated:
    ev.fits = False
    ev.worst_role, ev.needed_bytes, ev.available_bytes = role, needed, available
    ev.overflow = needed / available if available > 0 else math.inf
    ev.reason = why
    return ev


def evaluate_colocated(p: Problem, train: TrainCfg, gen: GenCfg | None, *, mem: MeshMemory | None = None,
                       times: dict[str, float] | None = None) -> Evaluated:
    """One colocated candidate. `mem` and `times` are the trainer's own figures (they do not depend on
    the generator), passed in when the search already has them for this trainer."""
    ev = Evaluated("colocated", train, gen, fits=True)
    mem = mem or trainer_mesh_memory(p, train)
    if mem.peak > p.usable:
        return _reject(ev, p.policy.name, mem.peak, p.usable,
                       f"trainer mesh needs {mem.peak / GB:.1f} GB per device, {p.usable / GB:.1f} GB usable")
    phases: dict[str, float] = {}
    if gen is not None:
        resident = resident_while_generating(mem)
        res = generation_time(p, gen, p.usable - resident)
        if res is None:
            need = resident + _gen_weights(p.generator, gen.tp, gen.precision) + _gen_per_sequence(p, p.generator, gen.tp)
            return _reject(ev, p.generator.name, need, p.usable,
                           f"generator weights ({_gen_weights(p.generator, gen.tp, gen.precision) / GB:.1f} GB) "
                           f"beside {resident / GB:.1f} GB of trainer state leave no room for one sequence's KV cache")
        phases["generate"] = res[0]
        phases["reshard_in_place"] = reshard_in_place_time(p, train, gen)[0]
    times = times or trainer_times(p, train)
    phases.update(infer=times["infer"], train=times["train"], offload=times["offload"])
    ev.phases = {k: v for k, v in phases.items() if v > 0 or k in ("generate", "train")}
    ev.step_time_s = sum(ev.phases.values())
    return ev


def _gen_half(p: Problem, gen: GenCfg) -> tuple[float, str | None, float]:
    """(seconds, rejection reason, bytes needed) of a generator alone on its mesh."""
    res = generation_time(p, gen, p.usable)
    if res is None:
        need = _gen_weights(p.generator, gen.tp, gen.precision) + _gen_per_sequence(p, p.generator, gen.tp)
        return math.inf, (f"generator weights {_gen_weights(p.generator, gen.tp, gen.precision) / GB:.1f} GB per "
                          f"device leave no room for the KV cache ({p.usable / GB:.1f} GB usable)"), need
    return res[0], None, 0.0


def combine_disaggregated(p: Problem, train: TrainCfg, gen: GenCfg, gen_time: float,
                          times: dict[str, float]) -> Evaluated:
    ev = Evaluated("disaggregated", train, gen, fits=True)
    sync_t, _ = weight_sync_time(p, train, gen)
    data_t, _ = rollout_transfer_time(p, p.spans(min(train.first, gen.first), train.n + gen.n))
    trainer_side = times["infer"] + times["train"] + times["offload"]
    phases = {"generate": gen_time, "reshard": data_t, "infer": times["infer"], "train": times["train"],
              "weight_sync": sync_t}
    if times["offload"] > 0:
        phases["offload"] = times["offload"]
    if p.mode == "async":
        step = max(gen_time + sync_t, trainer_side + sync_t + data_t)
    else:
        step = gen_time + data_t + trainer_side + sync_t
    ev.phases = phases
    ev.step_time_s = step
    return ev


@dataclass
class SearchResult:
    best: Evaluated
    baseline: Evaluated | None
    considered: int
    ranked: list[Evaluated]
    rejected: list[Evaluated]


def _strategies(p: Problem) -> list[Strategy]:
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


def search(p: Problem, *, exhaustive: bool = False, beam: int = 4) -> SearchResult:
    """Enumerate, evaluate and rank candidates. Raises PlacementError when none fits."""
    evaluated: list[Evaluated] = []
    considered = 0
    strategies = _strategies(p)
    colocated: list[Evaluated] = []
    if "colocated" in strategies or True:  # the colocated-synchronous baseline is always computed
        n = p.num_devices
        gens = _gen_cfgs(p, 0, n) if p.generator else [None]
        for train in _train_cfgs(p, 0, n):
            mem = trainer_mesh_memory(p, train)
            times = trainer_times(p, train) if mem.peak <= p.usable else None
            for gen in gens:
                considered += 1
                colocated.append(evaluate_colocated(p, train, gen, mem=mem, times=times))
    if "colocated" in strategies:
        evaluated.extend(colocated)
    if "disaggregated" in strategies:
        for g_first, g_n, t_first, t_n in _splits(p):
            gen_ranked: list[tuple[float, str, GenCfg]] = []
            for gen in _gen_cfgs(p, g_first, g_n):
                considered += 1
                t, why, need = _gen_half(p, gen)
                if why is None:
                    gen_ranked.append((t, gen.label, gen))
                else:
                    ev = Evaluated("disaggregated", TrainCfg(t_first, t_n, 1, 1, 1, 1, "none", False, False), gen, True)
                    evaluated.append(_reject(ev, p.generator.name, need, p.usable, why))
            train_ranked: list[tuple[float, str, TrainCfg, dict[str, float]]] = []
            for train in _train_cfgs(p, t_first, t_n):
                considered += 1
                mem = trainer_mesh_memory(p, train)
                if mem.peak > p.usable:
                    ev = Evaluated("disaggregated", train, None, True)
                    evaluated.append(_reject(ev, p.policy.name, mem.peak, p.usable,
                                             f"trainer mesh needs {mem.peak / GB:.1f} GB per device, {p.usable / GB:.1f} GB usable"))
                    continue
                times = trainer_times(p, train)
                train_ranked.append((times["infer"] + times["train"] + times["offload"], train.label, train, times))
            gen_ranked.sort(key=lambda x: (x[0], x[1]))
            train_ranked.sort(key=lambda x: (x[0], x[1]))
            if not exhaustive:
                gen_ranked, train_ranked = gen_ranked[:beam], train_ranked[:beam]
            for gt, _, gen in gen_ranked:
                for _, _, train, times in train_ranked:
                    considered += 1
                    evaluated.append(combine_disaggregated(p, train, gen, gt, times))
    fitting = sorted((e for e in evaluated if e.fits), key=Evaluated.key)
    rejected = [e for e in evaluated if not e.fits]
    baseline = _baseline(colocated)
    if not fitting:
        raise no_fit_error(p, rejected)
    return SearchResult(fitting[0], baseline, considered, fitting, rejected)


def _baseline(colocated: list[Evaluated]) -> Evaluated | None:
    """The DeepSpeed-Chat-like reference: colocated, synchronous, bf16 generation, nothing offloaded
    (offload and then fp8 are allowed only when nothing else fits)."""
    def bf16(e: Evaluated) -> bool:
        return e.gen is None or e.gen.precision == "bf16"

    for keep in (lambda e: bf16(e) and not e.train.offload, bf16, lambda e: True):
        pool = sorted((e for e in colocated if e.fits and keep(e)), key=Evaluated.key)
        if pool:
            return pool[0]
    return None


def no_fit_error(p: Problem, rejected: list[Evaluated]) -> PlacementError:
    """The nearest miss, with the bytes it needed and what would make it fit."""
    nearest = min(rejected, key=lambda e: (e.overflow, e.label)) if rejected else None
    if nearest is None:
        return PlacementError("no candidate layout exists for these pins", path=("placement",),
                              fix="loosen the pins under placement.roles")
    factor = nearest.overflow
    need_devices = int(math.ceil(p.num_devices * factor))
    fixes = [f"more devices (about {need_devices} instead of {p.num_devices})"]
    if nearest.gen is not None and nearest.worst_role == (p.generator.name if p.generator else None):
        if nearest.gen.precision == "bf16" and p.hw.peak_fp8_flops > 0:
            fixes.append("fp8 generation (precision: fp8)")
        fixes.append(f"a larger generator tp (tp: {nearest.gen.tp * 2})")
    else:
        if nearest.train.sharding != "fsdp":
            fixes.append("sharding: fsdp")
        if not nearest.train.offload:
            fixes.append("offload: true")
        fixes.append(f"a larger tp (tp: {nearest.train.tp * 2})")
    return PlacementError(
        f"no layout fits: {nearest.worst_role} needs {nearest.needed_bytes / GB:.2f} GB per device, "
        f"{nearest.available_bytes / GB:.2f} GB available (nearest: {nearest.label})",
        path=("placement", "roles", nearest.worst_role or ""), fix="try " + ", or ".join(fixes),
    )


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
        if hint.precision == "fp8" and p.hw.peak_fp8_flops <= 0:
            raise PlacementError(f"hardware {p.hw.name} has no fp8 support", path=path + ("precision",),
                                 fix="use precision: bf16")
        if hint.precision == "fp8" and role.kind != "generate":
            raise PlacementError("only generation copies can run in fp8", path=path + ("precision",),
                                 fix=f"pin precision on '{role.model}/generate'")
    for i, group in enumerate(p.hints.colocate):
        for name in group:
            if name not in names:
                raise PlacementError(f"unknown role {name!r} in colocate group", path=("placement", "colocate", i),
                                     fix=f"use roles: {', '.join(names)}")


def make_problem(graph: JobGraph, cluster: ClusterSpec, hw: HardwareSpec) -> Problem:
    roles = derive_roles(graph)
    if not any(r.kind == "train" for r in roles):
        raise PlacementError("the job trains no model", path=("nodes",), fix="add a train node")
    p = Problem(tuple(roles), derive_workload(graph), cluster, hw, graph.job.placement, graph.job.schedule.mode)
    check_pins(p)
    return p


# ------------------------------------------------------------------------------------------------
# From a chosen candidate to the plan's Layout


def _mem_bytes(m: cost.MemoryBreakdown) -> MemoryBytes:
    return MemoryBytes(params=m.params, grads=m.grads, optimizer=m.optimizer, activations=m.activations,
                       kv_cache=m.kv_cache)


def layout_durations(p: Problem, ev: Evaluated, layout: Layout) -> dict[CostKey, float]:
    """Predicted seconds of each (instruction kind, role) on a candidate's layout, from the cost model:
    every role's forward and update, generation, the in-place reshard of a colocated policy, and the
    per-job kinds. Weight syncs by DDMA are timed by their own planner (compiler/weight_sync.py)."""
    durations = dict(role_times(p, ev.train))
    overhead = p.hw.op_overhead_s
    durations.update({CostKey("Rule"): overhead, CostKey("Advantage"): overhead, CostKey("Checkpoint"): overhead,
                      CostKey("ReleaseWeights"): 0.0})
    gen_role = p.generator
    if gen_role is not None and ev.gen is not None:
        free = p.usable
        if layout.strategy == "colocated":
            free = p.usable - resident_while_generating(trainer_mesh_memory(p, ev.train))
            durations[CostKey("ReshardInPlace", p.policy.model)] = reshard_in_place_time(p, ev.train, ev.gen)[0]
        res = generation_time(p, ev.gen, free)
        durations[CostKey("Generate", gen_role.name)] = res[0] if res else math.inf
    return durations


def to_layout(p: Problem, ev: Evaluated) -> Layout:
    """The plan's view of a candidate: meshes, per-role placements with memory, inserted operations."""
    train, gen = ev.train, ev.gen
    meshes: list[Mesh] = []
    placements: list[RolePlacement] = []
    operations: list[Operation] = []
    device_memory: list[DeviceMemory] = []
    trainer_mesh = "all" if ev.strategy == "colocated" else "trainer"
    meshes.append(train.mesh(trainer_mesh))
    mem = trainer_mesh_memory(p, train)
    capacity = p.hw.memory_bytes
    for role in p.roles_of("train", "infer"):
        placements.append(RolePlacement(
            role=role.name, model=role.model, kind=role.kind, ops=list(role.ops), mesh=trainer_mesh,
            dp=train.dp, fsdp=train.fsdp, tp=train.tp, pp=train.pp,
            sharding=train.sharding if role.kind == "train" else ("fsdp" if train.dp * train.fsdp > 1 else "none"),  # type: ignore[arg-type]
            precision="bf16", offload=list(mem.offloaded[role.name]),  # type: ignore[arg-type]
            memory_bytes=_mem_bytes(mem.roles[role.name]), host_bytes=_mem_bytes(mem.host[role.name]),
        ))
        if mem.offloaded[role.name]:
            moved = sum(getattr(mem.roles[role.name], k) for k in mem.offloaded[role.name]) * train.n
            t = cost.offload_time(moved / train.n, p.hw)
            operations.append(Operation(kind="offload", src=role.name, dst="host", num_bytes=moved, time_s=t,
                                        detail=f"{', '.join(mem.offloaded[role.name])} while idle"))
            operations.append(Operation(kind="onload", src="host", dst=role.name, num_bytes=moved, time_s=t,
                                        detail="before its phase"))
    if gen is not None and p.generator is not None:
        g = p.generator
        engine = p.hint(g.name).engine or "native"
        gen_mesh = trainer_mesh if ev.strategy == "colocated" else "generator"
        if ev.strategy == "disaggregated":
            meshes.append(gen.mesh("generator"))
            free = p.usable
        else:
            free = p.usable - resident_while_generating(mem)
        res = generation_time(p, gen, free)
        concurrent = res[1] if res else 1
        gmem = cost.inference_memory(g.dims, tp=gen.tp, pp=1, precision=gen.precision,  # type: ignore[arg-type]
                                     batch=concurrent, context_len=p.workload.seq_len, generator=True)
        gmem = replace(gmem, params=_gen_weights(g, gen.tp, gen.precision))
        placements.append(RolePlacement(
            role=g.name, model=g.model, kind="generate", ops=list(g.ops), mesh=gen_mesh, dp=gen.dp, tp=gen.tp,
            precision=gen.precision, engine=engine,
            memory_bytes=_mem_bytes(gmem),  # type: ignore[arg-type]
        ))
        if ev.strategy == "colocated":
            t, b = reshard_in_place_time(p, train, gen)
            operations.append(Operation(
                kind="reshard_in_place", src=p.policy.name, dst=g.name, num_bytes=b, time_s=t,
                detail=(f"fill tp{gen.tp} generator shards from the trainer's {train.sharding} shards" if b else
                        "the generator reads the trainer's weights in place")
                + (", quantized to fp8 on this device" if gen.precision == "fp8" else "")
                + (", then reloaded into the vLLM engine" if engine == "vllm" else "")))
            resident = resident_while_generating(mem)
            device_memory.append(DeviceMemory(mesh=trainer_mesh, peak_bytes=max(mem.peak, resident + gmem.total),
                                              capacity_bytes=capacity, roles=[pl.role for pl in placements]))
        else:
            t, b = weight_sync_time(p, train, gen)
            operations.append(Operation(
                kind="weight_sync", src=p.policy.name, dst=g.name, num_bytes=b, time_s=t,
                detail=f"DDMA point-to-point, {train.n} senders -> {gen.n} receivers ({gen.dp} replicas x tp{gen.tp})"
                       + (", fp8 cast on receive" if gen.precision == "fp8" else "")
                       + (", then reloaded into the vLLM engine" if engine == "vllm" else "")))
            t, b = rollout_transfer_time(p, p.spans(min(train.first, gen.first), train.n + gen.n))
            operations.append(Operation(kind="reshard", src=g.name, dst=trainer_mesh, num_bytes=b, time_s=t,
                                        detail=f"rollouts from {gen.dp} generator replicas to {train.dp * train.fsdp} trainer ranks, balanced by tokens"))
            device_memory.append(DeviceMemory(mesh=trainer_mesh, peak_bytes=mem.peak, capacity_bytes=capacity,
                                              roles=[pl.role for pl in placements if pl.mesh == trainer_mesh]))
            device_memory.append(DeviceMemory(mesh="generator", peak_bytes=gmem.total, capacity_bytes=capacity,
                                              roles=[g.name]))
    else:
        device_memory.append(DeviceMemory(mesh=trainer_mesh, peak_bytes=mem.peak, capacity_bytes=capacity,
                                          roles=[pl.role for pl in placements]))
    estimate = StepEstimate(step_time_s=ev.step_time_s, phases=ev.phases, mode=effective_mode(p.mode, ev.strategy))
    return Layout(strategy=ev.strategy, label=ev.label, meshes=meshes, placements=placements,
                  operations=operations, device_memory=device_memory, estimate=estimate)


def summaries(result: SearchResult, limit: int = 200) -> list[CandidateSummary]:
    """The best candidates, then rejected ones (one per distinct reason first), for --explain and JSON."""
    out = [CandidateSummary(label=e.label, strategy=e.strategy, fits=True, step_time_s=e.step_time_s)
           for e in result.ranked[: limit // 2]]
    seen: set[str] = set()
    firsts, rest = [], []
    for e in sorted(result.rejected, key=lambda e: (e.overflow, e.label)):
        reason_kind = (e.reason or "").split(" needs")[0].split(" weights")[0]
        (rest if reason_kind in seen else firsts).append(e)
        seen.add(reason_kind)
    for e in (firsts + rest)[: limit - len(out)]:
        out.append(CandidateSummary(label=e.label, strategy=e.strategy, fits=False, reason=e.reason))
    return out
