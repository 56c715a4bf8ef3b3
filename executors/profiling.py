"""Profiling a run: measured instruction spans on every rank, torch.profiler traces, one merged timeline.

Every rank always records, per instruction, its label (`Generate step=3 v=2`), type and wall-clock
start and end (cheap: two clock reads). At the end of a run these are merged into `timeline.json`, a
Chrome trace with one process row per rank and a flow arrow from each `Send` to its `Recv` (open it in
https://ui.perfetto.dev). With `--profile DIR`, each rank also runs torch.profiler on a wait/warmup/
active schedule over RL steps, marks every instruction with `record_function(label)`, and writes through
`tensorboard_trace_handler` so TensorBoard's PyTorch Profiler plugin lists every rank as a worker.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphrl.schemas.program import Instruction, Recv, Send, label


@dataclass
class ProfileSettings:
    directory: Path
    wait: int = 1
    warmup: int = 1
    active: int = 3
    memory: bool = False


@dataclass
class SpanRecorder:
    """Measured spans of one rank: (label, type, start_s, end_s, tag) with wall-clock times."""

    rank: int
    spans: list[tuple[str, str, float, float, int]] = field(default_factory=list)

    def record(self, ins: Instruction, start: float, end: float) -> None:
        tag = ins.tag if isinstance(ins, (Send, Recv)) else -1
        self.spans.append((label(ins), type(ins).__name__, start, end, tag))

    def write(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}.json"
        path.write_text(json.dumps({"rank": self.rank, "spans": self.spans}))
        return path


class RankProfiler:
    """torch.profiler around a rank's program, stepped at RL step boundaries (no-op when disabled)."""

    def __init__(self, rank: int, settings: ProfileSettings | None, device: torch.device) -> None:
        self.enabled = settings is not None
        self._prof = None
        self._step: int | None = None
        if settings is None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=settings.wait, warmup=settings.warmup, active=settings.active, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(settings.directory), worker_name=f"rank{rank}"),
            profile_memory=settings.memory,
            record_shapes=settings.memory,
            with_stack=False,
        )

    def __enter__(self) -> "RankProfiler":
        if self._prof is not None:
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)

    def at(self, ins: Instruction) -> Any:
        """Step the profiler when a new RL step begins; return the span context for `ins`."""
        if self._prof is None:
            return nullcontext()
        step = getattr(ins, "step", None)
        if step is not None and step != self._step:
            if self._step is not None:
                self._prof.step()
            self._step = step
        return torch.profiler.record_function(label(ins))


def _previous_timeline(out: Path) -> tuple[list[dict[str, Any]], float | None]:
    """The events of an earlier timeline and its time origin (None if there is none to append to)."""
    try:
        data = json.loads(out.read_text())
        return list(data["traceEvents"]), float(data["otherData"]["t0"])
    except (OSError, ValueError, KeyError, TypeError):
        return [], None


def merge_timeline(folder: Path, out: Path, *, append: bool = False) -> Path | None:
    """Merge `folder/rank*.json` into one Chrome trace (microseconds from the earliest span). With
    `append` (a resumed run), the earlier run's events stay, on the same clock, and the new ones follow."""
    files = sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if not files:
        return None
    ranks = [json.loads(p.read_text()) for p in files]
    previous, t0_before = _previous_timeline(out) if append else ([], None)
    t0 = t0_before if t0_before is not None else min((s[2] for r in ranks for s in r["spans"]), default=0.0)
    new_ranks = {r["rank"] for r in ranks}
    events: list[dict[str, Any]] = [e for e in previous if e.get("ph") != "M" or e.get("pid") not in new_ranks]
    flows = sum(1 for e in previous if e.get("ph") == "s")
    sends: dict[int, tuple[int, float]] = {}
    recvs: dict[int, tuple[int, float]] = {}
    for r in ranks:
        rank = r["rank"]
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for name, kind, start, end, tag in r["spans"]:
            events.append({"ph": "X", "name": name, "cat": kind, "pid": rank, "tid": 0,
                           "ts": (start - t0) * 1e6, "dur": max((end - start) * 1e6, 0.001)})
            if kind == "Send":
                sends[tag] = (rank, (start - t0) * 1e6)
            elif kind == "Recv":
                recvs[tag] = (rank, (end - t0) * 1e6)
    for i, tag in enumerate(sorted(set(sends) & set(recvs)), start=flows):
        (src, ts), (dst, te) = sends[tag], recvs[tag]
        events.append({"ph": "s", "id": i, "name": "rollouts", "cat": "transfer", "pid": src, "tid": 0, "ts": ts})
        events.append({"ph": "f", "id": i, "name": "rollouts", "cat": "transfer", "pid": dst, "tid": 0, "ts": te, "bp": "e"})
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"t0": t0}}))
    return out


def now() -> float:
    return time.time()
