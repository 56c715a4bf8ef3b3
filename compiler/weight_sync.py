"""The weight-sync stage: how each new version of the policy's weights reaches the generator.

Disaggregated layouts get one DDMA plan (graphrl.ddma) per trained model that generates:
the trainer's shards intersected with the generator's shards per parameter, bucketed, in
contention-free rounds, stored in the plan as a `WeightSyncRecord` and run by a `WeightSync` group
instruction. Colocated layouts reshard in place (`ReshardInPlace`): the same devices hold both roles.
Executors fill a tensor-parallel generator there by the same planner (`graphrl.ddma.rank_sync_record`, planned
when the run starts, not stored: on large meshes the rounds would dominate the plan and its compile
time): each rank copies what its own trainer shards hold and receives the rest (with an fsdp trainer
as wide as the generator's tp, only the norms cross; see `fsdp_shard_dim`), where gathering the whole
model on every rank would need a full transient copy per device and tp times the traffic. A plan
too large to store its DDMA rounds (`graphrl.ddma.MAX_STORED_BUCKETS`) is replanned the same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping

from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.model import ModelDims
from graphrl.schemas.program import CostKey
from graphrl.schemas.plan import Layout
from graphrl.schemas.weightsync import WeightSyncKind, WeightSyncRecord

from graphrl.compiler import timing
from graphrl.compiler.cost import BF16_BYTES
from graphrl.ddma import DDMA_BUCKET_BYTES, gc_paused, plan_llama_sync, sync_record
from graphrl.compiler.roles import JobShape


@dataclass(frozen=True)
class WeightSyncPlan:
    """The weight-sync stage's result for the policy."""

    kind: WeightSyncKind
    """No generator; colocated (resharded in place, on the trainer's own devices); disaggregated (DDMA copy)."""
    transfer: str
    """The transfer's name in the plan (`model:trainer->generator`)."""
    seconds: float
    """Predicted seconds of one sync."""
    record: WeightSyncRecord | None = None
    """The DDMA plan the executors run (`ddma` only)."""


def plan_policy_sync(shape: JobShape, layout: Layout, durations: Mapping[CostKey, float]) -> WeightSyncPlan:
    """The policy's weight sync on `layout`: a colocated reshard timed by placement (`durations`), or a
    DDMA copy planned and timed here."""
    policy = shape.policy
    transfer = f"{policy.model}:trainer->generator"
    gen_role = shape.generator
    if gen_role is None:
        return WeightSyncPlan("none", transfer, 0.0)
    if layout.strategy == "colocated":
        return WeightSyncPlan("in_place", transfer, durations[CostKey("ReshardInPlace", policy.model)])
    train, gen = shape.policy_meshes(layout)
    placement = next(p for p in layout.placements if p.role == gen_role.name)
    precision = placement.precision
    record, seconds = ddma_record(policy.dims, policy.model, shape.hardware, shape.devices_per_node, train, gen,
                                  precision)
    if placement.engine != "native":  # the engine then takes the delivered weights into its own
        seconds += timing.engine_refit_seconds(gen_role.dims, shape.hardware, placement.tp,
                                               max(gen_role.weight_bytes, BF16_BYTES),
                                               placement.tp > shape.devices_per_node)
    return WeightSyncPlan("ddma", transfer, seconds, record)


def with_sync_timed(layout: Layout, sync: WeightSyncPlan) -> Layout:
    """`layout` whose weight-sync operation (the preview's) carries the sync's own seconds and bytes: the
    figures the programs are timed with, so a plan shows one cost for one sync."""
    if sync.record is None:
        return layout
    operations = [op.model_copy(update={"time_s": sync.seconds, "num_bytes": sync.record.summary.total_bytes})
                  if op.kind == "weight_sync" else op for op in layout.operations]
    return layout.model_copy(update={"operations": operations})


@functools.lru_cache(maxsize=16)
def ddma_record(dims: ModelDims, model: str, hw: HardwareSpec, per_node: int, src: Mesh, dst: Mesh,
                precision: str, bucket_bytes: int = DDMA_BUCKET_BYTES) -> tuple[WeightSyncRecord, float]:
    """Plan the trainer -> generator weight copy (`graphrl.ddma`); return (the record the plan stores,
    predicted seconds: each round as long as its largest bucket on the links it crosses).

    Cached: the periodic schedule is folded from short transcripts of the same layout, and `simulate`
    schedules one layout both sync and async; a 405B plan takes seconds to plan. The record is frozen."""
    with gc_paused():  # the plan is dropped before the collector runs again (~10^6 objects at 405B)
        plan = plan_llama_sync(dims, src, dst, precision, bucket_bytes)
        spans = timing.group_spans_nodes(list(src.devices) + list(dst.devices), per_node)
        seconds = timing.weight_copy_seconds(hw, [r.max_bucket_bytes for r in plan.rounds], spans)
        record = sync_record(plan, model, src, dst, seconds)
        del plan
    return record, seconds


def check_weight_sync(plan: WeightSyncPlan, shape: JobShape, layout: Layout) -> list[str]:
    """The stage's spec: the kind matches the strategy; a DDMA record copies between the layout's own
    meshes, no rank sends or receives twice in a round, every bucket stays within the size limit, and
    the stored buckets add up to the summary's bytes."""
    gen_role = shape.generator
    expected = "none" if gen_role is None else ("in_place" if layout.strategy == "colocated" else "ddma")
    if plan.kind != expected:
        return [f"a {layout.strategy} layout{'' if gen_role else ' without a generator'} syncs weights "
                f"'{plan.kind}', not '{expected}'"]
    if not plan.seconds >= 0:
        return [f"predicted sync time {plan.seconds} s"]
    record = plan.record
    if plan.kind != "ddma":
        return [] if record is None else ["a record for a sync that is not DDMA"]
    assert record is not None
    train, gen = shape.policy_meshes(layout)
    problems = []
    if record.src != train:
        problems.append("the record's source mesh is not the trainer's mesh")
    if record.dst != gen:
        problems.append("the record's destination mesh is not the generator's mesh")
    if record.rounds is not None:
        wire = 0
        for k, round_ in enumerate(record.rounds):
            srcs, dsts = [b.src for b in round_], [b.dst for b in round_]
            if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
                problems.append(f"round {k}: a rank sends or receives twice")
            if any(b.num_bytes > record.bucket_bytes for b in round_):
                problems.append(f"round {k}: a bucket exceeds {record.bucket_bytes} bytes")
            wire += sum(b.num_bytes for b in round_)
        if wire != record.summary.total_bytes:
            problems.append(f"buckets hold {wire} bytes, the summary says {record.summary.total_bytes}")
        if record.group_rounds and sum(record.group_rounds) != len(record.rounds):
            problems.append(f"its staging groups hold {sum(record.group_rounds)} rounds, not {len(record.rounds)}")
    return problems


__all__ = ["WeightSyncPlan", "check_weight_sync", "ddma_record", "plan_policy_sync", "with_sync_timed"]
