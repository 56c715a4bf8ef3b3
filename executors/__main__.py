"""`python -m graphrl.executors PLAN --out DIR`: run one rank under torchrun (RANK, WORLD_SIZE, LOCAL_RANK
from the environment). The launch scripts that `graphrl launch` writes call this."""

from __future__ import annotations

import argparse
import os
import sys

from graphrl.errors import GraphRLError
from graphrl.executors.launcher import rank_main, refuse_unrunnable_plan
from graphrl.plan_io import load_plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphrl.executors", description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="plan file written by `graphrl compile -o` or `graphrl launch`")
    parser.add_argument("--out", required=True, help="run folder (metrics, checkpoints, errors)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--start-step", type=int, default=0)
    parser.add_argument("--resume-from", default=None, help="checkpoint folder to resume from")
    args = parser.parse_args(argv)
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError:
        print("error: RANK and WORLD_SIZE must be set (run under torchrun)", file=sys.stderr)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    try:
        refuse_unrunnable_plan(load_plan(args.plan))
    except GraphRLError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return 2
    rank_main(rank, world, args.plan, args.out, args.start_step, args.threads, args.resume_from, local_rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
