"""Reading a run folder: the files `graphrl run --out DIR` writes and the report reads, each parsed into
plain rows or spans, with the file and line named when one is damaged.

A run folder holds `metrics.jsonl` (one row per RL step), `plan.msgpack` (the compiled plan), and where
the run recorded them `timeline.json` (a Chrome trace of measured instruction spans), `samples.jsonl`
(rollouts) and `machine_speed.json` (the machine's speed against its calibration).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphrl.errors import Location, RunError

METRICS_FILE = "metrics.jsonl"
PLAN_FILE = "plan.msgpack"
TIMELINE_FILE = "timeline.json"
MACHINE_SPEED_FILE = "machine_speed.json"  # `graphrl run` on a calibrated machine: its speed against the calibration
SAMPLES_FILE = "samples.jsonl"
SAMPLE_STEPS_SHOWN = 3  # the first and the last steps' samples: what the policy said before and after training

# Metrics the report reads; other keys (entropy, clip_frac, ...) are kept in `data["metrics"]` as they are.
NUMERIC_KEYS = ("reward_mean", "loss", "kl", "step_time_s", "tokens_per_s", "weight_version")


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


def metric_value(row: dict[str, Any], key: str) -> float | None:
    """A metrics row's value of `key` as a float; None where it is missing, not a number or not finite."""
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


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
