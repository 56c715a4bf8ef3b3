"""Building a run report: reads a run folder, simulates its plan, and computes every figure of the
report into one JSON-compatible `Report.data`, which the text and HTML views only lay out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphrl.errors import RunError
from graphrl.report.compare import error_pct, median_step_time, seconds_per_phase, simulated_spans
from graphrl.report.formatting import clip
from graphrl.report.page import render_html
from graphrl.report.records import (
    MACHINE_SPEED_FILE,
    METRICS_FILE,
    PLAN_FILE,
    SAMPLES_FILE,
    TIMELINE_FILE,
    metric_value,
    read_machine_speed,
    read_metrics,
    read_samples,
    read_timeline,
)
from graphrl.report.spans import busy_fractions, seconds_per_kind, steady_spans
from graphrl.report.text import render_text
from graphrl.schemas.plan import Plan


def build_report(run_dir: str | Path, *, warmup_steps: int = 1) -> Report:
    """Read a run folder and compute every figure of the report. Raises RunError for a missing folder or a
    missing, empty or corrupted metrics.jsonl or timeline.json (naming the file and line), PlanFileError
    for a corrupted plan.msgpack."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "is not a folder" if run_dir.exists() else "does not exist"
        raise RunError(f"run folder {run_dir} {what}",
                       fix="pass the folder given to `graphrl run --out` (default runs/<job name>)")
    assert warmup_steps >= 0, "warmup_steps counts steps"
    metrics, notes = read_metrics(run_dir / METRICS_FILE)

    plan: Plan | None = None
    if (run_dir / PLAN_FILE).exists():
        from graphrl.compiler.verify import runnable_plan
        from graphrl.plan_io import load_plan

        plan = runnable_plan(load_plan(run_dir / PLAN_FILE), str(run_dir / PLAN_FILE))
    else:
        notes.append(f"no {PLAN_FILE} in the run folder: nothing to compare the measurements with")
    measured = read_timeline(run_dir / TIMELINE_FILE) if (run_dir / TIMELINE_FILE).exists() else None
    if measured is None:
        notes.append(f"no {TIMELINE_FILE} in the run folder: no measured time per instruction kind, and the busy "
                     "fractions are the simulator's")
    predicted = simulated_spans(plan) if plan is not None and plan.programs is not None else None
    if plan is not None and plan.programs is None:
        notes.append(f"{PLAN_FILE} has no programs: no simulated instruction spans")

    # Seconds per step, predicted against measured.
    predicted_step_s = plan.chosen.estimate.step_time_s if plan is not None else None
    warm = {row["step"] for row in metrics[:warmup_steps]} if len(metrics) > warmup_steps else set()
    step_rows = []
    for row in metrics:
        measured_s = metric_value(row, "step_time_s")
        step_rows.append({"step": row["step"], "measured_s": measured_s, "predicted_s": predicted_step_s,
                          "error_pct": error_pct(predicted_step_s, measured_s), "warmup": row["step"] in warm})
    # the measured step time is one figure everywhere: the median after warm-up, as `graphrl run` says it
    measured_step_s, steady_steps = median_step_time(metrics, warmup_steps)
    steady_metrics = [row for row in metrics if row["step"] not in warm]

    # Time per instruction kind.
    steady_of = {source: steady_spans(spans, warmup_steps)
                 for source, spans in (("predicted", predicted), ("measured", measured)) if spans is not None}
    kinds: dict[str, dict[str, Any]] = {}
    for source, (kept, steps) in steady_of.items():
        for kind, seconds in seconds_per_kind(kept, len(steps)).items():
            kinds.setdefault(kind, {"kind": kind, "predicted_s": None, "measured_s": None})[f"{source}_s"] = seconds
    kind_rows = sorted(kinds.values(), key=lambda r: -max(r["predicted_s"] or 0.0, r["measured_s"] or 0.0))
    for r in kind_rows:
        r["error_pct"] = error_pct(r["predicted_s"], r["measured_s"])
    phase_rows = seconds_per_phase(kind_rows)
    episodes = episode_figures(steady_metrics or metrics, plan)
    if episodes is not None:  # the environment's share of generation, predicted against measured
        at = next((i + 1 for i, row in enumerate(phase_rows) if row["phase"] == "generate"), len(phase_rows))
        phase_rows.insert(at, {"phase": "  of which the environment", "predicted_s": episodes["predicted_env_s"],
                               "measured_s": episodes["measured_env_s"],
                               "error_pct": error_pct(episodes["predicted_env_s"], episodes["measured_env_s"]),
                               "kinds": ["Generate (waiting for environments)"]})

    # Busy fraction per rank.
    num_ranks = (plan.programs.num_ranks if plan is not None and plan.programs is not None
                 else 1 + max((s.rank for s in measured or []), default=-1))
    mesh_of = {}
    if plan is not None:
        for mesh in plan.chosen.meshes:
            for r in mesh.devices:
                mesh_of[r] = mesh.name
    busy_measured = busy_fractions(steady_of["measured"][0], num_ranks) if "measured" in steady_of else None
    busy_predicted = busy_fractions(steady_of["predicted"][0], num_ranks) if "predicted" in steady_of else None
    busy_rows = [{"rank": r, "mesh": mesh_of.get(r, "-"),
                  "measured": busy_measured[r] if busy_measured is not None else None,
                  "simulated": busy_predicted[r] if busy_predicted is not None else None} for r in range(num_ranks)]
    busy_meshes = []
    for name in dict.fromkeys(row["mesh"] for row in busy_rows):
        rows = [row for row in busy_rows if row["mesh"] == name]
        busy_meshes.append({"mesh": name, "num_ranks": len(rows), "measured": _mean(r["measured"] for r in rows),
                            "simulated": _mean(r["simulated"] for r in rows)})

    first, last = metrics[0], metrics[-1]
    summary = {
        "steps": len(metrics), "first_step": first["step"], "last_step": last["step"],
        "steady_steps": len(steady_steps),
        "reward_first": metric_value(first, "reward_mean"), "reward_last": metric_value(last, "reward_mean"),
        "reward_best": max((v for v in (metric_value(r, "reward_mean") for r in metrics) if v is not None), default=None),
        "loss_last": metric_value(last, "loss"), "kl_last": metric_value(last, "kl"),
        "measured_step_time_s": measured_step_s, "predicted_step_time_s": predicted_step_s,
        "step_time_error_pct": error_pct(predicted_step_s, measured_step_s),
        "tokens_per_s": _mean(metric_value(r, "tokens_per_s") for r in steady_metrics),
        "wall_s": sum(r["measured_s"] or 0.0 for r in step_rows),
        "machine_speed": read_machine_speed(run_dir / MACHINE_SPEED_FILE, notes),
    }
    data: dict[str, Any] = {
        "run_dir": str(run_dir),
        "job": plan.job.name if plan is not None else None,
        "cluster": plan.cluster.name if plan is not None else None,
        "hardware": plan.hardware.name if plan is not None else None,
        "label": plan.chosen.label if plan is not None else None,
        "mode": plan.chosen.estimate.mode if plan is not None else None,
        "estimate_method": plan.chosen.estimate.method if plan is not None else None,
        "num_ranks": num_ranks,
        "files": {"metrics": True, "plan": plan is not None, "timeline": measured is not None},
        "warmup_steps": warmup_steps if warm else 0,
        "summary": summary,
        "metrics": metrics,
        "step_times": step_rows,
        "kinds": {"rows": kind_rows, "measured": measured is not None, "predicted": predicted is not None,
                  "steps_averaged": {k: len(steps) for k, (_, steps) in steady_of.items()}},
        "phases": {"rows": phase_rows},
        "episodes": episodes,
        "busy": {"source": "measured" if measured is not None else "simulated" if predicted is not None else None,
                 "ranks": busy_rows, "meshes": busy_meshes},
        "notes": notes,
        "samples": [{**row, "prompt_short": clip(row["prompt"], tail=True), "response_short": clip(row["response"])}
                    for row in read_samples(run_dir / SAMPLES_FILE)],
    }
    return Report(data)


@dataclass
class Report:
    """A run report: `data` (JSON-compatible) and its two views."""

    data: dict[str, Any]

    def render_html(self) -> str:
        """A self-contained page: inline styles and SVG; no scripts, stylesheets or fonts from elsewhere."""
        return render_html(self.data)

    def render_text(self, width: int = 120) -> str:
        """The same tables for a terminal (plain text, no colour codes)."""
        return render_text(self.data, width)


# The episode figures of metrics.jsonl the report shows (a step's mean or count), and what each means.
EPISODE_FIGURES = (("turns_mean", "model turns per episode"), ("model_tokens_mean", "model tokens per episode"),
                   ("env_tokens_mean", "environment tokens per episode"),
                   ("env_reward_mean", "environment reward per episode"),
                   ("env_final_reward_mean", "reward of an episode's last turn"), ("tool_calls", "tool calls per step"),
                   ("tool_errors", "tool errors per step"), ("env_seconds", "environment seconds per step (all calls)"),
                   ("env_wait_s", "seconds per step generation waited for environments"))


def episode_figures(rows: list[dict[str, Any]], plan: Plan | None) -> dict[str, Any] | None:
    """A run's episodes (a generate node with an environment), over `rows` (the steady steps): each figure's
    mean per step, how many episodes ended for each reason, and the environment's time per step predicted (the
    plan's) against measured (the median of env_wait_s)."""
    rows = [row for row in rows if "turns_mean" in row]
    if not rows:
        return None
    from graphrl.ops import END_REASONS

    figures = [{"name": name, "means": means, "value": _mean(metric_value(r, name) for r in rows)}
               for name, means in EPISODE_FIGURES]
    ends = {reason: sum(metric_value(r, f"episodes_{reason}") or 0.0 for r in rows) for reason in END_REASONS}
    waits = sorted(v for r in rows if (v := metric_value(r, "env_wait_s")) is not None)
    return {"figures": figures, "ends": {k: int(v) for k, v in ends.items() if v}, "steps": len(rows),
            "predicted_env_s": plan.chosen.estimate.environment_s if plan is not None else None,
            "measured_env_s": waits[len(waits) // 2] if waits else None}


def _mean(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None
