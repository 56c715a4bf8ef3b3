"""Periodic plans: compile time and plan size against the number of steps, the CLI end to end on the
405B example, and the simulated step time of the periodic programs against the fully unrolled ones.

    python benchmarks/bench_periodic.py            # add --skip-cli to leave out the CLI timings

Targets (issue: one typed plan that holds any run length), printed with PASS/FAIL from one run:
- compile seconds and plan bytes for --steps 10, 1000, 100000: ratios to the 10-step figures <= 1.5;
- `graphrl compile examples/llama3_405b.yaml --plan` <= 2 s and `graphrl simulate examples/llama3_405b.yaml`
  <= 5 s (process start included; median of 3 after a warm-up, as bench_compile and bench_simulate time
  them: `cli_timing.py`);
- `graphrl run examples/grpo_tiny.yaml --steps 1000000` finishes its first step within 15 s;
- simulated seconds per step of the periodic program and of the unrolled one agree within 0.5%.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("GRAPHRL_CALIBRATION", "none")

from cli_timing import COMPILE_405B, SIMULATE_405B, graphrl_command, timed_row  # noqa: E402
from graphrl.compiler.compile import compile_graph, compile_job  # noqa: E402
from graphrl.compiler.pipeline import placed_programs  # noqa: E402
from graphrl.compiler.schedule import ProgramSettings  # noqa: E402
from graphrl.compiler.simulate import predicted_step, run_programs  # noqa: E402
from graphrl.loader import job_cluster, load_job  # noqa: E402
from graphrl.plan_io import plan_to_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEPS = (10, 1000, 100_000)
# Unrolled references are simulated over this many steps (the paper-scale ones are large).
UNROLLED_STEPS = {"grpo_tiny": 400, "aipo_async_tiny": 400, "ppo_tiny": 400, "llama3_8b": 40, "llama3_70b": 24,
                  "llama3_405b": 16}


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def steps_table() -> bool:
    ok = True
    print(f"{'example':<18} {'steps':>7} {'compile s':>10} {'ratio':>6} {'plan bytes':>11} {'ratio':>6}")
    for name in ("grpo_tiny", "aipo_async_tiny", "llama3_8b"):
        job = load_job(ROOT / "examples" / f"{name}.yaml")
        cluster = job_cluster(job, None)
        base: tuple[float, int] | None = None
        for steps in STEPS:
            start = time.perf_counter()
            plan = compile_job(job, cluster, steps=steps)
            seconds = time.perf_counter() - start
            size = len(plan_to_bytes(plan))
            base = base or (seconds, size)
            t_ratio, b_ratio = seconds / base[0], size / base[1]
            good = t_ratio <= 1.5 and b_ratio <= 1.5
            ok &= good
            print(f"{name:<18} {steps:>7} {seconds:>10.2f} {t_ratio:>6.2f} {size:>11} {b_ratio:>6.2f}  {verdict(good)}")
    return ok


def cli_table() -> bool:
    ok = timed_row(*COMPILE_405B)
    ok &= timed_row(*SIMULATE_405B)
    ok &= first_step_row(graphrl_command())
    return ok


def first_step_row(graphrl: list[str], steps: int = 1_000_000, target: float = 15.0) -> bool:
    """Seconds from `graphrl run examples/grpo_tiny.yaml --steps 1000000` to its first finished step
    (metrics.jsonl's first row: stricter than the step starting); the run is then ended by SIGTERM."""
    import signal
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "run" / "metrics.jsonl"
        start = time.perf_counter()
        proc = subprocess.Popen(graphrl + ["run", "examples/grpo_tiny.yaml", "--steps", str(steps), "--out",
                                           str(Path(tmp) / "run"), "-q"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None \
                and time.perf_counter() - start < 120:
            time.sleep(0.05)
        seconds = time.perf_counter() - start
        started = proc.poll() is None and metrics.exists()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    good = started and seconds < target
    print(f"graphrl run examples/grpo_tiny.yaml --steps {steps}: first step done after {seconds:6.2f} s "
          f"(target < {target:.0f} s)  {verdict(good)}")
    return good


def agreement_table() -> bool:
    ok = True
    print(f"{'example':<18} {'periodic s/step':>16} {'unrolled s/step':>16} {'steps':>6} {'error':>8}")
    for name, steps in UNROLLED_STEPS.items():
        job = load_job(ROOT / "examples" / f"{name}.yaml")
        cluster = job_cluster(job, None)
        graph = compile_graph(job, cluster, steps=steps)
        pl = graph.placement
        periodic = graph.programs
        unrolled = placed_programs(graph, ProgramSettings(steps, periodic=False))
        sim = {"periodic": predicted_step(periodic, hw=pl.hardware, devices_per_node=pl.devices_per_node).step_time_s,
               "unrolled": run_programs(unrolled, hw=pl.hardware, devices_per_node=pl.devices_per_node,
                                        timed=True).step_time_s}
        error = abs(sim["periodic"] - sim["unrolled"]) / sim["unrolled"]
        good = error <= 0.005
        ok &= good
        print(f"{name:<18} {sim['periodic']:>16.6g} {sim['unrolled']:>16.6g} {steps:>6} {error:>7.3%}  {verdict(good)}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-cli", action="store_true", help="Leave out the CLI timings.")
    args = parser.parse_args()
    ok = steps_table()
    print()
    if not args.skip_cli:
        ok &= cli_table()
        print()
    ok &= agreement_table()
    print("\nall targets met" if ok else "\nsome targets missed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
