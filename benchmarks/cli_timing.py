"""The CLI's own seconds on the 405B example, as a user waits for them: one definition of what is timed and
of the targets, for every benchmark that reports them (bench_compile, bench_simulate, bench_periodic).

Each command runs as a subprocess (interpreter start-up and imports included), once to warm the file
cache and write the bytecode (`USER_ENV`), then `RUNS` times; the median is compared with its target.
Wall-clock seconds on a shared machine include time the process waited for a core, so the process's own
CPU seconds (its children's too: the compiler plans a large weight sync on a second core) and the load
average are printed beside them.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB_405B = "examples/llama3_405b.yaml"
RUNS = 3

# (what is timed, its arguments, the target in seconds): previews are used interactively, so they must
# stay well under the time a user waits without switching away.
COMPILE_405B = ("405B compile", ["compile", JOB_405B, "--plan"], 2.0)
SIMULATE_405B = ("405B simulate", ["simulate", JOB_405B], 5.0)


# The environment a user's shell gives the command: Python writes bytecode on the first run and reads it
# after (a shell that sets PYTHONDONTWRITEBYTECODE would time compiling every changed module from source on
# every run, which no user's second run does).
USER_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def graphrl_command() -> list[str]:
    """The installed `graphrl` script beside this interpreter, or the module where it is not installed."""
    script = Path(sys.executable).with_name("graphrl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "graphrl.cli"]


def run_once(args: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one `graphrl ARGS` run in the repository root; raises if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(graphrl_command() + args, cwd=ROOT, capture_output=True, text=True, env=USER_ENV)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"graphrl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def timed_row(name: str, args: list[str], target_s: float, runs: int = RUNS) -> bool:
    """Time `graphrl ARGS` (one warm-up, then the median of `runs`) and print it beside its target as
    `NAME: X.XX s (target <= T s) PASS|FAIL`; return whether it met the target."""
    run_once(args)
    samples = [run_once(args) for _ in range(runs)]
    wall = statistics.median(s[0] for s in samples)
    cpu = statistics.median(s[1] for s in samples)
    ok = wall <= target_s
    print(f"{name}: {wall:.2f} s (target <= {target_s:g} s) {'PASS' if ok else 'FAIL'}   "
          f"[`graphrl {' '.join(args)}`, median of {runs} after a warm-up; CPU {cpu:.2f} s; "
          f"load average {os.getloadavg()[0]:.1f}]", flush=True)
    return ok


__all__ = ["COMPILE_405B", "RUNS", "SIMULATE_405B", "graphrl_command", "run_once", "timed_row"]
