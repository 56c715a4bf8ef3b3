"""A run folder belongs to one job: what it records about the job, and how a new run may use it.

`run.json` holds the job that writes the folder (its settings, less those a resume may change) and the
history of runs into it. `graphrl run` into a folder with a previous run refuses unless `--resume`
continues that job (refused, naming every setting that differs, for another job) or `--overwrite`
deletes what earlier runs wrote there (only those files; anything else in the folder stays). A resume
rewinds `metrics.jsonl` and `samples.jsonl` to the checkpoint it continues from, so a step that ran
after the checkpoint and runs again is recorded once.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from graphrl.errors import OutputError, RunError, format_path

RUN_RECORD = "run.json"
# What a run writes into its folder: `--overwrite` deletes these and nothing else.
RUN_OUTPUTS = ("metrics.jsonl", "samples.jsonl", "checkpoints", "tensorboard", "timeline", "timeline.json",
               "ledger", "errors", "plan.msgpack", "report.html", "machine_speed.json", RUN_RECORD)
# Settings a resume may change: how long it runs, how often it checkpoints, where and on what it runs.
RESUMABLE = (("description",), ("cluster",), ("placement",), ("schedule", "steps"), ("schedule", "checkpoint_every"),
             ("run", "out_dir"), ("run", "log_every"), ("run", "tensorboard"), ("run", "device"),
             ("run", "threads_per_rank"))


def job_identity(spec: Any) -> dict[str, Any]:
    """The job's settings (a JobSpec as JSON) without those a resume may change."""
    data = json.loads(spec.model_dump_json())
    for path in RESUMABLE:
        holder = data
        for key in path[:-1]:
            holder = holder.get(key, {})
        holder.pop(path[-1], None)
    return data


def differences(old: Any, new: Any, path: tuple[str | int, ...] = ()) -> list[str]:
    """Field paths where two identities differ, with both values (`nodes.score.fn: 'a' -> 'b'`)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += differences(old.get(key, "<unset>"), new.get(key, "<unset>"), (*path, key))
        return out
    if old != new:
        return [f"{format_path(path)}: {old!r:.60} -> {new!r:.60}"]
    return []


def has_previous_run(out_dir: Path) -> bool:
    """Whether a run wrote into `out_dir` (its record, or a run's metrics or checkpoints)."""
    return any((out_dir / name).exists() for name in (RUN_RECORD, "metrics.jsonl", "checkpoints"))


def read_record(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / RUN_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        return record if isinstance(record, dict) and "job" in record else None
    except ValueError:
        return None


def check_run_folder(out_dir: Path, spec: Any, *, resume: bool, overwrite: bool) -> None:
    """Refuse, before compiling and without writing anything, a run that may not write `out_dir`: a
    folder with another run (without --resume/--overwrite), a resume of another job, a folder that
    cannot be created or written."""
    if resume and overwrite:
        raise RunError("--resume and --overwrite contradict each other", fix="pass one of them")
    existing = next((p for p in (out_dir, *out_dir.absolute().parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise OutputError(f"run folder {out_dir} cannot be written ({existing} is a file)",
                          fix="pass --out with a folder")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"run folder {out_dir} cannot be written ({existing} is not writable)",
                          fix="pass --out with a folder you can write")
    previous = out_dir.is_dir() and has_previous_run(out_dir)
    if resume:
        record = read_record(out_dir)
        if record is not None:
            diff = differences(record["job"], job_identity(spec))
            if diff:
                shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
                raise RunError(f"--resume: run folder {out_dir} holds another job ({shown})",
                               fix="resume with the job (and --set options) that wrote it, or pass another --out")
    elif previous and not overwrite:
        raise RunError(f"run folder {out_dir} already holds a run", fix="pass --resume to continue it, --overwrite "
                       "to replace it (deletes its metrics and checkpoints), or --out with another folder")


def prepare_run_folder(out_dir: Path, spec: Any, *, resume: bool, overwrite: bool) -> None:
    """`check_run_folder`, then make the folder: with --overwrite, delete what earlier runs wrote there
    (only those files), and create it."""
    check_run_folder(out_dir, spec, resume=resume, overwrite=overwrite)
    if overwrite and out_dir.is_dir() and has_previous_run(out_dir):
        for name in RUN_OUTPUTS:
            target = out_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{time.monotonic_ns()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"run folder {out_dir} cannot be written ({exc.strerror or exc})",
                          fix="pass --out with a folder you can write") from None


def record_run(out_dir: Path, spec: Any, *, steps: int, start_step: int, resumed_from: Path | None) -> None:
    """Write `run.json`: the job's identity and one entry per run into the folder."""
    record = read_record(out_dir) or {"job": job_identity(spec), "name": spec.name, "runs": []}
    record["runs"].append({"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "start_step": start_step, "steps": steps,
                           "resumed_from": None if resumed_from is None else resumed_from.name})
    (out_dir / RUN_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def rewind_records(out_dir: Path, next_step: int) -> dict[str, int]:
    """Drop the lines of steps >= `next_step` from metrics.jsonl and samples.jsonl (a run resumed from a
    checkpoint runs them again), and a torn last line; how many lines each file lost."""
    dropped = {}
    for name in ("metrics.jsonl", "samples.jsonl"):
        path = out_dir / name
        if not path.is_file():
            continue
        kept, lost = [], 0
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
                keep = isinstance(row, dict) and int(row["step"]) < next_step
            except (ValueError, KeyError, TypeError):
                keep = False
            if keep:
                kept.append(line + "\n")
            else:
                lost += 1
        tmp = path.with_name(path.name + ".rewind")
        tmp.write_text("".join(kept))
        tmp.replace(path)
        dropped[name] = lost
    return dropped


def remove_records(out_dir: Path) -> None:
    """A fresh run's records start empty (the folder held no previous run, or --overwrite emptied it)."""
    for name in ("metrics.jsonl", "samples.jsonl", "timeline.json"):
        (out_dir / name).unlink(missing_ok=True)


__all__ = ["RUN_OUTPUTS", "RUN_RECORD", "check_run_folder", "differences", "has_previous_run", "job_identity", "prepare_run_folder",
           "record_run", "rewind_records"]
