"""`graphrl simulate`: the plan's own programs, and beside them (for a job compiled now) the same placement
scheduled `sync` and `async` and the colocated-synchronous baseline.

Every figure comes from simulating per-rank programs (graphrl.compiler.simulate). A plan file is
simulated exactly as it is, never recompiled; its programs are periodic, so the one window of the run
(`predicted_step`) gives the steady-state seconds per step, the same figure the plan's estimate holds,
and the whole run's time is that window's plus the remaining steps at the steady rate. The baseline's is
the plan's own estimate, made the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from graphrl.schemas.plan import Plan
from graphrl.schemas.program import Programs

from graphrl.compiler.pipeline import placed_programs
from graphrl.compiler.schedule import ProgramSettings
from graphrl.compiler.state import Compilation
from graphrl.compiler.preview import human_seconds
from graphrl.compiler.simulate import SimResult, predicted_step, text_gantt, window_steps, write_chrome_trace

TRACE_ALL_RANKS_UP_TO = 64


@dataclass
class SimReport:
    data: dict[str, Any]
    text: str


def _representatives(plan: Plan) -> dict[int, str]:
    names = {}
    for mesh in plan.chosen.meshes:
        names[mesh.devices[0]] = mesh.name
        if mesh.num_devices > 1:
            names[mesh.devices[-1]] = mesh.name
    return names


def simulate_window(programs: Programs, plan: Plan, trace_ranks: set[int] | None = None) -> tuple[SimResult, float]:
    """The simulated window of a run (`predicted_step`) and the predicted seconds of the whole run."""
    result = predicted_step(programs, hw=plan.hardware, devices_per_node=plan.cluster.devices_per_node,
                            trace_ranks=trace_ranks)
    return result, result.makespan_s + (programs.steps - window_steps(programs)) * result.step_time_s


def simulate_report(plan: Plan, *, compiled: Compilation | None = None, trace_path: Path | None = None,
                    gantt: bool = True, progress: Callable[[str], None] = lambda stage: None) -> SimReport:
    """Simulate `plan.programs`; with `compiled` (the compiled job the plan came from) also the same
    placement under the other schedule and the baseline layout. `progress` hears each stage."""
    if plan.programs is None:
        from graphrl.errors import PlanFileError

        raise PlanFileError("the plan has no programs to simulate", fix="compile it with `graphrl compile JOB -o plan.msgpack`")
    programs = plan.programs
    steps = programs.steps
    n = programs.num_ranks
    names = _representatives(plan)
    trace_ranks = set(range(n)) if n <= TRACE_ALL_RANKS_UP_TO else set(names)
    layout = plan.chosen

    def step_time(other: Programs) -> float:
        return simulate_window(other, plan)[0].step_time_s

    progress("the chosen programs")
    chosen, run_s = simulate_window(programs, plan, trace_ranks if (trace_path or gantt) else None)
    sync_s, async_s, baseline_s = chosen.step_time_s, None, None
    if compiled is not None:
        if layout.strategy == "disaggregated":
            # The chosen programs already run under the job's own schedule; build only the other one.
            other = "sync" if plan.job.schedule.mode == "async" else "async"
            progress(f"the same placement, {other}")
            other_s = step_time(placed_programs(compiled, ProgramSettings(steps, mode=other)))
            sync_s, async_s = (other_s, chosen.step_time_s) if other == "sync" else (chosen.step_time_s, other_s)
    if plan.baseline is not None:  # the plan's baseline estimate is its programs' steady state already
        baseline_s = plan.baseline.estimate.step_time_s
    busy = {}
    for mesh in layout.meshes:
        fractions = [chosen.busy_fraction[r] for r in mesh.devices]
        busy[mesh.name] = sum(fractions) / len(fractions)
    data = {
        "job": plan.job.name, "cluster": plan.cluster.name, "steps": steps, "strategy": layout.strategy,
        "label": layout.label, "mode": layout.estimate.mode,
        "step_time_s": chosen.step_time_s, "makespan_s": run_s, "simulated_steps": window_steps(programs),
        "baseline": None if baseline_s is None else {"label": plan.baseline.label, "step_time_s": baseline_s},
        "speedup": None if baseline_s is None else baseline_s / chosen.step_time_s,
        "sync_step_time_s": sync_s, "async_step_time_s": async_s,
        "busy_fraction": busy,
        "busy_fraction_per_rank": chosen.busy_fraction if n <= TRACE_ALL_RANKS_UP_TO else None,
    }
    lines = [f"job {plan.job.name} on {plan.cluster.name} ({n} devices), {steps} steps: "
             f"{window_steps(programs)} simulated, whole run {human_seconds(run_s)}",
             f"chosen:   {layout.label} [{layout.estimate.mode}]  {human_seconds(chosen.step_time_s)}/step"]
    if baseline_s is not None:
        lines.append(f"baseline: {plan.baseline.label} [sync]  {human_seconds(baseline_s)}/step   "
                     f"speed-up {baseline_s / chosen.step_time_s:.2f}x")
    if compiled is not None:
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

