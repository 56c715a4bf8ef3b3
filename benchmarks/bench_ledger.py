"""What each rank holds against what the plan charges, per trainer layout kind, and the step time before and
after ZeRO-1/2 ran for real, side by side in one command.

    python benchmarks/bench_ledger.py [--base 9340e5f] [--ranks 2] [--steps 12] [--rounds 2]

For each layout kind (none = DDP, zero1, zero2, fsdp, tp) grpo_tiny runs colocated on CPU ranks, pinned
with `--set`, once with this tree and once with the base commit (checked out with `git worktree add
--detach` under the system's temp folder and imported from there), alternating per round so both sides
see the same machine load. Reported per kind:

- the ledger of rank 0 (`ledger/rank0.json`): weights, gradients and optimizer state measured after the
  last step, the plan's resting state for the rank, their ratio (target within 5%), and the plan's peak
  with the gathered FSDP2 copies; the base's ratio beside it (zero1 and zero2 ran as DDP there);
- seconds per step, the median over the steps after the warm-up, of the best round of each side, and
  their ratio new / base (target <= 1.05 on the same layout; zero2 now gathers weights through FSDP2
  where the base ran DDP, so its ratio compares two executions of the same plan entry).

Measured on the project's 2-core CPU machine (nothing else running), 2 ranks: ledger/plan 1.000 (none,
zero2, fsdp), 1.003 (zero1: the shares are whole tensors), 1.002 (tp); the base held 1.600x its plan for
zero1, 1.778x for zero2, 0.802x for fsdp. Step time new/base moves by 10-30% from one invocation to the
next on this machine (the base ran none and zero2 alike, as DDP, and they differed by 26% in one
command), so read single ratios with care. With the defaults (12 steps, 3 rounds): none 0.71, zero1 1.19,
zero2 1.17, fsdp 0.64, tp 0.94; with `--steps 30 --rounds 5`: none 0.99, zero1 0.84, zero2 0.99. A
colocated generator samples from a zero2 trainer's weights gathered in place (the sync's gather is the
one the next forward would do) and from a one-unit fsdp trainer's; beside an fsdp trainer of several
units it gathers its own copy a unit at a time (it was a collective per tensor: zero2 read 1.95 before
that).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS: dict[str, tuple[str, ...]] = {
    "none": ("placement.roles.policy.sharding=none", "placement.roles.policy.tp=1"),
    "zero1": ("placement.roles.policy.sharding=zero1", "placement.roles.policy.tp=1"),
    "zero2": ("placement.roles.policy.sharding=zero2", "placement.roles.policy.tp=1"),
    "fsdp": ("placement.roles.policy.sharding=fsdp", "placement.roles.policy.tp=1"),
    "tp": ("placement.roles.policy.tp=2",),
}
PACKAGES = {"compiler": "compiler", "executors": "executors", "schemas": "schemas"}


def base_tree(rev: str, scratch: Path) -> tuple[Path, Path]:
    """(checkout, import root) of `rev`: a detached worktree, and a folder whose `graphrl` package maps
    the subpackages as pyproject's package-dir does (graphrl.compiler -> compiler/ ...)."""
    checkout = scratch / f"base-{rev}"
    if not checkout.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(checkout), rev], check=True,
                       capture_output=True)
    site = scratch / f"site-{rev}"
    package = site / "graphrl"
    if not package.exists():
        package.mkdir(parents=True)
        for entry in (checkout / "graphrl").iterdir():
            (package / entry.name).symlink_to(entry)
        for name, folder in PACKAGES.items():
            (package / name).symlink_to(checkout / folder)
    return checkout, site


def run_once(tree: Path, site: Path | None, kind: str, ranks: int, steps: int, out: Path) -> dict:
    env = {**os.environ, "GRAPHRL_CALIBRATION": "none"}
    cwd = tree
    if site is not None:  # the base's modules, found ahead of this tree's editable install (from the cwd too)
        env["PYTHONPATH"], cwd = str(site), site
    args = [sys.executable, "-m", "graphrl.cli", "run", str(tree / "examples" / "grpo_tiny.yaml"), "--cluster", f"local-cpu-{ranks}",
            "--strategy", "colocated", "--steps", str(steps), "--out", str(out), "-q"]
    for s in KINDS[kind]:
        args += ["--set", s]
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{kind} in {tree} failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    warm = max(1, len(rows) // 3)
    ledger = json.loads((out / "ledger" / "rank0.json").read_text())
    return {"step_s": statistics.median(r["step_time_s"] for r in rows[warm:]), "ledger": ledger}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="9340e5f", help="commit to compare with (before ZeRO-1/2 ran for real)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated layout kinds")
    parser.add_argument("--keep", action="store_true", help="keep the base worktree for another run")
    args = parser.parse_args()
    scratch = Path(tempfile.gettempdir()) / "graphrl-bench-ledger"
    scratch.mkdir(exist_ok=True)
    base, site = base_tree(args.base, scratch)
    try:
        measure(args, scratch, base, site)
    finally:
        if not args.keep:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
            shutil.rmtree(site, ignore_errors=True)


def measure(args: argparse.Namespace, scratch: Path, base: Path, site: Path) -> None:
    kinds = args.kinds.split(",")
    results: dict[tuple[str, str], list[dict]] = {}
    for round_ in range(args.rounds):
        for kind in kinds:
            for side, tree, path in (("base", base, site), ("new", ROOT, None)):
                out = scratch / f"{side}-{kind}-{round_}"
                shutil.rmtree(out, ignore_errors=True)  # a run refuses a folder an earlier invocation left
                results.setdefault((side, kind), []).append(run_once(tree, path, kind, args.ranks, args.steps, out))
    print(f"grpo_tiny colocated on {args.ranks} CPU ranks, {args.steps} steps, best of {args.rounds} rounds; "
          f"base {args.base}")
    print(f"{'kind':6} {'wrapping':9} {'held B':>9} {'plan B':>9} {'ratio':>6} {'peak B':>9} {'base ratio':>10} "
          f"{'base s':>8} {'new s':>8} {'new/base':>8}")
    for kind in kinds:
        new, old = results[("new", kind)], results[("base", kind)]
        ledger, old_ledger = new[-1]["ledger"], old[-1]["ledger"]
        new_s, old_s = min(r["step_s"] for r in new), min(r["step_s"] for r in old)
        print(f"{kind:6} {ledger['wrappings'].get('policy', '?'):9} {ledger['measured_state_bytes']:9.0f} "
              f"{ledger['planned_state_bytes']:9.0f} {ledger['ratio']:6.3f} {ledger['planned_peak_state_bytes']:9.0f} "
              f"{old_ledger['ratio']:10.3f} {old_s:8.4f} {new_s:8.4f} {new_s / old_s:8.3f}")


if __name__ == "__main__":
    main()
