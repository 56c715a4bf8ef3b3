"""`graphrl run` says what a step should cost before it starts and what it cost at the end, so every run
checks the preview's prediction on the machine it ran on."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main
from graphrl.plan_io import load_plan
from graphrl.report import error_pct

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_run_prints_the_predicted_and_the_measured_step_time(tmp_path):
    out = CliRunner().invoke(main, ["run", str(EXAMPLES / "grpo_tiny.yaml"), "--set", "schedule.steps=3",
                                    "--out", str(tmp_path), "-q"])
    assert out.exit_code == 0, out.output
    plan = load_plan(tmp_path / "plan.msgpack")
    predicted = plan.chosen.estimate.step_time_s
    assert (f"predicted {predicted:.3g} s/step (simulated steady state, hardware {plan.hardware.name})"
            in out.stderr.splitlines())
    # the tests run uncalibrated (conftest): the run says its figure is the preset's, and what fixes that
    assert "note: this machine is not calibrated" in out.stderr and "`graphrl calibrate " in out.stderr

    # Steps 1 and 2: step 0, which also builds the models and warms up, is left out.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    measured = statistics.median(r["step_time_s"] for r in rows[1:])
    lines = [line for line in out.stdout.splitlines() if line.startswith("measured ")]
    assert lines == [f"measured {measured:.3g} s/step over steps 1-2 "
                     f"(prediction {error_pct(predicted, measured):+.0f}%)"], out.stdout
    assert re.fullmatch(r"measured [\d.e-]+ s/step over steps 1-2 \(prediction [+-]\d+%\)", lines[0])
