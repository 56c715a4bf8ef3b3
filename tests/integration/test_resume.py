"""`--resume` from a checkpoint that an interrupted run left behind gives the uninterrupted run's metrics,
for an asynchronous schedule and for the trainer wrappings that keep sharded or replicated state (fsdp x
tp: 2-D DTensors; DDP over 3 ranks with a critic; a single rank in the async cases; FSDP2 on 2 ranks
is resumed in test_run.py).

The interrupted run is the uninterrupted one's folder cut back to its first checkpoint: that checkpoint
and the metrics written before it, which is exactly what a run killed after writing it leaves (the
killed-rank test in test_run.py checks that such a checkpoint is intact).

A run can also resume on another layout (more ranks, another tp or fsdp size): DCP reshards the
trained state, and every rank reads all ranks' in-flight rollouts, since the ranks that consume them
changed. Those cases compare with the layout-equivalence tolerance (test_every_layout_runs.py):
after the resume only the order of float32 sums differs.

Exact equality holds where nothing is summed in a different order after a resume. One case cannot
promise that: DDP over 3 ranks rebuilds its gradient buckets after the first backward of a process,
and gloo's ring all-reduce adds an element's three partial sums in an order that depends on where the
element sits in its bucket; the resumed process builds them one step later, so its gradients can
differ in the last float32 bit (losses by ~1e-7 relative, measured). It is compared with rel=1e-6.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS, EVERY = 4, 2  # checkpoints after steps 1 and 3; the run is resumed from the first

CASES = {
    # async AIPO, one step off-policy: the checkpoint holds the rollouts generated ahead
    "async": ("aipo_async_tiny.yaml", [], 0.0),
    "async_staleness_2": ("aipo_async_tiny.yaml", ["schedule.max_staleness=2"], 0.0),
    "fsdp2_x_tp2": ("grpo_tiny.yaml", ["cluster=local-cpu-4", "placement.strategy=colocated",
                                       "placement.roles.policy.tp=2", "placement.roles.policy.fsdp=2",
                                       "placement.roles.policy.sharding=fsdp"], 0.0),
    # ZeRO-1: each rank saves and reloads only its share of the optimizer state
    "zero1": ("grpo_tiny.yaml", ["placement.strategy=colocated", "placement.roles.policy.sharding=zero1"], 0.0),
    # critic and policy trained by DDP over ranks 1-3, reference and reward model frozen
    "ppo_ddp3": ("ppo_tiny.yaml", ["cluster=local-cpu-4", "placement.strategy=disaggregated"], 1e-6),
}
FSDP4 = ["cluster=local-cpu-4", "placement.strategy=colocated", "placement.roles.policy.fsdp=4",
         "placement.roles.policy.sharding=fsdp"]
# (example, layout written from, layout resumed on, relative tolerance)
RELAYOUT = {
    "fsdp4_to_fsdp2_x_tp2": ("grpo_tiny.yaml", FSDP4, FSDP4[:2] + ["placement.roles.policy.fsdp=2",
                                                                   "placement.roles.policy.tp=2",
                                                                   "placement.roles.policy.sharding=fsdp"], 1e-5),
    # ZeRO-1 on 2 ranks resumed on 4: the optimizer state's shares are split again by the new owners
    "zero1_2_to_4_ranks": ("grpo_tiny.yaml", ["placement.strategy=colocated", "placement.roles.policy.sharding=zero1"],
                           ["cluster=local-cpu-4", "placement.strategy=colocated", "placement.roles.policy.tp=1",
                            "placement.roles.policy.sharding=zero1"], 1e-5),
    # async: the trainer rank's rollouts generated ahead go to a 2-rank trainer beside a tp=2 generator
    "async_2_to_4_ranks": ("aipo_async_tiny.yaml", [], ["cluster=local-cpu-4", "placement.roles.policy.devices=2-3",
                                                        "placement.roles.policy/generate.devices=0-1"], 1e-5),
}


def run(example: str, out: Path, sets: list[str], *extra: str) -> str:
    args = ["run", str(EXAMPLES / example), "--steps", str(STEPS), "--out", str(out), "-q",
            "--set", f"schedule.checkpoint_every={EVERY}", *extra]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result.output


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def interrupted(full: Path, part: Path) -> dict:
    """`part` as a run killed after its first checkpoint leaves it; the checkpoint's metadata."""
    first = full / "checkpoints" / f"step_{EVERY - 1:06d}"
    (part / "checkpoints").mkdir(parents=True)
    shutil.copytree(first, part / "checkpoints" / first.name)
    (part / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(full)[:EVERY]))
    return json.loads((first / "meta.json").read_text())


@pytest.mark.parametrize("case", list(CASES) + [f"relayout_{k}" for k in RELAYOUT])
def test_resumed_run_gives_the_uninterrupted_metrics(case: str, tmp_path: Path) -> None:
    if case.startswith("relayout_"):
        example, sets, resume_sets, rel = RELAYOUT[case.removeprefix("relayout_")]
    else:
        example, sets, rel = CASES[case]
        resume_sets = sets
    full, part = tmp_path / "full", tmp_path / "part"
    run(example, full, sets)
    meta = interrupted(full, part)
    if "async" in case:
        assert meta["inflight_steps"], "an async checkpoint holds rollouts generated ahead"

    output = run(example, part, resume_sets, "--resume")
    assert f"at step {EVERY}" in output
    if resume_sets != sets:
        assert f"on another layout: {meta['layout']['label']}" in output
    want, got = rows(full), rows(part)
    assert [r["step"] for r in got] == list(range(STEPS))
    assert [r["weight_version"] for r in got] == [r["weight_version"] for r in want]
    assert [r["reward_mean"] for r in got] == pytest.approx([r["reward_mean"] for r in want], rel=rel, abs=0)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=rel, abs=0)
