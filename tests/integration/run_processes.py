"""What the fault-handling tests check after a run ended: that none of its rank processes is left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def no_rank_processes_left(out_dir: Path) -> bool:
    """No rank of this run is left: none names its plan, and no spawned process of this interpreter
    (other checkouts' test runs on a shared machine spawn theirs from their own interpreters) is running."""
    ps = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout.splitlines()
    running = [line.split(None, 1)[-1] for line in ps if not line.startswith("Z")]
    return not any(str(out_dir / "plan.msgpack") in args or (args.startswith(sys.executable) and
                                                             "multiprocessing.spawn" in args) for args in running)


def cli_run(example: Path, out: Path, sets: tuple[str, ...], *, steps: int, resume: bool = False) -> tuple[str, list[dict]]:
    """`graphrl run example` quietly with `--set` for each of `sets`: (its first output line, which names the
    layout; the rows of its metrics.jsonl). A failed run fails the test with the command's output."""
    import json

    from click.testing import CliRunner

    from graphrl.cli import main

    args = ["run", str(example), "--steps", str(steps), "--out", str(out), "-q", *(["--resume"] if resume else [])]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result.output.splitlines()[0], [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
