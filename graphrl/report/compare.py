"""Prediction against measurement: the simulated spans of a plan's own programs, timed as a rank times
its own, and the error of a predicted figure against the measured one (per step, per phase).
"""

from __future__ import annotations

import statistics
from typing import Any

from graphrl.report.records import TimedSpan, metric_value
from graphrl.report.spans import phase_of
from graphrl.schemas.plan import Plan
from graphrl.schemas.program import PHASES

def simulated_spans(plan: Plan) -> list[TimedSpan]:
    """Every rank's instruction spans as the simulator predicts them: the plan's own programs over the one
    window its predicted step time is measured over (`predicted_step`)."""
    from graphrl.compiler.simulate import predicted_step

    assert plan.programs is not None
    result = predicted_step(plan.programs, hw=plan.hardware, devices_per_node=plan.cluster.devices_per_node,
                            trace_ranks=set(range(plan.programs.num_ranks)))
    return as_measured([TimedSpan(s.rank, s.name, s.category, s.start, s.end - s.start) for s in result.spans])


def as_measured(spans: list[TimedSpan]) -> list[TimedSpan]:
    """Simulated spans as a rank measures its own: an instruction that waits for its peers (a receive, a
    collective) is timed from the moment the rank reaches it, so the wait is inside its span. The
    simulator starts it when the peers are there; here it starts where the rank's previous span ended
    (an instruction that waits for nobody starts there anyway)."""
    out: list[TimedSpan] = []
    previous_end: dict[int, float] = {}
    for s in sorted(spans, key=lambda s: (s.rank, s.start_s)):
        start = min(s.start_s, previous_end.get(s.rank, s.start_s))
        out.append(TimedSpan(s.rank, s.name, s.kind, start, s.start_s + s.dur_s - start))
        previous_end[s.rank] = s.start_s + s.dur_s
    return out


def seconds_per_phase(kind_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per phase, in `PHASES` order: the sums of its kinds' predicted and measured seconds per step (None
    where none of its kinds has that side), the error, and the kinds summed. Phases with neither are left
    out."""
    rows = []
    for phase in PHASES:
        mine = [r for r in kind_rows if phase_of(r["kind"]) == phase]
        sums = {}
        for side in ("predicted_s", "measured_s"):
            values = [r[side] for r in mine if r[side] is not None]
            sums[side] = sum(values) if values else None
        if sums["predicted_s"] is None and sums["measured_s"] is None:
            continue
        rows.append({"phase": phase, **sums, "error_pct": error_pct(sums["predicted_s"], sums["measured_s"]),
                     "kinds": sorted(r["kind"] for r in mine)})
    return rows


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured in percent: negative when the prediction is too optimistic."""
    if predicted is None or measured is None or measured <= 0:
        return None
    return 100.0 * (predicted - measured) / measured


def median_step_time(metrics: list[dict[str, Any]], warmup_steps: int = 1) -> tuple[float | None, list[int]]:
    """The median `step_time_s` of the metrics rows after the first `warmup_steps` (of all rows when no later
    one exists), and the steps it is taken over. A median, so that one slow step (a checkpoint, another
    process on the machine) does not move a short run's figure."""
    kept = metrics[warmup_steps:] if len(metrics) > warmup_steps else metrics
    timed = [(row["step"], value) for row in kept if (value := metric_value(row, "step_time_s")) is not None]
    if not timed:
        return None, []
    return statistics.median(value for _, value in timed), [step for step, _ in timed]
