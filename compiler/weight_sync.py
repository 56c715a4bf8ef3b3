"""The weight-sync stage: how each new version of the policy's weights reaches the generator.

Disaggregated layouts get one DDMA plan (`graphrl.compiler.ddma`) per trained model that generates:
the trainer's shards intersected with the generator's shards per parameter, bucketed, in
contention-free rounds, stored in the plan as a `WeightSyncRecord` and run by a `WeightSync` group
instruction. Colocated layouts reshard in place (`ReshardInPlace`): the same devices hold both roles.
A tensor-parallel generator is filled there by a DDMA plan of the same planner, stored the same way: each
rank copies what its own trainer shards hold and receives the rest (with an fsdp trainer as wide as the
generator's tp, only the norms cross; see `fsdp_shard_dim`), where gathering the whole model on every rank
would need a full transient copy per device and tp times the traffic. Every record holds all its rounds,
however many (`graphrl.schemas.weightsync`): ranks run the plan, they never plan.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping

from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.model import LoraSpec, ModelDims
from graphrl.schemas.program import CostKey
from graphrl.schemas.plan import Layout
from graphrl.schemas.weightsync import WeightSyncKind, WeightSyncRecord

from graphrl.compiler.background import Later
from graphrl.compiler.cost import BF16_BYTES, timing
from graphrl.compiler.ddma import DDMA_BUCKET_BYTES, gc_paused, plan_llama_sync, sync_record
from graphrl.compiler.roles import JobShape, Role


@dataclass(frozen=True)
class WeightSyncPlan:
    """The weight-sync stage's result for the policy."""

    kind: WeightSyncKind
    """No generator; colocated (resharded in place, on the trainer's own devices); disaggregated (DDMA copy)."""
    transfer: str
    """The transfer's name in the plan (`model:trainer->generator`)."""
    planned: Later[tuple[float, WeightSyncRecord | None]]
    """Predicted seconds of one sync, and the DDMA plan the executors run (a `ddma` copy's, or an `in_place`
    reshard's into a tensor-parallel generator: `needs_record`). A large DDMA plan is made on a second core
    while the schedule and the programs are built (`ddma_record_later`); only lowering waits for it."""

    @property
    def seconds(self) -> float:
        return self.planned.get()[0]

    @property
    def record(self) -> WeightSyncRecord | None:
        return self.planned.get()[1]


def needs_record(kind: WeightSyncKind, gen_tp: int) -> bool:
    """Whether a sync runs a DDMA plan: a copy between meshes, or a colocated reshard into a tensor-parallel
    generator (its ranks fill their shards; a tp-1 generator is copied or read whole)."""
    return kind == "ddma" or (kind == "in_place" and gen_tp > 1)


def plan_policy_sync(shape: JobShape, layout: Layout, durations: Mapping[CostKey, float], *,
                     stored: bool = True) -> WeightSyncPlan:
    """The policy's weight sync on `layout`: a colocated reshard timed by placement (`durations`), or a
    DDMA copy planned and timed here. A colocated reshard into a tensor-parallel generator gets its DDMA
    plan where the programs are `stored` for ranks to run (`ProgramSettings.stored`)."""
    policy = shape.policy
    transfer = f"{policy.model}:trainer->generator"
    gen_role = shape.generator
    if gen_role is None:
        return WeightSyncPlan("none", transfer, Later.now((0.0, None)))
    train, gen = shape.policy_meshes(layout)
    placement = next(p for p in layout.placements if p.role == gen_role.name)
    precision = placement.precision
    assert gen is not None
    if layout.strategy == "colocated":
        seconds = durations[CostKey("ReshardInPlace", policy.model)]
        if not (stored and needs_record("in_place", placement.tp)):
            return WeightSyncPlan("in_place", transfer, Later.now((seconds, None)))
        planned = ddma_record_later(policy.dims, policy.model, shape.hardware, shape.devices_per_node, train, gen,
                                    precision, lora=gen_role.lora, merged=merges(policy, gen_role))
        return WeightSyncPlan("in_place", transfer, planned.then(
            lambda made: (seconds, made[0].model_copy(update={"predicted_s": seconds}))))
    planned = ddma_record_later(policy.dims, policy.model, shape.hardware, shape.devices_per_node, train, gen,
                                precision, lora=gen_role.lora, merged=merges(policy, gen_role))
    if placement.engine == "native":
        return WeightSyncPlan("ddma", transfer, planned.then(lambda made: (made[1], made[0])))
    # The engine then takes the delivered weights into its own.
    refit = timing.engine_refit_seconds(gen_role.dims, shape.hardware, placement.tp,
                                        max(gen_role.weight_bytes, BF16_BYTES), placement.tp > shape.devices_per_node)
    return WeightSyncPlan("ddma", transfer, planned.then(lambda made: (made[1] + refit, made[0])))


def with_sync_timed(layout: Layout, sync: WeightSyncPlan) -> Layout:
    """`layout` whose weight-sync operation (the preview's) carries the sync's own seconds and bytes: the
    figures the programs are timed with, so a plan shows one cost for one sync."""
    if sync.kind != "ddma" or sync.record is None:
        return layout
    operations = [op.model_copy(update={"time_s": sync.seconds, "num_bytes": sync.record.summary.total_bytes})
                  if op.kind == "weight_sync" else op for op in layout.operations]
    return layout.model_copy(update={"operations": operations})


# A DDMA plan between meshes of this many (sender, receiver) rank pairs or more is made on a second core
# while the compiler goes on (`ddma_record_later`): at 176 x 848 (the 405B example) it is ~0.8 s of planning
# beside ~0.7 s of scheduling and folding; a small one is made at once (a fork costs more than it saves).
BACKGROUND_MIN_PAIRS = 4096


def merges(policy: Role, generator: Role) -> bool:
    """Whether a weight sync folds the policy's adapters into the weights it sends (`lora.sync: merged`)."""
    return policy.lora is not None and generator.lora is None


@functools.lru_cache(maxsize=16)
def ddma_record_later(dims: ModelDims, model: str, hw: HardwareSpec, per_node: int, src: Mesh, dst: Mesh,
                      precision: str, bucket_bytes: int = DDMA_BUCKET_BYTES, *, lora: LoraSpec | None = None,
                      merged: bool = False) -> Later[tuple[WeightSyncRecord, float]]:
    """`ddma_record`'s result, made in a forked child where the plan is large and a spare core runs it.

    Cached: the periodic schedule is folded from short transcripts of the same layout, and `simulate`
    schedules one layout both sync and async; a 405B plan takes a second to make. The record is frozen.
    With `lora`, the adapters alone are synced (the generator keeps the base it loaded); `merged`: the trainer
    folds its adapters in, a staging group of layers at a time."""
    if len(src.devices) * len(dst.devices) >= BACKGROUND_MIN_PAIRS:
        return Later.forked(_ddma_record, dims, model, hw, per_node, src, dst, precision, bucket_bytes, lora, merged)
    return Later.now(_ddma_record(dims, model, hw, per_node, src, dst, precision, bucket_bytes, lora, merged))


def ddma_record(dims: ModelDims, model: str, hw: HardwareSpec, per_node: int, src: Mesh, dst: Mesh,
                precision: str, bucket_bytes: int = DDMA_BUCKET_BYTES, *, lora: LoraSpec | None = None
                ) -> tuple[WeightSyncRecord, float]:
    """Plan the trainer -> generator weight copy (`graphrl.compiler.ddma`); return (the record the plan stores,
    predicted seconds: each round as long as its largest bucket on the links it crosses)."""
    return ddma_record_later(dims, model, hw, per_node, src, dst, precision, bucket_bytes, lora=lora).get()


def _ddma_record(dims: ModelDims, model: str, hw: HardwareSpec, per_node: int, src: Mesh, dst: Mesh,
                 precision: str, bucket_bytes: int, lora: LoraSpec | None = None,
                 merged: bool = False) -> tuple[WeightSyncRecord, float]:
    with gc_paused():  # the plan is dropped before the collector runs again (~10^6 objects at 405B)
        plan = plan_llama_sync(dims, src, dst, precision, bucket_bytes, lora=lora, merged=merged)
        spans = timing.group_spans_nodes(list(src.devices) + list(dst.devices), per_node)
        seconds = timing.weight_copy_seconds(hw, [r.max_bucket_bytes for r in plan.rounds], spans)
        record = sync_record(plan, model, src, dst, seconds)
        del plan
    return record, seconds


def check_weight_sync(plan: WeightSyncPlan, shape: JobShape, layout: Layout, stored: bool = True) -> list[str]:
    """The stage's spec: the kind matches the strategy; a sync that runs a DDMA plan has its record, which
    copies between the layout's own meshes, no rank sends or receives twice in a round, every bucket stays
    within the size limit, and the stored buckets add up to the summary's bytes."""
    gen_role = shape.generator
    expected = "none" if gen_role is None else ("in_place" if layout.strategy == "colocated" else "ddma")
    if plan.kind != expected:
        return [f"a {layout.strategy} layout{'' if gen_role else ' without a generator'} syncs weights "
                f"'{plan.kind}', not '{expected}'"]
    if not plan.seconds >= 0:
        return [f"predicted sync time {plan.seconds} s"]
    record = plan.record
    gen_tp = next((p.tp for p in layout.placements if gen_role is not None and p.role == gen_role.name), 1)
    if not needs_record(plan.kind, gen_tp) or (plan.kind == "in_place" and not stored):
        return [] if record is None else [f"a record for a '{plan.kind}' sync that runs no DDMA plan"]
    if record is None:
        return [f"a '{plan.kind}' sync into a tp-{gen_tp} generator without its DDMA record"]
    train, gen = shape.policy_meshes(layout)
    problems = []
    if record.src != train:
        problems.append("the record's source mesh is not the trainer's mesh")
    if record.dst != gen:
        problems.append("the record's destination mesh is not the generator's mesh")
    wire = 0
    columns, contents = record.columns, record.contents
    for k, round_ in enumerate(record.rounds):
        srcs, dsts = columns[round_.src], columns[round_.dst]
        sizes = [contents[c].num_bytes for c in columns[round_.contents]]
        if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
            problems.append(f"round {k}: a rank sends or receives twice")
        if max(sizes, default=0) > record.bucket_bytes:
            problems.append(f"round {k}: a bucket exceeds {record.bucket_bytes} bytes")
        wire += sum(sizes)
    if wire != record.summary.total_bytes:
        problems.append(f"buckets hold {wire} bytes, the summary says {record.summary.total_bytes}")
    if record.group_rounds and sum(record.group_rounds) != len(record.rounds):
        problems.append(f"its staging groups hold {sum(record.group_rounds)} rounds, not {len(record.rounds)}")
    return problems


__all__ = ["WeightSyncPlan", "check_weight_sync", "ddma_record", "needs_record", "plan_policy_sync", "with_sync_timed"]
