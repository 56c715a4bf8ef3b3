"""The tiny example learns: pure RL from random initialisation, on CPU ranks (its wall time against the
120 s budget is measured by benchmarks/bench_failure.py).

A random policy scores ~0.06 on digit copy (1/16 per position); the job must reach a mean reward of
at least 0.9 over its last 20 steps while its first 20 steps average at most 0.3, for two seeds, and
with both the colocated-synchronous and the disaggregated-asynchronous (AIPO) plan.

The runs stop at LEARNED_BY of the example's 400 steps: every case's 20-step mean first reaches 0.9 by
step 160-190 and stands at 0.946-0.984 at step 200 (seeds 0 and 1, both plans, with and without an fp8
generator; measured), so 200 steps prove what 400 do, in half the time. The runs are deterministic for
a seed, so a case passes or fails alike every time; a change to the learning code that slows learning
shows here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LEARNED_BY = 200


@pytest.mark.parametrize("example, seed", [("grpo_tiny.yaml", 0), ("grpo_tiny.yaml", 1), ("aipo_async_tiny.yaml", 0)])
def test_tiny_example_learns(tmp_path, example, seed):
    out = CliRunner().invoke(main, ["run", str(EXAMPLES / example), "--seed", str(seed), "--steps", str(LEARNED_BY),
                                    "--out", str(tmp_path), "-q"])
    assert out.exit_code == 0, out.output
    rewards = [json.loads(line)["reward_mean"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert first <= 0.3, first
    assert last >= 0.9, last
