"""LoRA beside full training, measured on the same job in one command: the SmolLM2 arithmetic example
(`examples/grpo_smollm2_arith.yaml`, SmolLM2-135M-Instruct, float32) on two CPU ranks, its generator on rank 0
and its trainer on rank 1, so that every step's weight sync crosses between processes (DDMA), trained in full
and with rank-16 adapters on every projection (`examples/grpo_lora_smollm2_arith.yaml`'s).

Per configuration, taking turns (full, LoRA, full, ...) for --repeat rounds of --steps steps each:
- step: the median of the runs' `step_time_s` after the first step (warm-up);
- sync: the median of the trainer rank's WeightSync spans after version 0 (the DDMA transfer and, for LoRA,
  the delivery check), and the bytes the plan moves per sync;
- state: the trainer rank's weights, gradients and optimizer state as its ledger measured them (what the plan
  charged beside it);
- peak RSS: the largest peak resident set (VmHWM) of any process of the run: the trainer rank's, here.
The run folders are written under --out and removed after (the checkpoints are hundreds of MB).

    python benchmarks/bench_lora.py [--steps 4] [--repeat 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from graphrl.plan_io import load_plan

ROOT = Path(__file__).resolve().parents[1]
FULL = ROOT / "examples" / "grpo_smollm2_arith.yaml"
LORA = ROOT / "examples" / "grpo_lora_smollm2_arith.yaml"
LAYOUT = ("cluster=local-cpu-2", "placement.strategy=disaggregated", "placement.roles.policy/generate.devices=0-0",
          "placement.roles.policy.devices=1-1", "schedule.checkpoint_every=0")


def _peak_rss(proc: subprocess.Popen) -> int:
    """Wait for `proc`; the largest peak resident set (VmHWM) any process of its tree reached, read every
    0.2 s while it runs (a rank's last reading before it exits stands for its peak)."""
    import psutil

    peaks: dict[int, int] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                status = Path(f"/proc/{p.pid}/status").read_text()
            except OSError:
                continue
            line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), None)
            if line is not None:
                peaks[p.pid] = int(line.split()[1]) * 1024
        time.sleep(0.2)
    return max(peaks.values(), default=0)


def run_once(job: Path, out: Path, steps: int) -> dict:
    args = [sys.executable, "-m", "graphrl.cli", "run", str(job), "--steps", str(steps), "--out", str(out), "-q",
            "--overwrite"]
    for s in LAYOUT:
        args += ["--set", s]
    log = out.with_suffix(".log")
    with open(log, "w") as sink:
        proc = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
        rss = _peak_rss(proc)
    if proc.wait() != 0:
        raise SystemExit(f"{job.name} failed:\n{log.read_text()[-3000:]}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = json.loads((out / "timeline.json").read_text())["traceEvents"]
    syncs = [e["dur"] / 1e6 for e in events if e.get("cat") == "WeightSync" and e.get("pid") == 1
             and not e["name"].endswith("v=0")]
    ledger = json.loads((out / "ledger" / "rank1.json").read_text())
    plan = load_plan(out / "plan.msgpack")
    sync_bytes = next((op.num_bytes for op in plan.chosen.operations if op.kind == "weight_sync"), None)
    return {"steps": [m["step_time_s"] for m in metrics[1:]], "syncs": syncs,
            "state_bytes": ledger["measured_state_bytes"], "planned_state_bytes": ledger["planned_state_bytes"],
            "sync_bytes": sync_bytes, "rss_bytes": rss,
            "reward": [m["reward_mean"] for m in metrics]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="where the run folders go (default: a temporary one)")
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_lora_", dir=a.out))
    runs: dict[str, list[dict]] = {"full": [], "lora": []}
    try:
        for _ in range(a.repeat):
            for name, job in (("full", FULL), ("lora", LORA)):
                runs[name].append(run_once(job, root / name, a.steps))
                shutil.rmtree(root / name, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    table = {}
    for name, rs in runs.items():
        table[name] = {
            "step_s": statistics.median(s for r in rs for s in r["steps"]),
            "sync_s": statistics.median(s for r in rs for s in r["syncs"]) if any(r["syncs"] for r in rs) else None,
            "sync_bytes": rs[0]["sync_bytes"],
            "trainer_state_bytes": rs[0]["state_bytes"], "planned_state_bytes": rs[0]["planned_state_bytes"],
            "peak_rss_bytes": max(r["rss_bytes"] for r in rs),
        }
    if a.json:
        print(json.dumps(table, indent=1))
        return
    full, lora = table["full"], table["lora"]
    print(f"SmolLM2-135M, 2 CPU ranks (generator | trainer), {a.repeat} x {a.steps} steps each, taking turns")
    print(f"{'':28}{'full':>14}{'lora':>14}{'lora/full':>11}")
    rows = [("step (median s)", "step_s", "{:.2f}"), ("weight sync (median s)", "sync_s", "{:.3f}"),
            ("sync bytes (plan)", "sync_bytes", "{:,.0f}"), ("trainer state bytes", "trainer_state_bytes", "{:,.0f}"),
            ("  planned", "planned_state_bytes", "{:,.0f}"), ("peak RSS bytes", "peak_rss_bytes", "{:,.0f}")]
    for label, key, fmt in rows:
        f, lo = full[key], lora[key]
        ratio = f"{lo / f:.3f}" if f and lo is not None else "-"
        print(f"{label:28}{fmt.format(f) if f is not None else '-':>14}{fmt.format(lo) if lo is not None else '-':>14}"
              f"{ratio:>11}")


if __name__ == "__main__":
    main()
