"""Every loss aggregation gives the same step on every layout and rank count, micro-batched or not.

The reference is the single-rank run that trains on the whole batch at once. Each other run cuts the
batch over ranks (DDP, FSDP2, tp, fsdp x tp) and each rank's part into micro-batches of
`algorithm.micro_batch_size` (sizes that do not divide a rank's rows, so micro-batches differ in size).
Since each micro-batch's loss is its share of the batch's loss, weighted by counts of the whole batch,
the reported losses and gradient norms agree to float32 summation order (LOSS_REL), and so do the
trained weights: AdamW's first steps move each weight by about lr = 1e-3 whatever the gradient's size,
so the weights agree to a small fraction of that (WEIGHT_ATOL; measured below 1e-5), while an
aggregation weighted by a rank's or a micro-batch's own counts changes the losses in the second digit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from graphrl.cli import main

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 2
LOSS_REL = 1e-5
WEIGHT_ATOL = 5e-5
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")

ONE_RANK = ("cluster=local-cpu-1",)
LAYOUTS: dict[str, tuple[str, ...]] = {
    "1 rank, micro-batches": ONE_RANK + ("algorithm.micro_batch_size=5",),
    "2 ranks ddp": ("cluster=local-cpu-2", "placement.strategy=colocated", "placement.roles.policy.dp=2",
                    "placement.roles.policy.fsdp=1", "placement.roles.policy.sharding=none",
                    "algorithm.micro_batch_size=5"),
    "2 ranks fsdp2": ("cluster=local-cpu-2", "placement.strategy=colocated", "placement.roles.policy.dp=1",
                      "placement.roles.policy.fsdp=2", "placement.roles.policy.sharding=fsdp",
                      "algorithm.micro_batch_size=7"),
    "2 ranks tp": ("cluster=local-cpu-2", "placement.strategy=colocated", "placement.roles.policy.tp=2",
                   "placement.roles.policy.dp=1", "placement.roles.policy.fsdp=1", "algorithm.micro_batch_size=7"),
    # packed sequences, micro-batches cut by a token budget (7 x 11 tokens)
    "2 ranks fsdp2, packed": ("cluster=local-cpu-2", "placement.strategy=colocated", "placement.roles.policy.dp=1",
                              "placement.roles.policy.fsdp=2", "placement.roles.policy.sharding=fsdp",
                              "algorithm.micro_batch_size=7", "algorithm.pack_sequences=true"),
}
FOUR_RANKS = ("cluster=local-cpu-4", "placement.strategy=colocated", "placement.roles.policy.tp=2",
              "placement.roles.policy.dp=1", "placement.roles.policy.fsdp=2", "placement.roles.policy.sharding=fsdp",
              "algorithm.micro_batch_size=3")


def run(example: str, out: Path, *sets: str) -> tuple[list[dict], dict]:
    args = ["run", str(EXAMPLES / example), "--steps", str(STEPS), "--out", str(out), "-q"]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, f"{' '.join(sets)}:\n{result.output}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, load_file(out / "checkpoints" / f"step_{STEPS - 1:06d}" / "policy.safetensors")


def assert_same_step(got: tuple[list[dict], dict], want: tuple[list[dict], dict], what: str) -> None:
    rows, weights = got
    want_rows, want_weights = want
    for key in ("loss", "grad_norm", "entropy"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in want_rows], rel=LOSS_REL, abs=1e-7), (what, key)
    # Rule rewards agree exactly; a reward model's (ppo_tiny) to float32 summation order.
    assert [r["reward_mean"] for r in rows] == pytest.approx([r["reward_mean"] for r in want_rows], rel=LOSS_REL), what
    worst = max(float((weights[name] - w).abs().max()) for name, w in want_weights.items())
    assert worst < WEIGHT_ATOL, (what, worst)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_every_aggregation_trains_alike_on_every_layout(agg: str, tmp_path: Path) -> None:
    common = (f"algorithm.loss_agg={agg}", "algorithm.entropy_coef=0.01")  # the entropy term keeps losses off 0
    whole = run("grpo_tiny.yaml", tmp_path / "whole", *ONE_RANK, *common)
    layouts = dict(LAYOUTS)
    if agg == "seq_mean_token_mean":
        layouts["4 ranks fsdp2 x tp"] = FOUR_RANKS
    for name, sets in layouts.items():
        assert_same_step(run("grpo_tiny.yaml", tmp_path / name.replace(" ", "_"), *sets, *common), whole, name)


def test_kl_reward_shaping_and_whitened_gae_train_alike_on_two_ranks(tmp_path: Path) -> None:
    """PPO with a critic, the KL (k1) in the reward and whitened GAE advantages: the batch statistics are
    summed over the ranks, so two micro-batched ranks train as one whole-batch rank does."""
    job = (EXAMPLES / "ppo_tiny.yaml").read_text()
    job = job.replace("  kl_estimator: k3\n", "  kl_estimator: k1\n  kl_in: reward\n  loss_agg: seq_mean_token_mean\n")
    job = job.replace("values: values.values}\n  update_policy:",
                      "values: values.values, ref_logprobs: ref_logprobs.logprobs}\n    normalize: batch\n"
                      "  update_policy:")
    job = job.replace("advantages: gae.advantages, ref_logprobs: ref_logprobs.logprobs}", "advantages: gae.advantages}")
    assert job.count("ref_logprobs: ref_logprobs.logprobs") == 1 and "normalize: batch" in job
    path = EXAMPLES / "ppo_kl_reward.yaml"
    path.write_text(job)
    try:
        whole = run(path.name, tmp_path / "whole", *ONE_RANK)
        two = run(path.name, tmp_path / "two", "cluster=local-cpu-2", "placement.strategy=colocated",
                  "placement.roles.policy.dp=2", "placement.roles.policy.sharding=none", "algorithm.micro_batch_size=5")
    finally:
        path.unlink()
    assert_same_step(two, whole, "ppo kl in reward, 2 ranks")
    # The KL the rewards were shaped with is reported (k1 on-policy: about 0 at step 0, the reference
    # being the policy's initial copy, then moving off it), the same on both layouts.
    kls = [r["kl"] for r in two[0]]
    assert abs(kls[0]) < 1e-6 and abs(kls[1]) > 1e-6
    assert kls == pytest.approx([r["kl"] for r in whole[0]], rel=LOSS_REL, abs=1e-9)


def test_packed_sequences_score_and_train_as_padded_ones_in_every_role(tmp_path: Path) -> None:
    """PPO packs the reference's log-probs (a frozen, unwrapped model), the critic's values and its
    training, the reward model's scores and the policy's training; with mini-batches (2 optimizer steps
    per pass, 2 passes) the steps are the same ones, packed or not."""
    sets = ("algorithm.micro_batch_size=5", "algorithm.mini_batch_size=32", "algorithm.updates_per_step=2")
    padded = run("ppo_tiny.yaml", tmp_path / "padded", *sets)
    assert_same_step(run("ppo_tiny.yaml", tmp_path / "packed", *sets, "algorithm.pack_sequences=true"), padded,
                     "ppo, packed")


@pytest.mark.parametrize("layout", ["1 rank, micro-batches", "2 ranks fsdp2", "2 ranks tp"])
def test_the_trainer_scores_responses_at_the_sampling_temperature(layout: str, tmp_path: Path) -> None:
    """At temperature 0.6 the first step is on-policy: the trainer's log-probs, through every wrapper,
    must equal the sampler's behaviour log-probs, so the ratio is 1 and the k3 estimate of
    KL(pi_old || pi) is 0. A trainer at temperature 1 against a sampler at 0.6 (measured on this model at
    initialisation) gives per-token log-ratios up to 0.67 and approx_kl 0.04."""
    rows, _ = run("grpo_tiny.yaml", tmp_path, *LAYOUTS[layout], "nodes.rollout.temperature=0.6")
    assert rows[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert abs(rows[0]["approx_kl"]) < 1e-7
