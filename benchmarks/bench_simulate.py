"""Simulator and scheduler speed at 405B scale, and predicted speed-ups of the paper-scale examples.

    python benchmarks/bench_simulate.py

Target: `graphrl simulate examples/llama3_405b.yaml` (compile, then the chosen programs, the other
schedule and the baseline simulated; process start included) takes at most 5 s, the median of 3 runs
after a warm-up (`cli_timing.py`, which bench_periodic shares). Beside it, without targets of their own:
the in-process seconds of compiling the 405B plan for 100 steps and of simulating all 100 of its steps
on 1024 ranks (instructions per second); then, side by side for 8B / 70B / 405B, the chosen plan's
simulated seconds per step, the colocated-synchronous baseline's, and the ratio.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("GRAPHRL_CALIBRATION", "none")

from cli_timing import SIMULATE_405B, timed_row  # noqa: E402
from graphrl.compiler.compile import compile_graph  # noqa: E402
from graphrl.compiler.pipeline import placed_programs  # noqa: E402
from graphrl.compiler.schedule import ProgramSettings  # noqa: E402
from graphrl.compiler.simulate import run_programs  # noqa: E402
from graphrl.loader import job_cluster, load_job  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ok = timed_row(*SIMULATE_405B)
    job = load_job(ROOT / "examples" / "llama3_405b.yaml")
    cluster = job_cluster(job, None)
    t = time.perf_counter()
    graph = compile_graph(job, cluster, steps=100)
    compile_s = time.perf_counter() - t
    programs = graph.programs
    placed = graph.placement
    instructions = sum(len(s) for s in programs.streams)
    t = time.perf_counter()
    run_programs(programs, hw=placed.hardware, devices_per_node=placed.devices_per_node, timed=True)
    sim_s = time.perf_counter() - t
    print(f"\n405B on {cluster.num_devices} ranks, 100 steps, {instructions} instructions, in process")
    print(f"  compile + schedule + verify: {compile_s:6.2f} s")
    print(f"  simulate all 100 steps:      {sim_s:6.2f} s  ({instructions / sim_s:,.0f} instructions/s)")

    print(f"\n{'example':<12} {'chosen s/step':>14} {'baseline s/step':>16} {'speed-up':>9}  {'sync':>9} {'async':>9}  chosen")
    for name in ("llama3_8b", "llama3_70b", "llama3_405b"):
        job = load_job(ROOT / "examples" / f"{name}.yaml")
        graph = compile_graph(job, job_cluster(job, None), steps=20)
        pl = graph.placement

        def simulate(programs):  # noqa: ANN001, ANN202
            return run_programs(programs, hw=pl.hardware, devices_per_node=pl.devices_per_node, timed=True).step_time_s

        chosen = simulate(graph.programs)
        baseline = simulate(placed_programs(graph, ProgramSettings(20, mode="sync"), baseline=True))
        sync = simulate(placed_programs(graph, ProgramSettings(20, mode="sync")))
        print(f"{name:<12} {chosen:14.1f} {baseline:16.1f} {baseline / chosen:8.2f}x  {sync:9.1f} {chosen:9.1f}  "
              f"{pl.chosen.label}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
