"""The Qwen families run every way a Llama runs (`graphrl run`, gloo ranks on CPU): a Qwen3 trained by
FSDP2 x tp=2 beside a tp=2 generator (DDMA into its shards, per-head q/k norms on each rank's heads)
trains exactly as on one rank, and a Qwen2 (q/k/v biases) generates in fp8 on tp=2 shards. Resuming a
Qwen3 run is test_resume's case `qwen3_fsdp2_x_tp2`; the model against `transformers`, test_families.

Equal losses: as in test_every_layout_runs, a layout changes only the order of float32 sums.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml"
STEPS = 3
LOSS_REL = 1e-5


def run(out: Path, *sets: str) -> tuple[str, list[dict]]:
    args = ["run", str(EXAMPLE), "--steps", str(STEPS), "--out", str(out), "-q"]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result.output.splitlines()[0], [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_qwen3_on_fsdp2_x_tp2_with_a_tp2_generator_trains_as_on_one_rank(tmp_path: Path) -> None:
    qwen3 = "models.policy.preset=tiny-digits-qwen3"
    _, single = run(tmp_path / "single", qwen3, "cluster=local-cpu-1")
    label, sharded = run(tmp_path / "sharded", qwen3, "cluster=local-cpu-4", "placement.strategy=colocated",
                         "placement.roles.policy.tp=2", "placement.roles.policy.fsdp=2",
                         "placement.roles.policy.sharding=fsdp", "placement.roles.policy/generate.tp=2")
    assert "fsdp2xtp2" in label and "gen[tp2x" in label, label
    assert [r["reward_mean"] for r in sharded] == [r["reward_mean"] for r in single]
    assert [r["loss"] for r in sharded] == pytest.approx([r["loss"] for r in single], rel=LOSS_REL, abs=0)


def test_qwen2_generates_in_fp8_on_tp2_shards(tmp_path: Path) -> None:
    label, rows = run(tmp_path / "fp8", "models.policy.preset=tiny-digits-qwen2",
                      "placement.roles.policy/generate.precision=fp8", "placement.roles.policy/generate.tp=2")
    assert "tp2x dp1 fp8]" in label, label
    assert len(rows) == STEPS and all(math.isfinite(r["loss"]) and 0 <= r["reward_mean"] <= 1 for r in rows)
