"""The stages after placement as one call: offload -> reshard -> weight sync -> schedule -> lower.

The pipeline runs them as separate passes (compiler/pipeline.py); the search's simulated ranking, the
baseline's programs, `graphrl simulate`'s sync/async comparison and the benchmarks need the same
programs for other layouts, modes or run lengths, and get them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from graphrl.ir import JobGraph
from graphrl.schemas.plan import Layout
from graphrl.schemas.program import CostKey, Programs

from graphrl.compiler.lower import lower_schedule, predicted_durations
from graphrl.compiler.offload import OffloadPlan, plan_offload
from graphrl.compiler.reshard import ReshardPlan, plan_reshard
from graphrl.compiler.roles import JobShape
from graphrl.compiler.schedule import build_schedule
from graphrl.compiler.weight_sync import WeightSyncPlan, plan_policy_sync


@dataclass(frozen=True)
class Stages:
    """What the offload, reshard and weight-sync stages decide for one layout (independent of the run's
    length and mode)."""

    offload: OffloadPlan
    reshard: ReshardPlan
    weight_sync: WeightSyncPlan


def plan_stages(graph: JobGraph, shape: JobShape, layout: Layout, durations: Mapping[CostKey, float]) -> Stages:
    train, gen = shape.policy_meshes(layout)
    group = next(n for n in graph.nodes() if n.op == "generate").spec.samples_per_prompt
    w = shape.workload
    return Stages(plan_offload(layout), plan_reshard(gen, train, w.responses, group, w.seq_len),
                  plan_policy_sync(shape, layout, durations))


def build_programs(graph: JobGraph, shape: JobShape, layout: Layout, durations: Mapping[CostKey, float], *,
                   steps: int, mode: str | None = None, checkpoint_every: int | None = None,
                   periodic: bool = True) -> Programs:
    """The job's programs on `layout` (with placement's predicted `durations` for it) for a run of
    `steps` steps: periodic (one loop per rank, whose size does not depend on `steps`), or with
    `periodic=False` the whole run unrolled (the reference the periodic form is checked against)."""
    s = plan_stages(graph, shape, layout, durations)
    schedule = build_schedule(graph, shape, layout, s.offload, s.reshard, s.weight_sync, steps=steps, mode=mode,
                              checkpoint_every=checkpoint_every, periodic=periodic)
    return lower_schedule(schedule, s.weight_sync, predicted_durations(durations, s.weight_sync))


__all__ = ["Stages", "build_programs", "plan_stages"]
