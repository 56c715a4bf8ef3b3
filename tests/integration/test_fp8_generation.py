"""Runs with an fp8 generator (`placement.roles.policy/generate.precision=fp8`) on CPU ranks, one per way
the generator gets its weights: the colocated copy (tp 1, quantized from the trainer's module), the
colocated in-place reshard into tensor-parallel shards, DDMA into one generator (aipo_async_tiny) and
DDMA into a tensor-parallel generator. Each writes a ledger that counts the generator at fp8, and the
tiny examples still learn with fp8 rollouts (the thresholds of test_learning.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FP8 = "placement.roles.policy/generate.precision=fp8"


def run(out: Path, example: str, *args: str) -> tuple[str, list[dict], list[dict]]:
    """(the run's output, its metrics rows, its ledger rows) of `graphrl run example --set fp8 args`."""
    result = CliRunner().invoke(main, ["run", str(EXAMPLES / example), "--set", FP8, *args, "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ledger = [json.loads(p.read_text()) for p in sorted((out / "ledger").glob("rank*.json"))]
    return result.output, rows, ledger


@pytest.mark.parametrize("example", ["grpo_tiny.yaml", "aipo_async_tiny.yaml"])
def test_tiny_example_learns_with_an_fp8_generator(tmp_path, example):
    from test_learning import LEARNED_BY  # as many steps as the float runs learn in

    output, rows, ledger = run(tmp_path, example, "--steps", str(LEARNED_BY))
    assert "fp8]" in output  # the chosen plan's generator label, e.g. gen[tp1x dp2 fp8]
    rewards = [r["reward_mean"] for r in rows]
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert first <= 0.3, first
    # measured: 0.980 (grpo_tiny) and 0.946 (aipo_async_tiny) over steps 180-199; 0.85 leaves fp8 noise room
    assert last >= 0.85, last
    assert any(r["fp8_state_bytes"] > 0 for r in ledger)


@pytest.mark.parametrize("args, label, generator_ranks", [
    # one rank: the trainer is not wrapped; bf16 generation would share its module, fp8 holds its own copy
    (("--cluster", "local-cpu-1"), "tp1x dp1 fp8]", 1),
    # colocated: in-place reshard into fp8 tp shards
    (("--set", "placement.roles.policy/generate.tp=2"), "tp2x dp1 fp8]", 2),
    # tp 4 over 2 KV heads: each head replicated on 2 ranks, completed over the group in the staging
    (("--cluster", "local-cpu-4", "--set", "placement.roles.policy/generate.tp=4"), "tp4x dp1 fp8]", 4),
    # disaggregated: DDMA into fp8 tp shards
    (("--cluster", "local-cpu-4", "--strategy", "disaggregated", "--set", "placement.roles.policy/generate.tp=2"),
     "tp2x dp1 fp8]", 2),
], ids=["colocated-single-rank", "colocated-tp2", "colocated-tp4-replicated-kv", "disaggregated-tp2"])
def test_fp8_generator_runs_on_fresh_weights(tmp_path, args, label, generator_ranks):
    """Behaviour log-probs come from the fp8 generator, old log-probs from the float32 trainer on the
    same synced version: their KL stays at quantization size (measured below 1e-4). With a learning rate
    that moves the policy fast, a generator whose reshard did nothing drifts to a KL of 0.1-1 within
    three steps; unwritten (NaN) shards fail the comparison outright."""
    output, rows, ledger = run(tmp_path, "grpo_tiny.yaml", "--steps", "6", "--set", "algorithm.lr=0.03", *args)
    assert label in output
    assert [r["weight_version"] for r in rows] == list(range(6))
    assert all(0 <= r["approx_kl"] < 1e-3 for r in rows), [r["approx_kl"] for r in rows]
    generators = [r for r in ledger if "policy/generate" in r["roles"]]
    assert len(generators) == generator_ranks and all(r["fp8_state_bytes"] > 0 for r in generators)
    disaggregated = [r for r in generators if r["roles"] == ["policy/generate"]]
    for r in disaggregated:  # a generator-only rank: its bytes are the fp8 placement's (norms replicated over tp)
        assert r["measured_state_bytes"] == pytest.approx(r["planned_state_bytes"], rel=0.05)
    if generator_ranks == 1:  # trainer and fp8 generator on one rank, each as charged
        assert ledger[0]["ratio"] == pytest.approx(1.0, rel=0.01)
