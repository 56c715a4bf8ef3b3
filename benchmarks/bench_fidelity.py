"""Predicted against measured seconds per step and per phase, on this machine, for every example kind.

    python benchmarks/bench_fidelity.py [--cases tiny,smollm2,...] [--calibration FILE] [--out DIR]

1. Writes each case's job (an example with the case's overrides) to a job file of its own, then calibrates
   once (`graphrl calibrate` with all of them, so the matmul shapes, vocabulary work, optimizer and model
   code of each case's job are measured in its dtype, threads and sizes), unless a file is given.
2. For each case: runs the job (`graphrl run`, the plan compiled with that calibration) for enough steps
   to pass warm-up, and reads the run's report (`graphrl.report.build_report`): the measured median
   seconds per step after warm-up and per phase, beside the plan's prediction (the simulator's steady
   state, phases from the simulated instruction spans). Without a calibration (the machine-independent
   defaults the tests use), the same job's plan is compiled again and its prediction compared with the
   same measurement.

Target: with calibration, every case's step time within 15% and every phase within 25% of measured
(phases under 5% of the step are listed, not judged: their absolute error is below the step's noise).
The final checkpoint is not a step phase (the run writes it after the last step) and is left out.
Column `machine`: each run's speed after it against the calibration (`graphrl.calibration.machine_speed`:
the calibration's largest matmul timed again; 0.90x is a machine 10% slower than when it was calibrated),
reported beside the error, not used to correct it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
STEP_TARGET_PCT = 15.0
PHASE_TARGET_PCT = 25.0
JUDGED_PHASE_SHARE = 0.05


@dataclass(frozen=True)
class Case:
    name: str
    job: str
    overrides: tuple[str, ...]
    steps: int
    warmup: int


CASES = {
    "tiny-colocated": Case("grpo_tiny colocated sync, 2 ranks", "grpo_tiny.yaml",
                           ("schedule.mode=sync", "placement.strategy=colocated"), 40, 5),
    "aipo-async": Case("aipo_async_tiny disaggregated async, 2 ranks", "aipo_async_tiny.yaml", (), 40, 5),
    "tiny-tp2": Case("grpo_tiny, tp=2 generator, 2 ranks", "grpo_tiny.yaml",
                     ("placement.roles.policy/generate.tp=2",), 40, 5),
    "ppo": Case("ppo_tiny, 2 ranks", "ppo_tiny.yaml", (), 40, 5),
    "smollm2": Case("SmolLM2-135M, 1 rank, 4x4 x 40 tokens", "grpo_smollm2_arith.yaml", (), 7, 2),
    "smollm2-8x8": Case("SmolLM2-135M, 1 rank, 8x8 x 64 tokens", "grpo_smollm2_arith.yaml",
                        ("nodes.prompts.batch_size=8", "nodes.rollout.samples_per_prompt=8",
                         "nodes.rollout.max_new_tokens=64"), 5, 2),
}


def graphrl(*args: str, calibration: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GRAPHRL_CALIBRATION=calibration)
    return subprocess.run([str(Path(sys.executable).parent / "graphrl"), *args], cwd=EXAMPLES, env=env, text=True,
                          capture_output=True, check=False)


def checked(proc: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def write_job(case: Case, path: Path) -> str:
    """The case's job with its overrides applied, as a job file of its own (its checkpoint and dataset
    paths absolute), so that calibration measures exactly the job each case runs."""
    import yaml

    from graphrl.loader import apply_overrides, load_job, parse_override

    loaded = apply_overrides(load_job(EXAMPLES / case.job), [parse_override(o) for o in case.overrides])
    path.write_text(yaml.safe_dump(loaded.spec.model_dump(mode="json", exclude_none=True), sort_keys=False))
    return str(path)


def predicted_phases(plan_path: Path) -> tuple[float, dict[str, float]]:
    """The plan's predicted seconds per step and per phase (from the simulated spans, as the report
    computes them)."""
    from graphrl.plan_io import load_plan
    from graphrl.report.compare import simulated_spans
    from graphrl.report.spans import phase_of, seconds_per_kind, steady_spans

    plan = load_plan(plan_path)
    steady, kept = steady_spans(simulated_spans(plan), 1)
    phases: dict[str, float] = {}
    for kind, seconds in seconds_per_kind(steady, max(len(kept), 1)).items():
        phases[phase_of(kind)] = phases.get(phase_of(kind), 0.0) + seconds
    return plan.chosen.estimate.step_time_s, phases


def run_case(key: str, case: Case, job: str, calibration: str, out: Path) -> dict:
    from graphrl.report import build_report

    run_dir = out / key
    checked(graphrl("run", job, "--steps", str(case.steps), "--out", str(run_dir), "--overwrite", "-q",
                    calibration=calibration), f"run of {key}")
    report = build_report(run_dir, warmup_steps=case.warmup).data
    steady = [r["measured_s"] for r in report["step_times"] if not r["warmup"] and r["measured_s"] is not None]
    measured_step = statistics.median(steady)
    phases = {r["phase"]: (r["predicted_s"], r["measured_s"]) for r in report["phases"]["rows"]}
    default_plan = out / f"{key}-default.plan"
    default = graphrl("compile", job, "-o", str(default_plan), calibration="none")
    # The defaults describe a small device (4 GiB); a job larger than that has no default prediction.
    default_step, default_phases = predicted_phases(default_plan) if default.returncode == 0 else (None, {})
    return {"case": case.name, "measured": measured_step, "predicted": report["summary"]["predicted_step_time_s"],
            "default": default_step, "phases": phases, "default_phases": default_phases,
            "machine": report["summary"]["machine_speed"]}


def pct(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured <= 0:
        return None
    return 100.0 * (predicted - measured) / measured


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--calibration", help="a hardware file to use instead of calibrating first")
    parser.add_argument("--out", type=Path, help="folder for the runs (default: a temporary one)")
    args = parser.parse_args()
    keys = [k.strip() for k in args.cases.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="graphrl-fidelity-"))
    out.mkdir(parents=True, exist_ok=True)
    jobs = {key: write_job(CASES[key], out / f"{key}.yaml") for key in keys}
    calibration = args.calibration
    if calibration is None:
        calibration = str(out / "calibration.json")
        print(f"calibrating with the jobs of {', '.join(keys)} ...", flush=True)
        checked(graphrl("calibrate", "-o", calibration, *jobs.values(), calibration=calibration), "calibration")

    rows = []
    for key in keys:
        print(f"running {CASES[key].name} ...", flush=True)
        rows.append(run_case(key, CASES[key], jobs[key], calibration, out))

    print("\nseconds per step (median after warm-up), predicted against measured")
    print(f"{'case':<44} {'measured':>9} {'calibrated':>11} {'error':>7} {'default':>9} {'error':>7} {'machine':>8}")
    failures = []
    for r in rows:
        err = pct(r["predicted"], r["measured"])
        default = "no fit" if r["default"] is None else f"{r['default']:.4f}"
        machine = "-" if r["machine"] is None else f"{r['machine']:.2f}x"
        print(f"{r['case']:<44} {r['measured']:>9.4f} {r['predicted']:>11.4f} {fmt_pct(err):>7} "
              f"{default:>9} {fmt_pct(pct(r['default'], r['measured'])):>7} {machine:>8}")
        if err is None or abs(err) > STEP_TARGET_PCT:
            failures.append(f"{r['case']}: step {fmt_pct(err)}")

    print("\nseconds per step by phase (calibrated prediction; * = under 5% of the step, not judged)")
    print(f"{'case':<44} {'phase':<12} {'measured':>9} {'predicted':>10} {'error':>7} {'default':>9} {'error':>7}")
    for r in rows:
        for phase, (predicted, measured) in r["phases"].items():
            if phase == "checkpoint":
                continue
            err = pct(predicted, measured)
            default = r["default_phases"].get(phase)
            judged = measured is not None and measured >= JUDGED_PHASE_SHARE * r["measured"]
            print(f"{r['case']:<44} {phase + ('' if judged else ' *'):<12} "
                  f"{measured if measured is not None else float('nan'):>9.4f} "
                  f"{predicted if predicted is not None else float('nan'):>10.4f} {fmt_pct(err):>7} "
                  f"{default if default is not None else float('nan'):>9.4f} {fmt_pct(pct(default, measured)):>7}")
            if judged and (err is None or abs(err) > PHASE_TARGET_PCT):
                failures.append(f"{r['case']}: {phase} {fmt_pct(err)}")
    print(f"\ntarget: step within {STEP_TARGET_PCT:.0f}%, phases within {PHASE_TARGET_PCT:.0f}% (calibrated): "
          + ("PASS" if not failures else "FAIL (" + "; ".join(failures) + ")"))
    print(f"runs in {out}")


if __name__ == "__main__":
    main()
