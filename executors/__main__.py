"""`python -m graphrl.executors PLAN --out DIR`: run one rank under torchrun (RANK, WORLD_SIZE, LOCAL_RANK
from the environment). The launch scripts that `graphrl launch` writes call this.

Rank 0 takes the run folder as `graphrl run` does (`runfolder.py`: the folder's marker, one writer, the
job's identity) and tells every rank where the run starts: a folder that holds this job's run continues
from its newest intact checkpoint, so a script a scheduler starts again after a preemption carries on
where the stopped run checkpointed. SIGTERM (torchrun passes on its own; SLURM's `--signal`) stops every
rank after its step with a checkpoint, as in a local run."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from graphrl.errors import GraphRLError
from graphrl.executors.launcher import rank_main, refuse_unrunnable_plan
from graphrl.executors.runfolder import RunFolder, claim_run_folder, read_record, record_outcome
from graphrl.executors.runtime import collective_timeout_s, pick_device
from graphrl.plan_io import load_plan
from graphrl.schemas.plan import Plan

_FOLDER: list[RunFolder] = []  # rank 0's claim on the run folder, held while the process lives


def where_to_start(plan: Plan, out: Path, rank: int) -> dict[str, Any]:
    """Rank 0's decision, for every rank: {'step', 'checkpoint'}, {'done': why} or {'error': message}."""
    if rank != 0:
        return {}
    lines: list[str] = []
    try:
        folder = claim_run_folder(out, plan.job, resume=read_record(out) is not None, overwrite=False,
                                  command=f"python -m graphrl.executors (pid {os.getpid()})")
        _FOLDER.append(folder)
        assert plan.programs is not None
        start = folder.begin(plan.job, plan.programs.steps, say=lines.append)
    except GraphRLError as exc:
        return {"error": exc.render()}
    for line in lines + (start.notes if start is not None else []):
        print(line, file=sys.stderr)
    if start is None:
        return {"done": "nothing left to run"}
    return {"step": start.step, "checkpoint": None if start.checkpoint is None else str(start.checkpoint)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphrl.executors", description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="plan file written by `graphrl compile -o` or `graphrl launch`")
    parser.add_argument("--out", required=True, help="run folder (metrics, checkpoints, errors)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args(argv)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError:
        print("error: RANK and WORLD_SIZE must be set (run under torchrun)", file=sys.stderr)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    try:
        plan = load_plan(args.plan)  # `graphrl launch` verified it when it wrote it
        refuse_unrunnable_plan(plan)
    except GraphRLError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return 2
    device = pick_device(plan.job.run.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=collective_timeout_s()))
    decision = [where_to_start(plan, Path(args.out), rank)]
    if world > 1:
        dist.broadcast_object_list(decision, src=0)
    start = decision[0]
    if "error" in start or "done" in start:
        if rank == 0:
            print(f"error: {start['error']}" if "error" in start else start["done"], file=sys.stderr)
        return 2 if "error" in start else 0
    try:
        rank_main(rank, world, args.plan, args.out, start["step"], args.threads, start["checkpoint"], local_rank)
    except SystemExit as end:
        if rank == 0:
            record_outcome(Path(args.out), "stopped" if end.code not in (0, 1, None) else "failed", last_step=None)
        raise
    if rank == 0:
        record_outcome(Path(args.out), "finished", last_step=plan.programs.steps - 1 if plan.programs else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
