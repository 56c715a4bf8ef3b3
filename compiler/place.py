"""The placement stage: search the layouts, keep the best ones and the baseline as the typed record the
later passes read (`PlacedLayout`). Refining the ranking by simulating the best candidates' programs is
its own pass in `compiler/pipeline.py`, which runs the pipeline's own program passes on each of them."""

from __future__ import annotations

import math
from types import MappingProxyType

from graphrl.ir import JobGraph
from graphrl.schemas.capabilities import Target
from graphrl.schemas.cluster import ClusterSpec
from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.program import CostKey

from graphrl.compiler.placed import Contender, PlacedLayout
from graphrl.compiler.candidates import make_problem
from graphrl.compiler.cost import layout_durations, lora_comparison
from graphrl.compiler.placement import search
from graphrl.compiler.to_layout import summaries, to_layout

# Candidates re-ranked by simulating their programs when the cluster is this small (the simulator
# sees queueing and pipelining that the analytical estimate does not); larger clusters keep the
# analytical ranking, since simulating thousands of candidates there would take minutes.
SIMULATE_RANKING_MAX_DEVICES = 16
SIMULATE_RANKING_TOP_K = 8


def place_job(graph: JobGraph, cluster: ClusterSpec, hardware: HardwareSpec, target: Target = "preview", *,
              exhaustive: bool = False, refine: bool = True) -> PlacedLayout:
    """Search layouts (for `target` 'run', only those the executors run); keep the best (and, on a small
    cluster with `refine`, the runners-up to simulate), the colocated-synchronous baseline and the
    candidate summaries."""
    problem = make_problem(graph, cluster, hardware, target)
    result = search(problem, exhaustive=exhaustive)
    best = result.best
    chosen = to_layout(problem, best)
    baseline = to_layout(problem, result.baseline) if result.baseline else None
    contenders: tuple[Contender, ...] = ()
    if refine and problem.num_devices <= SIMULATE_RANKING_MAX_DEVICES:
        contenders = tuple(
            Contender(layout, MappingProxyType(layout_durations(problem, ev, layout)), lora_comparison(problem, ev))
            for ev in result.ranked[:SIMULATE_RANKING_TOP_K] for layout in (to_layout(problem, ev),))
    return PlacedLayout(
        shape=problem.shape, ranking="analytical",
        chosen=chosen, durations=MappingProxyType(layout_durations(problem, best, chosen)),
        baseline=baseline, baseline_durations=MappingProxyType(layout_durations(problem, result.baseline, baseline))
        if result.baseline is not None and baseline is not None else None,
        candidates_considered=result.considered, candidates=tuple(summaries(result)), contenders=contenders,
        lora=lora_comparison(problem, best))


def check_placement(placed: PlacedLayout) -> list[str]:
    """The stage's spec: every role is placed once, on devices of the cluster, and its peak memory
    fits a device; some candidate was considered; each role's main instruction has a finite predicted
    duration."""
    layout, shape = placed.chosen, placed.shape
    problems = []
    roles = [p.role for p in layout.placements]
    expected = sorted(r.name for r in shape.roles)
    if sorted(roles) != expected:
        problems.append(f"placed roles {sorted(roles)}, the job has {expected}")
    for p in layout.placements:
        mesh = layout.role_mesh(p)
        if not set(mesh.devices) <= set(range(shape.num_devices)):
            problems.append(f"role {p.role} is placed on devices outside the cluster's {shape.num_devices}")
        if p.memory_bytes.total > placed.usable_bytes:
            problems.append(f"role {p.role} needs {p.memory_bytes.total:.3g} bytes per device, "
                            f"{placed.usable_bytes:.3g} are usable")
    if placed.candidates_considered < 1:
        problems.append("no candidate was considered")
    needed = {"train": "TrainStep", "infer": "Forward", "generate": "Generate"}
    for role in shape.roles:
        key = CostKey(needed[role.kind], role.name)
        if not 0 <= placed.durations.get(key, -1.0) < math.inf:
            problems.append(f"no finite predicted duration for {key}")
    return problems


__all__ = ["SIMULATE_RANKING_MAX_DEVICES", "SIMULATE_RANKING_TOP_K", "check_placement", "place_job"]
