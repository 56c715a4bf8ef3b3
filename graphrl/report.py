"""Run report: what a run did against what the compiler predicted, as a terminal summary or one HTML page.

A run folder (`graphrl run --out DIR`) holds `metrics.jsonl` (one row per RL step), `plan.msgpack` (the
compiled plan) and, when the ranks recorded their spans, `timeline.json` (a Chrome trace of measured
instruction spans). The report reads the three, simulates the plan's programs (the same simulator as
`graphrl simulate`), and puts prediction beside measurement:

- curves of reward, loss, KL and seconds per step over the steps;
- seconds per step, predicted (`plan.chosen.estimate.step_time_s`) against measured (metrics), with the error;
- seconds per step spent in each instruction kind, on a rank that runs it: simulated spans against
  measured spans (timeline.json only);
- the same per phase of an RL step (`PHASES`: generate, logprob, ... ; a kind's phase is its
  `TRAITS[...].phase`), each phase the sum of its kinds' rows;
- each rank's busy fraction, measured (timeline.json) and simulated.

The first `warmup_steps` steps (model set-up, allocator and kernel warm-up) are left out of every average
and marked as such; the simulator has no warm-up, so including them would only measure start-up.

`build_report` returns a `Report` whose `data` is JSON-compatible; `render_text` and `render_html` show
the same tables. Every figure is computed here; the template only lays them out.
"""

from __future__ import annotations

import io
import json
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import jinja2
from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from graphrl.compiler.preview import human_seconds
from graphrl.errors import Location, RunError
from graphrl.schemas.plan import Plan
from graphrl.schemas.program import INSTRUCTION_TYPES, PHASES, TRAITS

METRICS_FILE = "metrics.jsonl"
PLAN_FILE = "plan.msgpack"
TIMELINE_FILE = "timeline.json"
MACHINE_SPEED_FILE = "machine_speed.json"  # `graphrl run` on a calibrated machine: its speed against the calibration
SAMPLES_FILE = "samples.jsonl"
SAMPLE_STEPS_SHOWN = 3  # the first and the last steps' samples: what the policy said before and after training
SAMPLE_TEXT_CHARS = 160

# Metrics the report reads; other keys (entropy, clip_frac, ...) are kept in `data["metrics"]` as they are.
NUMERIC_KEYS = ("reward_mean", "loss", "kl", "step_time_s", "tokens_per_s", "weight_version")

# The simulator closes a Send/Recv rendezvous on both ranks with the instruction that completed it, so
# its Send and Recv spans are not told apart per rank; both sides are compared as one kind.
KIND_ALIASES = {"Send": "Send/Recv", "Recv": "Send/Recv"}

# Each kind the report names (an instruction type, or an alias above) -> the phase of an RL step it counts to.
PHASE_OF_KIND: dict[str, str] = {name: TRAITS[cls].phase for name, cls in INSTRUCTION_TYPES.items()}
PHASE_OF_KIND.update({alias: PHASE_OF_KIND[name] for name, alias in KIND_ALIASES.items()})
assert all(PHASE_OF_KIND[alias] == PHASE_OF_KIND[name] for name, alias in KIND_ALIASES.items()), \
    "the kinds one row joins count to one phase"

# Past this error the page marks a prediction in red.
ERROR_PCT_FLAG = 25.0

# Tables of long runs show the first and last steps; every step stays in `data`.
STEP_ROWS_HEAD, STEP_ROWS_TAIL = 10, 30
# Past this many ranks the busy table shows one row per mesh.
MAX_RANK_ROWS = 64

_STEP_IN_LABEL = re.compile(r"\bstep=(-?\d+)")
_VERSION_IN_LABEL = re.compile(r"\bv=(-?\d+)")


@dataclass(frozen=True)
class TimedSpan:
    """One instruction on one rank: measured (timeline.json) or predicted (simulator), in seconds."""

    rank: int
    name: str  # the instruction's label, e.g. `Generate step=3 v=2`
    kind: str  # the instruction type, e.g. `Generate`
    start_s: float
    dur_s: float

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s


# ------------------------------------------------------------------------------------------------
# Reading the run folder


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of `metrics.jsonl` sorted by step, and notes. A repeated step (a resumed run re-ran it) keeps
    its last row. Raises RunError naming the file and line of the first bad row."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RunError(f"no {path.name} in the run folder", location=Location(str(path)),
                       fix="the run wrote no metrics: pass the folder given to `graphrl run --out`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunError(f"cannot read {path.name}: {exc}", location=Location(str(path)), fix="check the file") from None
    by_step: dict[int, dict[str, Any]] = {}
    repeated: list[int] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = Location(str(path), number)
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RunError(f"line is not JSON ({exc.msg} at column {exc.colno})", location=where,
                           fix="a run that was killed mid-write leaves a partial last line; delete that line") from None
        if not isinstance(row, dict):
            raise RunError(f"a metrics row must be a JSON object, not {type(row).__name__}", location=where,
                           fix="each line holds one step's metrics as {\"step\": ..., ...}")
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise RunError(f"a metrics row needs \"step\", a non-negative integer (got {step!r})", location=where,
                           path=("step",), fix="each line holds one step's metrics as {\"step\": ..., ...}")
        for key in NUMERIC_KEYS:
            value = row.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise RunError(f"{key} must be a number (got {value!r})", location=where, path=(key,),
                               fix="the metrics file is corrupted; rerun the step or delete the line")
        if step in by_step:
            repeated.append(step)
        by_step[step] = row
    if not by_step:
        raise RunError(f"{path.name} is empty: the run finished no step", location=Location(str(path)),
                       fix="run at least one step (graphrl run JOB --steps N --out DIR)")
    notes = []
    if repeated:
        shown = ", ".join(map(str, sorted(set(repeated))[:8])) + (" ..." if len(set(repeated)) > 8 else "")
        notes.append(f"steps {shown} appear more than once in {path.name} (a resumed run); the last row of each is used")
    return [by_step[s] for s in sorted(by_step)], notes


def _event_error(path: Path, index: int, field_name: str, message: str) -> RunError:
    return RunError(message, location=Location(str(path)), path=("traceEvents", index, field_name),
                    fix="timeline.json is written by `graphrl run`; rerun, or delete the file to report without it")


def read_timeline(path: Path) -> list[TimedSpan]:
    """The complete ("X") events of a Chrome trace as spans in seconds; other events (names, flows) are
    skipped. Raises RunError naming the file (and line and column, or the event) of a bad entry."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RunError(f"not JSON ({exc.msg})", location=Location(str(path), exc.lineno, exc.colno),
                       fix="timeline.json is written by `graphrl run`; rerun, or delete the file to report without it") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunError(f"cannot read {path.name}: {exc}", location=Location(str(path)), fix="check the file") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data if isinstance(data, list) else None
    if not isinstance(events, list):
        raise RunError("not a Chrome trace: expected {\"traceEvents\": [...]}", location=Location(str(path)),
                       fix="timeline.json is written by `graphrl run`; rerun, or delete the file to report without it")
    spans = []
    for i, event in enumerate(events):
        if not isinstance(event, dict):
            raise _event_error(path, i, "ph", f"event {i} is not an object")
        if event.get("ph") != "X":
            continue
        for key in ("pid", "ts", "dur"):
            value = event.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise _event_error(path, i, key, f"event {i} needs a numeric {key!r} (got {value!r})")
        if event["dur"] < 0:
            raise _event_error(path, i, "dur", f"event {i} has a negative duration ({event['dur']})")
        name = str(event.get("name", ""))
        kind = str(event.get("cat") or name.split(" ", 1)[0])
        spans.append(TimedSpan(int(event["pid"]), name, kind, event["ts"] / 1e6, event["dur"] / 1e6))
    return spans


# Steps of a long run's programs simulated for the predicted side of a report (a steady state, not the run).
REPORT_SIMULATED_ITERATIONS = 64


def simulated_spans(plan: Plan) -> list[TimedSpan]:
    """Every rank's instruction spans as the simulator predicts them (the plan's own programs)."""
    from graphrl.compiler.simulate import run_programs

    programs = plan.programs.with_steps(plan.programs.window_steps(REPORT_SIMULATED_ITERATIONS))
    result = run_programs(programs, hw=plan.hardware, devices_per_node=plan.cluster.devices_per_node, timed=True,
                          trace_ranks=set(range(programs.num_ranks)))
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


# ------------------------------------------------------------------------------------------------
# Figures from spans (the same functions for measured and simulated spans, so they compare)


def attribute_steps(spans: list[TimedSpan]) -> list[int | None]:
    """The RL step of each span, from its label: `step=k`; else a weight version `v=k` (the weights
    step k generates with in a synchronous schedule); else the step of the span before it on its rank
    (or after it, for the first spans of a rank). None only when a rank's labels carry no step at all."""
    steps: list[int | None] = [None] * len(spans)
    by_rank: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(spans):
        by_rank[s.rank].append(i)
    for indices in by_rank.values():
        indices.sort(key=lambda i: spans[i].start_s)
        last: int | None = None
        leading: list[int] = []
        for i in indices:
            match = _STEP_IN_LABEL.search(spans[i].name) or _VERSION_IN_LABEL.search(spans[i].name)
            if match:
                last = int(match.group(1))
                for j in leading:
                    steps[j] = last
                leading = []
            elif last is None:
                leading.append(i)
            steps[i] = last
    return steps


def steady_spans(spans: list[TimedSpan], warmup_steps: int) -> tuple[list[TimedSpan], list[int]]:
    """The spans of the steps after the first `warmup_steps` (all spans when no later step exists), and
    those steps."""
    steps = attribute_steps(spans)
    known = sorted({s for s in steps if s is not None})
    kept_steps = known[warmup_steps:] or known
    keep = set(kept_steps)
    return [sp for sp, st in zip(spans, steps) if st in keep], kept_steps


def seconds_per_kind(spans: list[TimedSpan], num_steps: int) -> dict[str, float]:
    """Seconds per step in each instruction kind on a rank that runs it (averaged over those ranks)."""
    per_rank: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for s in spans:
        per_rank[KIND_ALIASES.get(s.kind, s.kind)][s.rank] += s.dur_s
    steps = max(num_steps, 1)
    return {kind: sum(ranks.values()) / len(ranks) / steps for kind, ranks in per_rank.items()}


def phase_of(kind: str) -> str:
    """The phase of an RL step a span's kind counts to (`TRAITS[...].phase`); "other" for a name that is no
    instruction kind (a span a rank records around something else)."""
    return PHASE_OF_KIND.get(kind, "other")


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


def busy_fractions(spans: list[TimedSpan], num_ranks: int) -> list[float]:
    """Each rank's share of the window from the first span's start to the last span's end (any rank)
    that it spends inside some span (overlapping spans count once)."""
    if not spans:
        return [0.0] * num_ranks
    t0 = min(s.start_s for s in spans)
    window = max(s.end_s for s in spans) - t0
    intervals: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for s in spans:
        intervals[s.rank].append((s.start_s, s.end_s))
    out = []
    for rank in range(num_ranks):
        covered, reach = 0.0, -math.inf
        for start, end in sorted(intervals.get(rank, [])):
            if end > reach:
                covered += end - max(start, reach)
                reach = end
        out.append(covered / window if window > 0 else 0.0)
    return out


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
    timed = [(row["step"], value) for row in kept if (value := _number(row, "step_time_s")) is not None]
    if not timed:
        return None, []
    return statistics.median(value for _, value in timed), [step for step, _ in timed]


def _mean(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def _number(row: dict[str, Any], key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


# ------------------------------------------------------------------------------------------------
# The report


def read_samples(path: Path) -> list[dict[str, Any]]:
    """The rollouts of the first and last steps in samples.jsonl; a damaged line is skipped (the run may
    still be writing it)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and {"step", "prompt", "response", "reward"} <= row.keys():
            rows.append(row)
    steps = sorted({row["step"] for row in rows})
    shown = set(steps[:1] + steps[-(SAMPLE_STEPS_SHOWN - 1):]) if steps else set()
    return [row for row in rows if row["step"] in shown]


def _clip(text: str, chars: int = SAMPLE_TEXT_CHARS, tail: bool = False) -> str:
    """One line of at most `chars` characters; prompts keep their end (the question), responses their start."""
    flat = " ".join(str(text).split())
    if len(flat) <= chars:
        return flat
    return "..." + flat[-chars + 3:] if tail else flat[:chars - 3] + "..."


def read_machine_speed(path: Path, notes: list[str]) -> float | None:
    """The machine's speed at the end of the run against its calibration (`graphrl.calibration.machine_speed`'s
    ratio), where the run measured it; a file that cannot be read is a note, not an error."""
    if not path.exists():
        return None
    try:
        ratio = json.loads(path.read_text())["ratio"]
        if not isinstance(ratio, (int, float)) or not ratio > 0:
            raise ValueError(f"ratio {ratio!r}")
        return float(ratio)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        notes.append(f"{path.name} cannot be read ({exc}): the machine's speed against its calibration is not shown")
        return None


def build_report(run_dir: str | Path, *, warmup_steps: int = 1) -> "Report":
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
        from graphrl.plan_io import load_plan

        plan = load_plan(run_dir / PLAN_FILE)
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
        measured_s = _number(row, "step_time_s")
        step_rows.append({"step": row["step"], "measured_s": measured_s, "predicted_s": predicted_step_s,
                          "error_pct": error_pct(predicted_step_s, measured_s), "warmup": row["step"] in warm})
    steady = [r for r in step_rows if not r["warmup"]]
    measured_step_s = _mean(r["measured_s"] for r in steady)
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
        "steady_steps": len(steady),
        "reward_first": _number(first, "reward_mean"), "reward_last": _number(last, "reward_mean"),
        "reward_best": max((v for v in (_number(r, "reward_mean") for r in metrics) if v is not None), default=None),
        "loss_last": _number(last, "loss"), "kl_last": _number(last, "kl"),
        "measured_step_time_s": measured_step_s, "predicted_step_time_s": predicted_step_s,
        "step_time_error_pct": error_pct(predicted_step_s, measured_step_s),
        "tokens_per_s": _mean(_number(r, "tokens_per_s") for r in steady_metrics),
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
        "busy": {"source": "measured" if measured is not None else "simulated" if predicted is not None else None,
                 "ranks": busy_rows, "meshes": busy_meshes},
        "notes": notes,
        "samples": [{**row, "prompt_short": _clip(row["prompt"], tail=True), "response_short": _clip(row["response"])}
                    for row in read_samples(run_dir / SAMPLES_FILE)],
    }
    return Report(data)


@dataclass
class Report:
    """A run report: `data` (JSON-compatible) and its two views."""

    data: dict[str, Any]

    def render_html(self) -> str:
        """A self-contained page: inline styles and SVG; no scripts, stylesheets or fonts from elsewhere."""
        d = self.data
        head, omitted, tail = _shown(d["step_times"])
        return _TEMPLATES.get_template("report.html.j2").render(
            d=d, s=d["summary"], charts=_charts(d), head=head, omitted=omitted, tail=tail,
            flag=ERROR_PCT_FLAG, max_rank_rows=MAX_RANK_ROWS)

    def render_text(self, width: int = 120) -> str:
        """The same tables for a terminal (plain text, no colour codes)."""
        console = Console(width=width, record=True, file=io.StringIO(), force_terminal=False, color_system=None)
        console.print(Group(*_text_parts(self.data)))
        return console.export_text()


# ------------------------------------------------------------------------------------------------
# Formatting shared by both views


def fmt_seconds(value: float | None) -> str:
    return "-" if value is None else human_seconds(value)


def fmt_pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.1f}%" if signed else f"{value:.0f}%"


def fmt_number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _shown(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int, list[dict[str, Any]]]:
    """First and last rows of a long table, and how many are left out between them."""
    if len(rows) <= STEP_ROWS_HEAD + STEP_ROWS_TAIL + 5:
        return rows, 0, []
    return rows[:STEP_ROWS_HEAD], len(rows) - STEP_ROWS_HEAD - STEP_ROWS_TAIL, rows[-STEP_ROWS_TAIL:]


def _title(d: dict[str, Any]) -> str:
    if d["job"] is None:
        return f"run {d['run_dir']}"
    return (f"run of {d['job']} on {d['cluster']} ({d['num_ranks']} x {d['hardware']}): {d['label']} [{d['mode']}]"
            f"\nfolder {d['run_dir']}")


def _steady_text(d: dict[str, Any]) -> str:
    s = d["summary"]
    if not d["warmup_steps"]:
        return f"all {s['steps']} steps"
    return f"{s['steady_steps']} steps after {d['warmup_steps']} warm-up step{'s' if d['warmup_steps'] > 1 else ''}"


def _table(title: str, show_header: bool = True) -> Table:
    # Wide enough that a title stays on one line (rich wraps titles to the table's width).
    return Table(title=title, box=box.SIMPLE_HEAVY, title_justify="left", show_header=show_header,
                 min_width=len(title) + 2)


def _text_parts(d: dict[str, Any]) -> list[Any]:
    s = d["summary"]
    parts: list[Any] = [Text(_title(d), style="bold")]

    summary = _table("summary", show_header=False)
    summary.add_column("")
    summary.add_column("", justify="right")
    rows = [
        ("steps", f"{s['steps']} (steps {s['first_step']}-{s['last_step']})"),
        ("reward_mean first -> last (best)",
         f"{fmt_number(s['reward_first'])} -> {fmt_number(s['reward_last'])} ({fmt_number(s['reward_best'])})"),
        ("loss, kl at the last step", f"{fmt_number(s['loss_last'])}, {fmt_number(s['kl_last'])}"),
        (f"seconds per step, measured ({_steady_text(d)})", fmt_seconds(s["measured_step_time_s"])),
        ("seconds per step, predicted", fmt_seconds(s["predicted_step_time_s"])),
        ("prediction error", fmt_pct(s["step_time_error_pct"], signed=True)),
        *([("machine speed against its calibration", f"{s['machine_speed']:.2f}x")] if s["machine_speed"] else []),
        ("tokens per second", fmt_number(s["tokens_per_s"])),
        ("wall time of all steps", fmt_seconds(s["wall_s"])),
    ]
    for name, value in rows:
        summary.add_row(name, value)
    parts.append(summary)

    parts.append(Text("\nerror = (predicted - measured) / measured"))
    steps = _table("seconds per step")
    for col in ("step", "measured", "predicted", "error"):
        steps.add_column(col, justify="right")
    head, omitted, tail = _shown(d["step_times"])
    for row in head:
        steps.add_row(str(row["step"]) + (" (warm-up)" if row["warmup"] else ""), fmt_seconds(row["measured_s"]),
                      fmt_seconds(row["predicted_s"]), fmt_pct(row["error_pct"], signed=True))
    if omitted:
        steps.add_row("...", f"{omitted} steps", "", "")
        for row in tail:
            steps.add_row(str(row["step"]), fmt_seconds(row["measured_s"]), fmt_seconds(row["predicted_s"]),
                          fmt_pct(row["error_pct"], signed=True))
    parts.append(steps)

    kinds = d["kinds"]
    if kinds["rows"]:
        parts.append(Text(f"\ntime per instruction kind: seconds per step on a rank that runs it, averaged over "
                          f"{_steady_text(d)}" + ("; measured spans include waiting for peers" if kinds["measured"] else "")))
        table = _table("time per instruction kind")
        for col in ("kind", "predicted", "measured", "error"):
            table.add_column(col, justify="left" if col == "kind" else "right")
        for row in kinds["rows"]:
            table.add_row(row["kind"], fmt_seconds(row["predicted_s"]), fmt_seconds(row["measured_s"]),
                          fmt_pct(row["error_pct"], signed=True))
        parts.append(table)
    if d["phases"]["rows"]:
        parts.append(Text("\ntime per phase of a step: the sum of its instruction kinds' rows above"))
        table = _table("time per phase")
        for col in ("phase", "predicted", "measured", "error", "kinds"):
            table.add_column(col, justify="left" if col in ("phase", "kinds") else "right")
        for row in d["phases"]["rows"]:
            table.add_row(row["phase"], fmt_seconds(row["predicted_s"]), fmt_seconds(row["measured_s"]),
                          fmt_pct(row["error_pct"], signed=True), ", ".join(row["kinds"]))
        parts.append(table)

    busy = d["busy"]
    if busy["source"] is not None:
        per_mesh = len(busy["ranks"]) > MAX_RANK_ROWS
        table = _table(f"busy fraction per {'mesh' if per_mesh else 'rank'}"
                       f"{' (simulated: no timeline.json)' if busy['source'] == 'simulated' else ''}")
        rows = busy["meshes"] if per_mesh else busy["ranks"]
        sources = [k for k in ("measured", "simulated") if any(row[k] is not None for row in rows)]
        for col in (["mesh (ranks)"] if per_mesh else ["rank", "mesh"]) + sources:
            table.add_column(col, justify="left" if col.startswith("mesh") else "right")
        for row in rows:
            first = [f"{row['mesh']} ({row['num_ranks']})"] if per_mesh else [str(row["rank"]), row["mesh"]]
            table.add_row(*first, *(fmt_pct(None if row[k] is None else 100 * row[k]) for k in sources))
        parts.append(table)
    if d.get("samples"):
        table = _table("samples (first and last steps, from samples.jsonl)")
        for col, justify in (("step", "right"), ("version", "right"), ("reward", "right"), ("prompt", "left"),
                             ("response", "left")):
            table.add_column(col, justify=justify, overflow="fold")
        for row in d["samples"]:
            table.add_row(str(row["step"]), str(row.get("weight_version", "-")), fmt_number(row["reward"]),
                          row["prompt_short"], row["response_short"])
        parts.append(table)
    parts += [Text(f"note: {n}") for n in d["notes"]]
    return parts


# ------------------------------------------------------------------------------------------------
# Line charts: the geometry is computed here, the template draws it.

CHART_W, CHART_H = 520, 250
PAD_L, PAD_R, PAD_T, PAD_B = 62, 14, 20, 38
MAX_POINTS = 1500  # longer curves are thinned to every k-th point (the last one always kept)


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step + 1e-9) * step
    ticks = []
    t = first
    while t < hi + step * 0.999:
        ticks.append(round(t / step) * step)
        t += step
    return ticks


def log_ticks(lo: float, hi: float) -> list[float]:
    """Decades covering [lo, hi], with 2 and 5 between them when the range spans few decades."""
    d0, d1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    mults = (1, 2, 5) if d1 - d0 <= 2 else (1, 3) if d1 - d0 <= 4 else (1,)
    ticks = [m * 10.0 ** d for d in range(d0, d1) for m in mults] + [10.0 ** d1]
    inside = [t for t in ticks if lo <= t <= hi]
    below = [t for t in ticks if t < lo]
    above = [t for t in ticks if t > hi]
    return ([below[-1]] if below else []) + inside + ([above[0]] if above else [])


def _tick_label(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value:.3g}"


def _seconds_tick(value: float) -> str:
    """Short axis labels: `500 ms`, `2 s`, `20 µs`."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return "0" if value == 0 else f"{value * 1e9:.3g} ns"


def line_chart(title: str, series: list[dict[str, Any]], *, tick_format: Callable[[float], str] = _tick_label,
               point_format: Callable[[float], str] = fmt_number, log_y: bool | None = None,
               bands: Iterable[tuple[float, float, str]] = ()) -> dict[str, Any]:
    """An SVG line chart's geometry. Each series: name, color, points [(step, value)], dashed (bool).
    `log_y=None` picks a log axis when all values are positive and span more than 20x."""
    points = [(x, y) for s in series for x, y in s["points"]]
    chart: dict[str, Any] = {"title": title, "width": CHART_W, "height": CHART_H, "left": PAD_L,
                             "right": CHART_W - PAD_R, "top": PAD_T, "bottom": CHART_H - PAD_B,
                             "lines": [], "dots": [], "xticks": [], "yticks": [], "bands": [], "empty": not points,
                             "legend": [{"name": s["name"], "color": s["color"], "dashed": s.get("dashed", False)}
                                        for s in series if s["points"]] if len(series) > 1 else []}
    if not points:
        return chart
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 0.5, x_hi + 0.5
    y_lo, y_hi = min(ys), max(ys)
    if log_y is None:
        log_y = y_lo > 0 and y_hi / y_lo > 20
    if log_y:
        yticks = log_ticks(y_lo, y_hi)
        ty: Callable[[float], float] = math.log10
    else:
        if y_hi == y_lo:
            pad = abs(y_lo) * 0.1 or 1.0
            y_lo, y_hi = y_lo - pad, y_hi + pad
        yticks = nice_ticks(y_lo, y_hi)
        ty = float
    y0, y1 = ty(min(yticks[0], y_lo)), ty(max(yticks[-1], y_hi))
    left, right, top, bottom = chart["left"], chart["right"], chart["top"], chart["bottom"]

    def px(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * (right - left)

    def py(y: float) -> float:
        return bottom - (ty(y) - y0) / (y1 - y0) * (bottom - top)

    chart["log_y"] = log_y
    chart["yticks"] = [{"y": round(py(t), 1), "label": tick_format(t)} for t in yticks]
    chart["xticks"] = [{"x": round(px(t), 1), "label": _tick_label(t)}
                       for t in nice_ticks(x_lo, x_hi, target=6) if x_lo <= t <= x_hi and float(t).is_integer()]
    for x_from, x_to, label in bands:
        a, b = px(max(x_from, x_lo)), px(min(x_to, x_hi))
        if b > a:
            chart["bands"].append({"x": round(a, 1), "width": round(b - a, 1), "label": label})
    for s in series:
        pts = s["points"]
        if len(pts) > MAX_POINTS:
            stride = math.ceil(len(pts) / MAX_POINTS)
            pts = pts[::stride] + ([pts[-1]] if (len(pts) - 1) % stride else [])
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        chart["lines"].append({"name": s["name"], "color": s["color"], "dashed": s.get("dashed", False),
                               "points": coords})
        if len(pts) <= 40 and not s.get("dashed", False):
            chart["dots"] += [{"x": round(px(x), 1), "y": round(py(y), 1), "color": s["color"],
                               "title": f"step {x}: {point_format(y)}"} for x, y in pts]
    return chart


def _curve(metrics: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(row["step"], v) for row in metrics if (v := _number(row, key)) is not None]


def _charts(d: dict[str, Any]) -> list[dict[str, Any]]:
    metrics = d["metrics"]
    warm = [r["step"] for r in d["step_times"] if r["warmup"]]
    bands = [(min(warm) - 0.5, max(warm) + 0.5, "warm-up")] if warm else []
    step_series = [{"name": "measured", "color": "#6b8afd", "points": _curve(metrics, "step_time_s")}]
    predicted = d["summary"]["predicted_step_time_s"]
    if predicted is not None and step_series[0]["points"]:
        steps = [p[0] for p in step_series[0]["points"]]
        step_series.append({"name": "predicted", "color": "#f59e0b", "dashed": True,
                            "points": [(min(steps), predicted), (max(steps), predicted)]})
    return [
        line_chart("reward (reward_mean)", [{"name": "reward", "color": "#10b981", "points": _curve(metrics, "reward_mean")}]),
        line_chart("loss", [{"name": "loss", "color": "#6b8afd", "points": _curve(metrics, "loss")}]),
        line_chart("KL (kl)", [{"name": "kl", "color": "#a78bfa", "points": _curve(metrics, "kl")}]),
        line_chart("seconds per step", step_series, tick_format=_seconds_tick, point_format=human_seconds,
                   bands=bands),
    ]


_TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
    autoescape=jinja2.select_autoescape(["html", "j2"]), trim_blocks=True, lstrip_blocks=True,
)
_TEMPLATES.filters["seconds"] = fmt_seconds
_TEMPLATES.filters["pct"] = fmt_pct
_TEMPLATES.filters["num"] = fmt_number
