"""A run folder belongs to one job and one writer: what it records about the job, who holds it, and how a
new run may use it.

- **The marker.** A folder holds a run only when graphrl's own `run.json` says so: the job that writes the
  folder (its settings, less those a resume may change), the history of runs into it, and the files
  outside the run's own names that graphrl wrote there (`graphrl report`'s page). A folder without it is
  someone else's: a run may use it as long as nothing in it sits where a run writes.
- **What `--overwrite` deletes.** Only what runs write, by name (`RUN_OUTPUTS`: the metrics, the
  `step_*` checkpoints, the TensorBoard event files, ...) and the files `run.json` lists; a user's own
  `checkpoints/my_model.pt` or `notes.md` beside them stays, and so do the folders that hold them.
- **One writer.** The launcher holds an exclusive lock (`run.lock`, `flock`) from before it compiles until
  the run ends; a second run into the folder, resuming or overwriting, is refused while the first lives.
  The operating system drops the lock of a process that died however it died, so a stale lock file is
  taken over without a word.
- **A run that did nothing is no run.** A folder whose run finished no step and wrote no checkpoint (it was
  stopped while it started) may be started again by the same command.
- **Resuming** continues from the newest intact checkpoint and rewinds `metrics.jsonl`, `samples.jsonl` and `env_errors.jsonl`
  to it, so a step that ran after the checkpoint and runs again is recorded once; with no checkpoint at
  all it starts again from step 0, its records emptied.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from graphrl.errors import OutputError, RunError, format_path

RUN_RECORD = "run.json"
LOCK_FILE = "run.lock"
# What a run writes into its folder, as glob patterns relative to it: `--overwrite` deletes these (and the
# files `run.json` lists) and nothing else.
RUN_OUTPUTS = ("metrics.jsonl", "samples.jsonl", "env_errors.jsonl", "timeline.json", "plan.msgpack",
               "machine_speed.json", "metrics.jsonl.rewind", "samples.jsonl.rewind", "env_errors.jsonl.rewind", "checkpoints/step_*", "checkpoints/.step_*.partial",
               "checkpoints/latest", "checkpoints/latest.tmp", "tensorboard/events.out.tfevents.*",
               "timeline/rank*.json", "ledger/rank*.json", "errors/rank*.txt", RUN_RECORD)
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


def read_record(out_dir: Path) -> dict[str, Any] | None:
    """The folder's `run.json`, or None where there is none (or it is not graphrl's)."""
    path = out_dir / RUN_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        return record if isinstance(record, dict) and "job" in record else None
    except (ValueError, OSError):
        return None


def run_outputs(out_dir: Path, record: dict[str, Any] | None = None) -> list[Path]:
    """The files and folders in `out_dir` that runs wrote (the names runs write, and what `run.json` lists)."""
    found = {p for pattern in RUN_OUTPUTS for p in out_dir.glob(pattern)}
    for name in (record or {}).get("also_written", []):
        if (out_dir / name).exists():
            found.add(out_dir / name)
    return sorted(found)


def work_done(out_dir: Path) -> bool:
    """Whether a run in `out_dir` finished a step or wrote a checkpoint."""
    metrics = out_dir / "metrics.jsonl"
    return (metrics.is_file() and metrics.stat().st_size > 0) or any(
        p.is_dir() for p in (out_dir / "checkpoints").glob("step_*"))


# -- one writer ------------------------------------------------------------------------------------------
class RunFolderLock:
    """The exclusive `flock` on `run.lock` that makes a process the folder's one writer; the file says who
    holds it (pid, host, since when, the command) for the refusal a second writer gets."""

    def __init__(self, out_dir: Path, fd: int) -> None:
        self.out_dir = out_dir
        self._fd: int | None = fd

    @classmethod
    def take(cls, out_dir: Path, command: str) -> "RunFolderLock":
        path = out_dir / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise RunError(f"run folder {out_dir} is in use: {_holder(path)}",
                               fix="wait for that run to end or stop it (Ctrl-C in its terminal, or `kill -INT` its "
                                   "pid), or pass --out with another folder") from None
            try:  # the holder may have removed the file between our open and our lock: lock the one that is there
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": command}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(holder) + "\n").encode())
        return cls(out_dir, fd)

    def release(self) -> None:
        """Give the folder up (and remove the lock file, which then says nothing true)."""
        if self._fd is None:
            return
        try:
            (self.out_dir / LOCK_FILE).unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None


def _holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        return (f"held by {holder.get('command', 'graphrl')} (pid {holder['pid']} on {holder['host']}, "
                f"since {holder['since']})")
    except (ValueError, KeyError, OSError, TypeError):
        return "held by another graphrl run"


# -- claiming a folder for a run -------------------------------------------------------------------------
@dataclass
class Start:
    """Where a run into a folder begins: its first step and the checkpoint it continues from."""

    step: int
    checkpoint: Path | None
    notes: list[str] = field(default_factory=list)


@dataclass
class RunFolder:
    """A run folder claimed by this process: checked, locked, and (after `begin`) recorded."""

    path: Path
    resume: bool
    overwrite: bool
    lock: RunFolderLock
    created: list[Path]  # the folders this process made for it, innermost first

    def release(self) -> None:
        """Unlock; folders this process created and left empty (compiling failed or was interrupted) go."""
        self.lock.release()
        for folder in self.created:
            try:
                folder.rmdir()
            except OSError:
                break

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def begin(self, spec: Any, total_steps: int, say: Callable[[str], None]) -> Start | None:
        """Make the folder ready for a run of `total_steps` steps: delete an earlier run's outputs (with
        --overwrite, or where it did nothing), or find the checkpoint a resume continues from and rewind
        the records to it; record the run in `run.json`. None: a resume with nothing left to run."""
        self.created = []  # from here on the folder holds the run
        record = read_record(self.path)
        start = Start(0, None)
        if self.resume:
            from graphrl.executors.outputs import latest_checkpoint, read_meta

            ckpt = latest_checkpoint(self.path, say=lambda line: say(f"warning: {line}"))
            if ckpt is None:
                start.notes.append(f"no intact checkpoint in {self.path}: the run starts again from step 0")
            else:
                meta = read_meta(ckpt)
                start = Start(int(meta["next_step"]), ckpt)
                if start.step >= total_steps:
                    say(f"nothing to resume: {ckpt} is after step {start.step - 1} and the job runs {total_steps} "
                        "steps; pass a larger --steps to continue it")
                    return None
                start.notes.append(f"resuming from {ckpt} at step {start.step}")
            dropped = rewind_records(self.path, start.step)
            if any(dropped.values()):
                start.notes.append(", ".join(f"{name}: {n} lines after the checkpoint dropped"
                                             for name, n in dropped.items() if n))
        elif record is not None or self.overwrite:
            remove_run_outputs(self.path, record)
            record = None
        record_run(self.path, spec, steps=total_steps, start_step=start.step, resumed_from=start.checkpoint,
                   record=record)
        return start


def claim_run_folder(out_dir: Path, spec: Any, *, resume: bool, overwrite: bool, command: str) -> RunFolder:
    """Check that a run may write `out_dir` and lock it for this process, before minutes of compiling.
    Refused: a folder that cannot be written, one in use by a live run, one with another run (without
    --resume or --overwrite), a resume of another job or of a folder that holds no run, and a folder that
    is not a run folder but holds files where a run writes. Writes nothing but the lock file (and the
    folder, removed again on `release` if nothing else came of it)."""
    if resume and overwrite:
        raise RunError("--resume and --overwrite contradict each other", fix="pass one of them")
    existing = next((p for p in (out_dir, *out_dir.absolute().parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise OutputError(f"run folder {out_dir} cannot be written ({existing} is a file)",
                          fix="pass --out with a folder")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"run folder {out_dir} cannot be written ({existing} is not writable)",
                          fix="pass --out with a folder you can write")
    created = [p for p in (out_dir, *out_dir.absolute().parents) if not p.exists()]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"run folder {out_dir} cannot be written ({exc.strerror or exc})",
                          fix="pass --out with a folder you can write") from None
    try:
        lock = RunFolderLock.take(out_dir, command)
    except BaseException:
        if created:  # the outermost folder made here, with what it holds (the lock file)
            shutil.rmtree(created[-1], ignore_errors=True)
        raise
    folder = RunFolder(out_dir, resume, overwrite, lock, created)
    try:
        _check_use(out_dir, spec, resume=resume, overwrite=overwrite)
    except BaseException:
        folder.release()
        raise
    return folder


def _check_use(out_dir: Path, spec: Any, *, resume: bool, overwrite: bool) -> None:
    record = read_record(out_dir)
    if record is None:
        foreign = run_outputs(out_dir)
        if foreign:
            shown = ", ".join(str(p.relative_to(out_dir)) for p in foreign[:4]) + (" ..." if len(foreign) > 4 else "")
            raise OutputError(f"{out_dir} is not a graphrl run folder (no {RUN_RECORD}) but holds files where a run "
                              f"writes: {shown}", fix="pass --out with a new or empty folder (graphrl never "
                              "writes over files it did not write)")
        if resume:
            raise RunError(f"--resume: {out_dir} holds no run to resume (no {RUN_RECORD})",
                           fix="run without --resume to start one there, or pass the --out of the run to continue")
        return
    if resume:
        diff = differences(record["job"], job_identity(spec))
        if diff:
            shown = "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")
            raise RunError(f"--resume: run folder {out_dir} holds another job ({shown})",
                           fix="resume with the job (and --set options) that wrote it, or pass another --out")
    elif not overwrite and work_done(out_dir):
        raise RunError(f"run folder {out_dir} already holds a run", fix="pass --resume to continue it, --overwrite "
                       "to replace it (deletes what runs wrote there, nothing else), or --out with another folder")


def remove_run_outputs(out_dir: Path, record: dict[str, Any] | None) -> None:
    """Delete what runs wrote into `out_dir` (and folders that this leaves empty), nothing else."""
    for path in run_outputs(out_dir, record):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    for sub in ("checkpoints", "tensorboard", "timeline", "ledger", "errors"):
        try:
            (out_dir / sub).rmdir()
        except OSError:  # absent, or holds someone else's files
            pass


def record_run(out_dir: Path, spec: Any, *, steps: int, start_step: int, resumed_from: Path | None,
               record: dict[str, Any] | None = None) -> None:
    """Write `run.json`: the job's identity and one entry per run into the folder."""
    if record is None:
        record = read_record(out_dir) or {"job": job_identity(spec), "name": spec.name, "runs": []}
    record["runs"].append({"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "start_step": start_step, "steps": steps,
                           "resumed_from": None if resumed_from is None else resumed_from.name})
    _write_record(out_dir, record)


def record_outcome(out_dir: Path, outcome: str, *, last_step: int | None) -> None:
    """Note how the folder's latest run ended ('finished', 'stopped', 'failed') and its last step."""
    record = read_record(out_dir)
    if record is None or not record.get("runs"):
        return
    record["runs"][-1].update({"ended": time.strftime("%Y-%m-%dT%H:%M:%S"), "outcome": outcome,
                               "last_step": last_step})
    _write_record(out_dir, record)


def record_written(out_dir: Path, written: Path) -> None:
    """Note a file graphrl wrote into a run folder under a name runs do not write (`graphrl report`'s
    page), so that `--overwrite` knows it for graphrl's."""
    record = read_record(out_dir)
    if record is None:
        return
    name = os.path.relpath(written.absolute(), out_dir.absolute())
    if name.startswith("..") or name in record.setdefault("also_written", []):
        return
    record["also_written"].append(name)
    _write_record(out_dir, record)


def _write_record(out_dir: Path, record: dict[str, Any]) -> None:
    tmp = out_dir / (RUN_RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(out_dir / RUN_RECORD)


def rewind_records(out_dir: Path, next_step: int) -> dict[str, int]:
    """Drop the lines of steps >= `next_step` from metrics.jsonl, samples.jsonl and env_errors.jsonl (a run
    resumed from a checkpoint runs them again), and a torn last line; how many lines each file lost."""
    dropped = {}
    for name in ("metrics.jsonl", "samples.jsonl", "env_errors.jsonl"):
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


__all__ = ["LOCK_FILE", "RUN_OUTPUTS", "RUN_RECORD", "RunFolder", "RunFolderLock", "Start", "claim_run_folder",
           "differences", "job_identity", "read_record", "record_outcome", "record_run", "record_written",
           "remove_run_outputs", "rewind_records", "run_outputs", "work_done"]
