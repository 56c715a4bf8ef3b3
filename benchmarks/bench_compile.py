"""Compile every example: wall time and candidates per second; beam search against exhaustive search.

    python benchmarks/bench_compile.py

Targets, printed with PASS/FAIL from one run:
- `graphrl compile examples/llama3_405b.yaml --plan` (the 405B job on 1024 GPUs, search, programs, verify
  and preview, process start included) takes at most 2 s, the median of 3 runs after a warm-up
  (`cli_timing.py`, which bench_periodic shares);
- on clusters small enough to enumerate, the beam's plan is within 2% of the exhaustive optimum.
The in-process seconds of every example are printed beside them, without a target of their own.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("GRAPHRL_CALIBRATION", "none")

from cli_timing import COMPILE_405B, timed_row  # noqa: E402
from graphrl.compiler.compile import compile_job  # noqa: E402
from graphrl.errors import JobError  # noqa: E402
from graphrl.loader import job_cluster, load_job  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def timed(job, cluster, **options):  # noqa: ANN001, ANN201
    t = time.perf_counter()
    plan = compile_job(job, cluster, **options)
    return plan, time.perf_counter() - t


def main() -> int:
    ok = timed_row(*COMPILE_405B)
    print(f"\n{'example':<22} {'cluster':<14} {'wall s':>7} {'candidates':>10} {'cand/s':>9} {'step s':>10} {'speedup':>8}  chosen")
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        try:
            job = load_job(path)
        except JobError as exc:  # an example whose checkpoint is made locally (examples/arith)
            print(f"{path.stem:<22} skipped: {exc.render().splitlines()[0]}")
            continue
        cluster = job_cluster(job, None)
        plan, wall = timed(job, cluster)
        base = plan.baseline.estimate.step_time_s / plan.chosen.estimate.step_time_s if plan.baseline else float("nan")
        print(f"{path.stem:<22} {cluster.name:<14} {wall:7.2f} {plan.candidates_considered:10d} "
              f"{plan.candidates_considered / wall:9.0f} {plan.chosen.estimate.step_time_s:10.4g} {base:8.2f}  {plan.chosen.label}")
    print("\nbeam versus exhaustive search on enumerable clusters")
    for name, cluster_file in (("llama3_8b", "h200_8.yaml"), ("llama3_8b", "h100_64.yaml"), ("ppo_tiny", None),
                               ("grpo_tiny", None)):
        job = load_job(ROOT / "examples" / f"{name}.yaml")
        cluster = job_cluster(job, str(ROOT / "examples" / "clusters" / cluster_file) if cluster_file else None)
        beam, t_beam = timed(job, cluster)
        full, t_full = timed(job, cluster, exhaustive=True)
        gap = beam.chosen.estimate.step_time_s / full.chosen.estimate.step_time_s - 1
        verdict = gap <= 0.02
        ok &= verdict
        print(f"  {name:<10} on {cluster.name:<10} beam {t_beam:6.2f} s ({beam.candidates_considered} cand)  "
              f"exhaustive {t_full:6.2f} s ({full.candidates_considered} cand)  gap {gap * 100:+.2f}% "
              f"(target <= 2%) {'PASS' if verdict else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
