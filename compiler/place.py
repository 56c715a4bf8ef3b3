"""The cost-annotation and placement passes (the stages after placement are in offload.py, reshard.py,
weight_sync.py, schedule.py, lower.py and verify.py)."""

from __future__ import annotations

import math
from types import MappingProxyType

from graphrl.ir import JobGraph
from graphrl.schemas.program import CostKey

from graphrl.compiler import cost
from graphrl.compiler.passes import CompileContext, compiler_pass
from graphrl.compiler.placed import PlacedLayout
from graphrl.compiler.placement import Evaluated, Problem, layout_durations, make_problem, search, summaries, to_layout
from graphrl.compiler.roles import derive_roles, derive_workload
from graphrl.compiler.programs import build_programs
from graphrl.compiler.simulate import run_programs

# Candidates re-ranked by simulating their programs when the cluster is this small (the simulator
# sees queueing and pipelining that the analytical estimate does not); larger clusters keep the
# analytical ranking, since simulating thousands of candidates there would take minutes.
SIMULATE_RANKING_MAX_DEVICES = 16
SIMULATE_RANKING_TOP_K = 8
SIMULATE_RANKING_STEPS = 6


@compiler_pass("annotate_costs", requires=("types",), ensures=("costs",))
def annotate_costs(graph: JobGraph, ctx: CompileContext) -> JobGraph:
    """Per role: parameter count and FLOPs of one step's work (the inputs of placement)."""
    work = derive_workload(graph)
    costs = {}
    for role in derive_roles(graph):
        if role.kind == "train":
            flops = cost.train_flops(role.dims, work.tokens, work.seq_len, recompute=False) * work.updates_per_step
        else:
            flops = cost.forward_flops_per_token(role.dims, cost.causal_mean_context(work.seq_len)) * work.tokens
        costs[role.name] = MappingProxyType({"params": cost.param_count(role.dims), "flops_per_step": flops})
    return graph.with_attr("costs", MappingProxyType(costs))


def simulated_step_time(graph: JobGraph, problem: Problem, ev: Evaluated, steps: int) -> float:
    layout = to_layout(problem, ev)
    programs = build_programs(graph, problem.shape, layout, layout_durations(problem, ev, layout), steps=steps,
                              checkpoint_every=0)
    return run_programs(programs, hw=problem.hw, devices_per_node=problem.per_node, timed=True).step_time_s


def _with_estimate(layout, seconds: float):  # noqa: ANN001, ANN202
    estimate = layout.estimate.model_copy(update={"step_time_s": seconds, "method": "simulated"})
    return layout.model_copy(update={"estimate": estimate})


def check_placement(graph: JobGraph) -> list[str]:
    """The stage's spec: every role is placed once, on devices of the cluster, and its peak memory
    fits a device; some candidate was considered; each role's main instruction has a finite predicted
    duration."""
    placed: PlacedLayout = graph["placement"]
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


@compiler_pass("placement", requires=("types", "costs"), ensures=("placement",), spec=check_placement)
def place(graph: JobGraph, ctx: CompileContext) -> JobGraph:
    """Search layouts; keep the best, the colocated-synchronous baseline and the candidate summaries."""
    assert ctx.cluster is not None and ctx.hardware is not None
    problem = make_problem(graph, ctx.cluster, ctx.hardware, ctx.target)
    result = search(problem, exhaustive=bool(ctx.options.get("exhaustive", False)))
    best, method = result.best, "analytical"
    chosen = to_layout(problem, best)
    baseline = to_layout(problem, result.baseline) if result.baseline else None
    if problem.num_devices <= SIMULATE_RANKING_MAX_DEVICES and not ctx.options.get("analytical_only"):
        scored = []
        for ev in result.ranked[:SIMULATE_RANKING_TOP_K]:
            scored.append((simulated_step_time(graph, problem, ev, SIMULATE_RANKING_STEPS), ev.label, ev))
        seconds, _, best = min(scored, key=lambda x: (x[0], x[1]))
        method = "simulated"
        chosen = _with_estimate(to_layout(problem, best), seconds)
        if result.baseline is not None:
            baseline = _with_estimate(baseline, simulated_step_time(graph, problem, result.baseline, SIMULATE_RANKING_STEPS))
    placed = PlacedLayout(
        shape=problem.shape, ranking=method,
        chosen=chosen, durations=MappingProxyType(layout_durations(problem, best, chosen)),
        baseline=baseline, baseline_durations=MappingProxyType(layout_durations(problem, result.baseline, baseline))
        if result.baseline is not None and baseline is not None else None,
        candidates_considered=result.considered, candidates=tuple(summaries(result)))
    return graph.with_attr("placement", placed)


__all__ = ["annotate_costs", "check_placement", "place"]
