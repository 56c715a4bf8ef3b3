"""The Qwen families run every way a Llama runs (`graphrl run`, gloo ranks on CPU): a Qwen3 trained by
FSDP2 x tp=2 beside a tp=2 generator (DDMA into its shards, per-head q/k norms on each rank's heads)
trains exactly as on one rank, and a Qwen2 (q/k/v biases) generates in fp8 on tp=2 shards (a resume reads
and writes the model's parameters by name whatever its family: test_resume's cases); the model against
`transformers`, test_families.

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


def run(out: Path, *sets: str, example: Path = EXAMPLE) -> tuple[str, list[dict]]:
    args = ["run", str(example), "--steps", str(STEPS), "--out", str(out), "-q"]
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


# -- mixture of experts --------------------------------------------------------------------------------

MOE = Path(__file__).resolve().parents[2] / "examples" / "grpo_moe_tiny.yaml"


def run_moe(out: Path, *sets: str) -> tuple[str, list[dict]]:
    return run(out, *sets, example=MOE)


def test_moe_example_shares_experts_over_two_ranks_and_reports_its_routing(tmp_path: Path) -> None:
    """The example as shipped (bf16, experts shared by the generator's two ranks, R3): every step reports
    the load-balancing loss (about top-k = 2 when balanced) and the router mismatch (a share)."""
    label, rows = run_moe(tmp_path / "moe")
    assert "gen[tp2x" in label and "fsdp2" in label, label
    assert all(1.0 <= r["router_aux_loss"] <= 4.0 and 0.0 <= r["router_mismatch"] <= 1.0 for r in rows)


def test_replayed_routes_cross_ranks_and_train_as_on_one_rank(tmp_path: Path) -> None:
    """R3 with the generator on ranks 0-1 (experts shared out) and the trainer on ranks 2-3: the routes
    travel with the rollouts, and in float32 the run trains as the single-rank run does (without the
    load-balancing loss, which each data-parallel rank takes over its own tokens)."""
    fp32 = "models.policy.dtype=float32", "algorithm.router_aux_loss_coef=0"
    _, single = run_moe(tmp_path / "single", *fp32, "cluster=local-cpu-1", "placement.roles.policy/generate.tp=1",
                        "placement.roles.policy.sharding=none")
    label, split = run_moe(tmp_path / "split", *fp32, "cluster=local-cpu-4", "placement.strategy=disaggregated",
                           "placement.roles.policy/generate.devices=0-1", "placement.roles.policy.devices=2-3")
    assert "disaggregated" in label, label
    assert [r["reward_mean"] for r in split] == [r["reward_mean"] for r in single]
    assert [r["loss"] for r in split] == pytest.approx([r["loss"] for r in single], rel=LOSS_REL, abs=0)
    assert all(r["router_mismatch"] == 0.0 for r in split)  # float32 both sides: the same routes


def test_r2_replays_the_first_pass_routes_in_later_passes(tmp_path: Path) -> None:
    _, rows = run_moe(tmp_path / "r2", "algorithm.router_replay=R2", "algorithm.updates_per_step=2",
                      "cluster=local-cpu-1", "placement.roles.policy/generate.tp=1", "placement.roles.policy.sharding=none")
    assert len(rows) == STEPS and all(math.isfinite(r["loss"]) and "router_aux_loss" in r for r in rows)


def test_routing_replay_on_a_dense_model_is_refused_by_validate(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["validate", str(EXAMPLE), "--set", "algorithm.router_replay=R3"])
    assert result.exit_code == 2
    assert "algorithm.router_replay" in result.stderr and "dense model" in result.stderr


def test_vllm_for_a_mixture_of_experts_is_refused_by_name() -> None:
    result = CliRunner().invoke(main, ["validate", str(MOE), "--set", "placement.roles.policy/generate.engine=vllm"])
    assert result.exit_code == 2
    assert "placement.roles.policy/generate.engine" in result.stderr and "engine: native" in result.stderr
