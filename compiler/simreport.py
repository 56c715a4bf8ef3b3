"""`graphrl simulate`: the chosen plan against the colocated-synchronous baseline, and sync against async.

All figures come from simulating the per-rank programs (graphrl.compiler.simulate): the chosen plan's
own programs, the same placement scheduled `sync` and `async`, and the baseline layout's programs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphrl.loader import LoadedJob, SourceMap
from graphrl.schemas.plan import Plan

from graphrl.compiler.compile import compile_graph
from graphrl.compiler.preview import human_seconds
from graphrl.compiler.schedule import build_programs
from graphrl.compiler.simulate import SimResult, run_programs, text_gantt, write_chrome_trace

TRACE_ALL_RANKS_UP_TO = 64


@dataclass
class SimReport:
    data: dict[str, Any]
    text: str


def _representatives(plan: Plan) -> dict[int, str]:
    names = {}
    for mesh in plan.chosen.meshes:
        names[mesh.first_device] = mesh.name
        if mesh.num_devices > 1:
            names[mesh.first_device + mesh.num_devices - 1] = mesh.name
    return names


def simulate_report(plan: Plan, *, trace_path: Path | None = None, gantt: bool = True) -> SimReport:
    steps = plan.programs.steps if plan.programs is not None else plan.job.schedule.steps
    graph = compile_graph(LoadedJob(plan.job, SourceMap(None), None), plan.cluster, steps=steps)
    pl = graph["placement"]
    problem = pl["problem"]
    hw, per_node = problem.hw, problem.per_node
    n = problem.num_devices
    names = _representatives(plan)
    trace_ranks = set(range(n)) if n <= TRACE_ALL_RANKS_UP_TO else set(names)

    def run(programs, trace: bool = False) -> SimResult:  # noqa: ANN001
        return run_programs(programs, hw=hw, devices_per_node=per_node, timed=True,
                            trace_ranks=trace_ranks if trace else None)

    chosen = run(graph["programs"], trace=bool(trace_path) or gantt)
    ev, layout = pl["chosen_eval"], pl["chosen"]
    if layout.strategy == "disaggregated":
        sync = run(build_programs(graph, problem, ev, layout, steps=steps, mode="sync"))
        async_ = run(build_programs(graph, problem, ev, layout, steps=steps, mode="async"))
        sync_s, async_s = sync.step_time_s, async_.step_time_s
    else:
        sync_s, async_s = chosen.step_time_s, None
    baseline_s = None
    if pl["baseline_eval"] is not None:
        base = run(build_programs(graph, problem, pl["baseline_eval"], pl["baseline"], steps=steps, mode="sync"))
        baseline_s = base.step_time_s
    busy = {}
    for mesh in layout.meshes:
        fractions = [chosen.busy_fraction[r] for r in mesh.devices]
        busy[mesh.name] = sum(fractions) / len(fractions)
    data = {
        "job": plan.job.name, "cluster": plan.cluster.name, "steps": steps, "strategy": layout.strategy,
        "label": layout.label, "mode": layout.estimate.mode,
        "step_time_s": chosen.step_time_s, "makespan_s": chosen.makespan_s,
        "analytical_step_time_s": plan.chosen.estimate.step_time_s if plan.chosen.estimate.method == "analytical" else None,
        "baseline": None if baseline_s is None else {"label": pl["baseline"].label, "step_time_s": baseline_s},
        "speedup": None if baseline_s is None else baseline_s / chosen.step_time_s,
        "sync_step_time_s": sync_s, "async_step_time_s": async_s,
        "busy_fraction": busy,
        "busy_fraction_per_rank": chosen.busy_fraction if n <= TRACE_ALL_RANKS_UP_TO else None,
    }
    lines = [f"job {plan.job.name} on {plan.cluster.name} ({n} devices), {steps} steps simulated",
             f"chosen:   {layout.label} [{layout.estimate.mode}]  {human_seconds(chosen.step_time_s)}/step"]
    if baseline_s is not None:
        lines.append(f"baseline: {pl['baseline'].label} [sync]  {human_seconds(baseline_s)}/step   "
                     f"speed-up {baseline_s / chosen.step_time_s:.2f}x")
    lines.append(f"same placement, sync:  {human_seconds(sync_s)}/step" +
                 (f"   async (max_staleness {plan.job.schedule.max_staleness}): {human_seconds(async_s)}/step   "
                  f"async speed-up {sync_s / async_s:.2f}x" if async_s else "   (colocated: async does not apply)"))
    lines.append("busy fraction: " + ", ".join(f"{k} {v:.0%}" for k, v in busy.items()))
    if trace_path is not None:
        write_chrome_trace(chosen, trace_path, names)
        lines.append(f"wrote {trace_path} (open in https://ui.perfetto.dev)")
    if gantt:
        lines.append("")
        lines.append(text_gantt(chosen, sorted(names), names=names))
    return SimReport(data, "\n".join(lines))
