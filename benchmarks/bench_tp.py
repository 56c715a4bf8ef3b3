"""Tensor-parallel generation on 2 CPU ranks, measured against its prediction, side by side in one command.

    python benchmarks/bench_tp.py [--steps 12]

1. `examples/grpo_tiny.yaml`, colocated on 2 ranks, run by `graphrl run` with the generator pinned to
   tp=1 x dp=2 and to tp=2 x dp=1: measured seconds per generated token (each step's slowest rank's
   Generate spans from the run's timeline, over the steps after the first 3, divided by the tokens the
   step may generate: responses x max_new_tokens) beside the simulator's prediction from the plan's
   Generate duration, and the tp=2 / tp=1 ratio of both. On a CPU with 2 cores tp=2 is expected to be
   slower (each rank does half the math on half the rows' worth of weights but waits on an all-reduce
   per row-parallel layer); the point is that the prediction orders the two layouts as measured.
2. DDMA into tp=2 generator shards against raw `batch_isend_irecv` of the same bytes, from
   benchmarks/bench_weight_sync.py's `-> tp2` cases (same model): on the fsdp=2 trainer's 2 ranks (all
   but the norms copied rank-locally, against one flat copy of the same bytes), the same with the
   trainer's ranks swapped (every block crosses), and on 2 ranks of its own beside a 1-rank trainer
   (3 processes). Target >= 0.9, on the best of each path's runs; the median ratio is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_tiny.yaml"
WARMUP = 3


def generation(run_dir: Path, steps: int) -> tuple[float, float, int]:
    """(measured, predicted) seconds per generated token, and the tokens per step."""
    from graphrl.plan_io import load_plan

    plan = load_plan(run_dir / "plan.msgpack")
    spec = plan.job.nodes
    data = next(n for n in spec.values() if n.op == "dataset")
    gen = next(n for n in spec.values() if n.op == "generate")
    tokens = data.batch_size * gen.samples_per_prompt * gen.max_new_tokens
    events = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    per_step: dict[int, dict[int, float]] = {}
    for e in events:
        if e.get("cat") == "Generate":
            step = int(e["name"].split("step=")[1].split()[0])
            ranks = per_step.setdefault(step, {})
            ranks[e["pid"]] = ranks.get(e["pid"], 0.0) + e["dur"] / 1e6
    measured = [max(ranks.values()) for step, ranks in sorted(per_step.items()) if step >= WARMUP]
    predicted = next(v for k, v in plan.programs.durations.items() if str(k).startswith("Generate"))
    return sum(measured) / len(measured) / tokens, predicted / tokens, tokens


def run(tp: int, steps: int, out: Path) -> str:
    args = [sys.executable, "-m", "graphrl.cli", "run", str(EXAMPLE), "--steps", str(steps), "--out", str(out), "-q",
            "--set", "placement.strategy=colocated", "--set", f"placement.roles.policy/generate.tp={tp}"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"tp={tp} run failed:\n{proc.stderr}{proc.stdout}")
    return proc.stdout.splitlines()[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="steps of each run")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tp in (1, 2):
            label = run(tp, args.steps, Path(tmp) / f"tp{tp}")
            rows[tp] = (label, *generation(Path(tmp) / f"tp{tp}", args.steps))
    print(f"generation, grpo_tiny colocated on 2 CPU ranks, {args.steps} steps (first {WARMUP} left out)")
    print(f"{'generator':<22} {'measured us/token':>18} {'predicted us/token':>19}")
    for tp, (label, measured, predicted, _) in rows.items():
        print(f"{'tp' + str(tp) + ' x dp' + str(2 // tp):<22} {measured * 1e6:>18.2f} {predicted * 1e6:>19.2f}")
    m_ratio, p_ratio = rows[2][1] / rows[1][1], rows[2][2] / rows[1][2]
    same_order = (m_ratio > 1) == (p_ratio > 1)
    print(f"{'tp2 / tp1':<22} {m_ratio:>18.2f} {p_ratio:>19.2f}   prediction orders them as measured: "
          f"{'PASS' if same_order else 'FAIL'}")

    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_weight_sync.py"), "--json"],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"bench_weight_sync failed:\n{proc.stderr}")
    ok = same_order
    print("\nDDMA into tp=2 shards, against raw batch_isend_irecv of the same bytes (bench_weight_sync.py)")
    for line in proc.stdout.splitlines():
        row = json.loads(line)
        if "tp2" not in row["case"]:
            continue
        gb = row["delivered_bytes"] / 1e9  # over the link and rank-local
        ratio, median = row["raw_s"] / row["ddma_s"], row["raw_median_s"] / row["ddma_median_s"]
        verdict = "PASS" if ratio >= 0.9 and row["exact"] else "FAIL"
        ok &= verdict == "PASS"
        print(f"{row['case']:<38} ddma {gb / row['ddma_s']:6.2f} GB/s   raw {gb / row['raw_s']:6.2f} GB/s   "
              f"ddma/raw {ratio:4.2f} (target >= 0.9; median {median:4.2f})  exact {row['exact']}  {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
