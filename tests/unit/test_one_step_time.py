"""A plan shows one predicted step time and one cost per weight sync, whichever command shows them.

One plan used to carry three step times (the analytical estimate, a 6-step simulation that became the
plan's estimate, and `graphrl simulate`'s 16-iteration window: 89.4 s against 90.8 s for the 70B example)
and two costs for one sync (the preview's operation timed from the layout, the programs from the planned
DDMA rounds). Now the estimate is the simulator's steady state of the plan's own programs over the one
window (`compiler.simulate.predicted_step`), and the preview's sync operation carries the planned sync's
cost, the one the programs are charged. These tests fail if any command computes its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main
from graphrl.plan_io import load_plan
from graphrl.schemas.program import CostKey

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("example, steps", [("grpo_tiny.yaml", 40), ("aipo_async_tiny.yaml", 40),
                                            ("ppo_tiny.yaml", 3), ("llama3_70b.yaml", 20)])
def test_compile_simulate_and_the_plan_file_show_one_step_time(example: str, steps: int, tmp_path: Path) -> None:
    runner = CliRunner()
    path = tmp_path / "plan.msgpack"
    assert runner.invoke(main, ["compile", str(EXAMPLES / example), "--steps", str(steps), "-o", str(path)]).exit_code == 0
    plan = load_plan(path)
    estimate = plan.chosen.estimate
    assert estimate.method == "simulated"
    assert sum(estimate.phases.values()) == pytest.approx(estimate.step_time_s, rel=1e-9)  # the preview's phases

    preview = json.loads(runner.invoke(main, ["compile", str(EXAMPLES / example), "--steps", str(steps),
                                              "--format", "json"]).output)
    from_file = json.loads(runner.invoke(main, ["simulate", str(path), "--format", "json"]).output)
    from_job = json.loads(runner.invoke(main, ["simulate", str(EXAMPLES / example), "--steps", str(steps),
                                               "--format", "json"]).output)
    assert preview["step_time_s"] == from_file["step_time_s"] == from_job["step_time_s"] == estimate.step_time_s
    if plan.baseline is not None:
        baseline = plan.baseline.estimate.step_time_s
        assert preview["baseline"]["step_time_s"] == from_file["baseline"]["step_time_s"] == baseline
        assert from_job["baseline"]["step_time_s"] == baseline


@pytest.mark.parametrize("example", ["aipo_async_tiny.yaml", "llama3_70b.yaml", "llama3_405b.yaml"])
def test_the_preview_shows_the_weight_sync_the_programs_are_charged(example: str) -> None:
    """The preview's sync operation was timed from the layout (`cost.weight_sync_time`), the
    programs' WeightSync from the planned DDMA rounds, and the two disagreed in one plan."""
    from graphrl.compiler.compile import compile_job
    from graphrl.loader import job_cluster, load_job

    job = load_job(EXAMPLES / example)
    plan = compile_job(job, job_cluster(job, None), steps=4)
    (op,) = [op for op in plan.chosen.operations if op.kind == "weight_sync"]
    assert plan.programs is not None
    (record,) = plan.programs.weight_syncs.items()
    transfer, sync = record
    assert op.time_s == plan.programs.durations[CostKey("WeightSync", transfer)]
    assert op.num_bytes == sync.summary.total_bytes


def test_the_measured_step_time_is_the_median_after_warm_up_in_run_and_report(tmp_path: Path) -> None:
    """`graphrl run` said the median and `graphrl report` the mean: one slow step (a checkpoint) moved the
    report's figure alone. Both take the median after the warm-up step now, from one function."""
    from graphrl.report import median_step_time

    rows = [{"step": s, "reward_mean": 0.1, "loss": 1.0, "kl": 0.0, "step_time_s": t, "tokens_per_s": 1.0,
             "weight_version": s} for s, t in enumerate([5.0, 1.0, 1.0, 10.0])]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = json.loads(CliRunner().invoke(main, ["report", str(tmp_path), "--format", "json"]).output)
    assert report["summary"]["measured_step_time_s"] == 1.0 == median_step_time(rows, 1)[0]
    assert report["summary"]["steady_steps"] == 3
