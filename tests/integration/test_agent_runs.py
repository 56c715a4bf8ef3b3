"""Agent loops run every way a single-turn job runs (`graphrl run`, gloo ranks on CPU): episodes sampled on one
rank and trained on another (the loss mask and the episodes' record travel with the rollouts), on a tp=2
generator replica (its first rank runs the environments and sends each turn to the other), under an
asynchronous schedule with AIPO, with a critic (GAE over the model's tokens), and with a user's environment
class from a module beside the job that fails in some episodes without ending the run.

Equal losses: as in test_every_layout_runs, a layout changes only the order of float32 sums.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from click.testing import CliRunner

from graphrl.cli import main
from run_processes import cli_run

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_echo_tiny.yaml"
STEPS = 3
LOSS_REL = 1e-5
SMALL = ("nodes.prompts.batch_size=4", "nodes.rollout.samples_per_prompt=4")


def run(out: Path, *sets: str, example: Path = EXAMPLE, steps: int = STEPS) -> tuple[str, list[dict]]:
    return cli_run(example, out, (*SMALL, *sets), steps=steps)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The example's episodes sampled and trained on one rank: what every other layout must give."""
    return run(tmp_path_factory.mktemp("single"))[1]


def test_episodes_sampled_on_one_rank_train_on_another_as_on_one_rank(tmp_path: Path, single: list[dict]) -> None:
    label, split = run(tmp_path / "split", "cluster=local-cpu-2", "placement.strategy=disaggregated",
                       "placement.roles.policy/generate.devices=0-0", "placement.roles.policy.devices=1-1")
    assert "disaggregated" in label or "gen[" in label, label
    assert [r["reward_mean"] for r in split] == [r["reward_mean"] for r in single]
    assert [r["env_tokens_mean"] for r in split] == [r["env_tokens_mean"] for r in single]
    assert [r["loss"] for r in split] == pytest.approx([r["loss"] for r in single], rel=LOSS_REL, abs=0)
    assert all(r["turns_mean"] == 2.0 and r["episodes_done"] == 16 for r in split)
    sample = json.loads((tmp_path / "split" / "samples.jsonl").read_text().splitlines()[0])
    assert [t["role"] for t in sample["turns"]] == ["assistant", "environment", "assistant"]

    from graphrl.report import build_report

    report = build_report(tmp_path / "split")
    episodes = report.data["episodes"]
    assert episodes["ends"] == {"done": 16 * (STEPS - 1)} and episodes["predicted_env_s"] > 0
    figures = {f["name"]: f["value"] for f in episodes["figures"]}
    assert figures["turns_mean"] == 2 and figures["env_tokens_mean"] == 6
    phases = [row["phase"] for row in report.data["phases"]["rows"]]
    assert phases[phases.index("generate") + 1] == "  of which the environment"
    assert "episodes by how they ended" in report.render_text() and "<h2>Episodes" in report.render_html()


def test_a_tp2_generator_replica_runs_the_episodes_on_its_first_rank(tmp_path: Path, single: list[dict]) -> None:
    label, tp = run(tmp_path / "tp", "cluster=local-cpu-2", "placement.strategy=colocated",
                    "placement.roles.policy/generate.tp=2")
    assert "gen[tp2x" in label, label
    assert [r["reward_mean"] for r in tp] == [r["reward_mean"] for r in single]
    assert [r["loss"] for r in tp] == pytest.approx([r["loss"] for r in single], rel=LOSS_REL, abs=0)


def test_episodes_under_an_asynchronous_schedule_with_aipo(tmp_path: Path) -> None:
    label, rows = run(tmp_path / "aipo", "schedule.mode=async", "schedule.max_staleness=1", "nodes.update.loss=aipo",
                      "cluster=local-cpu-2", steps=4)
    assert "[async]" in label, label
    assert len(rows) == 4 and all(math.isfinite(r["loss"]) and math.isfinite(r["weight_mean"]) for r in rows)
    assert all(0.0 <= r["clipped_frac"] <= 1.0 and r["episodes_done"] == 16 for r in rows)
    assert any(r["weight_version"] < r["step"] for r in rows)  # episodes sampled by an older policy


PPO = """
name: agent_ppo
cluster: local-cpu-1
models:
  policy: {preset: tiny-digits-tied, dtype: float32}
  critic: {preset: tiny-digits-tied, dtype: float32, init_from: policy}
nodes:
  prompts: {op: dataset, task: digits-copy, batch_size: 4, prompt_len: 6, options: {num_digits: 4}}
  rollout:
    op: generate
    model: policy
    samples_per_prompt: 2
    max_new_tokens: 5
    env: {class: ENV, max_turns: 2, max_total_tokens: 24, timeout_s: 0.5}
    inputs: {prompts: prompts.prompts}
  values: {op: value, model: critic, inputs: {rollouts: rollout.rollouts}}
  score: {op: reward, fn: digits_copy, inputs: {rollouts: rollout.rollouts, env_rewards: rollout.env_rewards}}
  adv:
    op: advantage
    estimator: gae
    inputs: {rewards: score.rewards, rollouts: rollout.rollouts, values: values.values}
  update: {op: train, model: policy, loss: ppo, inputs: {rollouts: rollout.rollouts, advantages: adv.advantages}}
  update_critic:
    op: train
    model: critic
    loss: critic
    inputs: {rollouts: rollout.rollouts, advantages: adv.advantages, values: values.values}
algorithm: {lr: 1.0e-3}
schedule: {mode: sync, steps: 3}
run: {seed: 0}
"""

FLAKY = '''
import time


class Flaky:
    """Every fourth episode's step raises, every fourth after it hangs; the others echo for two turns."""

    seconds_per_call = 0.001

    def __init__(self, **options):
        self.turn = 0

    def reset(self, row):
        self.index = row["index"]
        return None

    def step(self, text):
        self.turn += 1
        if self.index % 4 == 1:
            raise RuntimeError("the tool crashed")
        if self.index % 4 == 2:
            time.sleep(30)
        return ("<bos> 1 2 <sep>", 0.5, False) if self.turn == 1 else (None, 0.5, True)
'''


def test_a_users_flaky_environment_beside_the_job_costs_only_its_episodes_under_ppo(tmp_path: Path) -> None:
    """A class in a module beside the job file (no PYTHONPATH), a critic and a reward node that adds the
    environment's rewards to a rule's: the failing episodes are counted, the run goes on."""
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "flaky_envs.py").write_text(FLAKY)
    (folder / "job.yaml").write_text(PPO.replace("ENV", "flaky_envs:Flaky"))
    result = CliRunner().invoke(main, ["run", str(folder / "job.yaml"), "--out", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)
    for r in rows:  # 8 episodes a step: indices 1 and 5 raise, 2 and 6 time out
        assert (r["episodes_error"], r["episodes_timeout"], r["episodes_done"]) == (2, 2, 4)
        assert r["env_reward_mean"] == pytest.approx(4 * 1.0 / 8)
    shutil.rmtree(tmp_path / "out")
