"""Wall times of whole `graphrl run` commands, start-up included, side by side in one command.

    python benchmarks/bench_failure.py

1. Learning: `examples/grpo_tiny.yaml` to its 400 steps (the run tests/integration/test_learning.py
   checks for learning). Target: under 120 s on a 2-core machine.
2. Failure: the same job for 8 steps with a reward function that raises on rank 1 at its third call,
   and one that SIGKILLs rank 1 at its fourth, against the healthy 8-step run. A failure must end the
   whole run soon after it happens: target ratio (failed / healthy) <= 2, and under 60 s each.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_tiny.yaml"
FAULTY = ROOT / "tests" / "integration"


def job(folder: Path, fn: str | None, steps: int) -> Path:
    text = EXAMPLE.read_text().replace("  steps: 400", f"  steps: {steps}\n  checkpoint_every: 1")
    if fn is not None:
        text = text.replace("fn: digits_copy", f"fn: faulty_rewards:{fn}")
    path = folder / f"{fn or 'healthy'}.yaml"
    path.write_text(text)
    return path


def timed_run(path: Path, out: Path) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": f"{FAULTY}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "graphrl.cli", "run", str(path), "--out", str(out), "-q"],
                          capture_output=True, text=True, env=env, timeout=600)
    return time.perf_counter() - started, proc.returncode


def main() -> int:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        learn, code = timed_run(EXAMPLE, folder / "learn")
        verdict = "PASS" if code == 0 and learn < 120 else "FAIL"
        ok &= verdict == "PASS"
        print(f"learning run, 400 steps        {learn:7.1f} s   (target < 120 s, exit {code})  {verdict}")
        healthy, code = timed_run(job(folder, None, 8), folder / "healthy")
        print(f"healthy run, 8 steps           {healthy:7.1f} s   (exit {code})")
        for fn in ("raise_on_rank1", "kill_rank1"):
            wall, code = timed_run(job(folder, fn, 8), folder / fn)
            ratio = wall / healthy
            verdict = "PASS" if code != 0 and ratio <= 2 and wall < 60 else "FAIL"
            ok &= verdict == "PASS"
            print(f"{fn:<16} ends the run    {wall:7.1f} s   ratio {ratio:4.2f} to healthy (target <= 2, exit {code})"
                  f"  {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
