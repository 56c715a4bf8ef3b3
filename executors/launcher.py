"""Starting ranks: locally with torch.multiprocessing, or under torchrun / SLURM from written scripts.

Local runs spawn one process per rank (gloo on CPU, NCCL on CUDA, a free loopback port, one thread per
rank by default). The parent watches every child: when one raises or is killed, all others are ended
within seconds and the run fails with the rank and its error; nothing is left running. The first Ctrl-C
or SIGTERM asks the ranks to stop after the step they are in and checkpoint it (`stopping.py`), a second
ends them at once; and ranks end by themselves when the parent dies, however it dies. The parent also
follows `metrics.jsonl` to drive a progress bar with the reward and the step time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from graphrl.errors import FIX_LINE, Interrupted, RunError
from graphrl.executors.profiling import ProfileSettings, merge_timeline
from graphrl.executors.rank_server import rank_context
from graphrl.executors.stopping import (STOP_SIGNALS, RunStopped, StopRequests, end_with, signal_name,
                                         stop_exit_code)
from graphrl.plan_io import load_plan, save_plan
from graphrl.schemas.capabilities import plan_refusals
from graphrl.schemas.plan import Plan

def refuse_unrunnable_plan(plan: Plan) -> None:
    """Raise before any rank starts when the plan holds a choice the executors do not run (the capability
    table, `graphrl.schemas.capabilities`): a plan compiled for the preview (a pinned pp), or one written by
    another version."""
    refusals = plan_refusals(plan)
    if refusals:
        first = refusals[0]
        raise RunError(f"{first.message()}; this plan can be previewed and simulated, not run"
                       + (f" ({len(refusals) - 1} more such choices)" if len(refusals) > 1 else ""),
                       path=("placement", "roles", first.role, first.refusal.field), fix=first.refusal.fix)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world_size: int, plan_path: str, out_dir: str, start_step: int, threads: int,
              resume_from: str | None, local_rank: int | None = None, profile: ProfileSettings | None = None,
              env: dict[str, str] | None = None, launcher_pid: int | None = None) -> None:
    """Entry point of one rank (a forked or spawned process, or a torchrun worker). Writes its error on
    failure; ends with `128 + signal` when it stopped on a request (`executors/stopping.py`), and at once
    when `launcher_pid` (default: its parent, torchrun's agent) ends. `env`: the launching process's
    environment, which a rank forked from the server would not otherwise see (the server keeps the one of
    the moment it started; multiprocessing carries the working directory and sys.path itself)."""
    stop = StopRequests()
    stop.install()  # first: a Ctrl-C while the rank starts ends it without a traceback
    end_with(launcher_pid if launcher_pid is not None else os.getppid())
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    out = Path(out_dir)
    try:
        from graphrl.executors.executor import run_rank
        from graphrl.executors.host_memory import keep_freed_host_memory
        from graphrl.executors.outputs import load_checkpoint
        from graphrl.executors.runtime import Runtime

        torch.set_num_threads(threads)
        plan = load_plan(plan_path)  # the launcher checked it once, before any rank started
        assert plan.programs is not None
        runtime = Runtime.init(rank, world_size, plan.job.run.device, plan.programs.groups, local_rank)
        if runtime.device.type == "cpu":  # before the rank's first large tensor
            keep_freed_host_memory()
        resume_state = load_checkpoint(Path(resume_from), weights=False) if resume_from else None
        run_rank(plan, runtime, out, start_step=start_step, resume_state=resume_state, profile=profile, stop=stop)
        if world_size > 1:
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    except RunStopped as exc:
        # no barrier: ranks that hold no trained state may be blocked on a trainer that has stopped
        raise SystemExit(stop_exit_code(exc.signum)) from None
    except BaseException as exc:
        errors = out / "errors"
        errors.mkdir(parents=True, exist_ok=True)
        (errors / f"rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
        raise SystemExit(1) from None


@dataclass
class RunOutcome:
    """A local run that ended with every step done (a stopped or failed one raises instead)."""

    out_dir: Path
    steps_done: int
    wall_s: float


def _read_metrics(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete lines of `path` after `offset` (a line still being written waits for the next read)."""
    if not path.exists():
        return [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    complete = chunk[: chunk.rfind(b"\n") + 1]
    rows = []
    for line in complete.decode(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line that is not a record (the file was rewound under us): not a step
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows, offset + len(complete)


class LauncherSignals:
    """SIGINT and SIGTERM while the ranks run: noted, never raised, so the launcher's loop decides. The first
    asks every rank to stop after its step; a second ends them at once."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "LauncherSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        self.received.append(signum)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def launch_local(plan: Plan, out_dir: Path, *, start_step: int = 0, resume_from: Path | None = None,
                 on_metrics: Callable[[dict[str, Any]], None] | None = None, timeout_s: float | None = None,
                 profile: ProfileSettings | None = None, resume_hint: str | None = None,
                 on_stopping: Callable[[str], None] | None = None) -> RunOutcome:
    """Run every rank of `plan` as a local process; raise RunError naming the first rank that failed.
    The first Ctrl-C (SIGINT) or SIGTERM, to this process or its whole process group, asks every rank to
    stop after the step it is in (`on_stopping` is told); the trainer ranks checkpoint that step, and
    `Interrupted` names the step, its checkpoint and the command that continues (`resume_hint`). A second
    one ends every rank at once and raises `Interrupted` naming the newest intact checkpoint."""
    assert plan.programs is not None
    refuse_unrunnable_plan(plan)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan_path = out_dir / "plan.msgpack"
    save_plan(plan, plan_path)
    errors = out_dir / "errors"
    if errors.exists():
        for f in errors.glob("rank*.txt"):
            f.unlink()
    world = plan.programs.num_ranks
    threads = plan.job.run.threads_per_rank
    env_port = free_port()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(env_port)
    ctx = rank_context()
    timeline = out_dir / "timeline"
    if timeline.exists():
        for f in timeline.glob("rank*.json"):
            f.unlink()
    procs = [ctx.Process(target=rank_main, args=(r, world, str(plan_path), str(out_dir), start_step, threads,
                                                   str(resume_from) if resume_from else None, None, profile,
                                                   dict(os.environ), os.getpid()),
                         daemon=False)
             for r in range(world)]
    trainers = plan.programs.groups["trainer"]
    before = _newest_checkpoint(out_dir)
    started = time.perf_counter()
    offset = 0
    metrics_path = out_dir / "metrics.jsonl"
    if metrics_path.exists():
        offset = metrics_path.stat().st_size
    steps_done = 0
    failure: tuple[int, str, str | None] | None = None
    stop = 0
    with LauncherSignals() as signals:
        try:
            for p in procs:
                p.start()
            while True:
                rows, offset = _read_metrics(metrics_path, offset)
                for row in rows:
                    steps_done += 1
                    if on_metrics:
                        on_metrics(row)
                if signals.received and not stop:
                    stop = signals.received[0]
                    for p in procs:  # also where the signal came to this process alone (`kill -INT`)
                        if p.exitcode is None and p.pid is not None:
                            os.kill(p.pid, stop)
                    if on_stopping:
                        again = "press Ctrl-C" if stop == signal.SIGINT else "send SIGTERM"
                        on_stopping(f"{signal_name(stop)}: stopping after the step in progress and writing its "
                                    f"checkpoint; {again} again to end every rank at once")
                if len(signals.received) > 1:
                    break
                if stop and all(procs[r].exitcode is not None for r in trainers):
                    break  # the other ranks hold no trained state: they end below
                failed = [(r, p) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed and not stop:
                    failure = _describe_failure(failed, errors)
                    break
                if all(p.exitcode is not None for p in procs):
                    break
                if timeout_s is not None and time.perf_counter() - started > timeout_s:
                    failure = (-1, f"the run exceeded its time limit of {timeout_s:.0f} s", None)
                    break
                time.sleep(0.1)
        finally:
            _end_all(procs)
    rows, offset = _read_metrics(metrics_path, offset)
    for row in rows:
        steps_done += 1
        if on_metrics:
            on_metrics(row)
    merge_timeline(timeline, out_dir / "timeline.json", append=start_step > 0)
    if stop:
        _raise_stopped(out_dir, signals.received, before, trainers, procs, resume_hint)
    if failure is not None:
        rank, message, rank_fix = failure
        where = f"rank {rank}" if rank >= 0 else "the run"
        fix = _continue_fix(out_dir, errors if rank >= 0 else None, resume_hint)
        raise RunError(f"{where} failed: {message}", fix=f"{rank_fix}; {fix}" if rank_fix else fix)
    return RunOutcome(out_dir, steps_done, time.perf_counter() - started)


def _newest_checkpoint(out_dir: Path) -> str | None:
    """The name of the newest checkpoint folder (intact or not; none is checked here)."""
    names = sorted(p.name for p in (out_dir / "checkpoints").glob("step_*") if p.is_dir())
    return names[-1] if names else None


def _raise_stopped(out_dir: Path, received: list[int], before: str | None, trainers: tuple[int, ...],
                   procs: list[Any], resume_hint: str | None) -> None:
    """After a stop request: say where the run stopped and how to continue it (`Interrupted`), or return
    when it had finished every step anyway."""
    from graphrl.executors.outputs import checkpoint_problem, latest_checkpoint, read_meta

    signum = received[0]
    how = signal_name(signum)
    codes = {procs[r].exitcode for r in trainers}
    if codes == {0} and len(received) == 1:
        return  # it finished before the request reached a step's end
    newest = _newest_checkpoint(out_dir)
    written = None
    if len(received) == 1 and codes == {stop_exit_code(signum)} and newest is not None and newest != before:
        written = out_dir / "checkpoints" / newest
        problem = checkpoint_problem(written)
        if problem is not None:  # written and renamed into place, yet not intact: say so, use the one before
            raise Interrupted(f"{how} ended the run, but the checkpoint it wrote is damaged: {problem}",
                              signum=signum, fix=_continue_fix(out_dir, None, resume_hint))
    if written is not None:
        step = int(read_meta(written)["step"])
        cont = f"continue with `{resume_hint}`" if resume_hint else "--resume continues from it"
        raise Interrupted(f"{how} ended the run after step {step}; its checkpoint {written} is written and verified",
                          signum=signum, fix=cont)
    if len(received) > 1:
        message = f"ended at once on a second {how.split(' ')[0]}: every rank was killed"
    else:
        message = f"{how} ended the run before a step ended"
        if any((out_dir / "errors").glob("rank*.txt")):
            message += f" (ranks failed while stopping: see {out_dir / 'errors'})"
    last = latest_checkpoint(out_dir)
    if last is None:
        advice = "no checkpoint was written: the same command starts the run again at step 0" + (
            f", and so does `{resume_hint}`" if resume_hint else "")
    else:
        advice = (f"continue from {last.name} with `{resume_hint}`" if resume_hint
                  else f"--resume continues from {last.name}")
    raise Interrupted(message, signum=signum, fix=advice)


def _continue_fix(out_dir: Path, errors: Path | None, resume_hint: str | None) -> str:
    """Where the tracebacks are and how to continue from the newest intact checkpoint, if there is one."""
    from graphrl.executors.outputs import latest_checkpoint

    parts = [f"see {errors} for every rank's traceback"] if errors is not None else []
    ckpt = latest_checkpoint(out_dir)
    if ckpt is not None:
        parts.append(f"continue from {ckpt.name} with `{resume_hint}`" if resume_hint
                     else f"--resume continues from {ckpt.name}")
    elif errors is None:
        parts.append("no checkpoint was written yet: the run starts again from step 0")
    return "; ".join(parts)


def _describe_failure(failed: list[tuple[int, Any]], errors: Path) -> tuple[int, str, str | None]:
    """The root cause among the failed ranks, as (rank, message, the rank's own fix if it named one): a
    rank killed by a signal (it could write nothing: the OOM killer, a `kill`), else the rank that wrote
    its error first; its peers die of its consequences (their collectives fail as soon as its process is
    gone, often before the launcher has seen it exit)."""
    time.sleep(0.2)
    for rank, proc in failed:
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            return rank, f"killed by signal {name}", None
    written = [(path.stat().st_mtime_ns, int(path.stem.removeprefix("rank")), path)
               for path in errors.glob("rank*.txt")]
    if written:
        _, rank, path = min(written, key=lambda e: e[:2])
        lines = path.read_text().splitlines()
        # a graphrl error renders its remedy on the next line; it leads the launcher's own
        fix = lines[1].removeprefix(FIX_LINE) if len(lines) > 1 and lines[1].startswith(FIX_LINE) else None
        return rank, lines[0], fix
    rank, proc = failed[0]
    return rank, f"exited with code {proc.exitcode}", None


def _end_all(procs: list[Any]) -> None:
    """Kill every rank still running (SIGTERM is a rank's stop request, which one blocked on a peer that has
    ended could not honour) and reap them all."""
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)
