"""`graphrl run` end to end: real rank processes on CPU with gloo."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main

from run_processes import no_rank_processes_left

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
HERE = Path(__file__).resolve().parent
REQUIRED = {"step", "reward_mean", "loss", "kl", "step_time_s", "tokens_per_s", "weight_version"}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def job_file(tmp_path: Path, name: str, **replace: str) -> Path:
    text = (EXAMPLES / name).read_text()
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return path


def test_sync_colocated_run_writes_metrics_and_checkpoint(tmp_path):
    out = CliRunner().invoke(main, ["run", str(EXAMPLES / "grpo_tiny.yaml"), "--steps", "4", "--out", str(tmp_path), "-q"])
    assert out.exit_code == 0, out.output
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(REQUIRED <= set(r) for r in rows)
    assert [r["weight_version"] for r in rows] == [0, 1, 2, 3]
    assert (tmp_path / "checkpoints" / "step_000003" / "meta.json").exists()
    assert list((tmp_path / "tensorboard").iterdir())
    assert not multiprocessing.active_children()
    # Response lengths, for a later job's `response_tokens: {from: RUN_DIR}`: each sample's, and the
    # step's mean and longest over the whole batch (max_new_tokens 5).
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 4 and all(1 <= s["response_tokens"] <= 5 for s in samples)
    assert all(len(s["response"].split()) == s["response_tokens"] for s in samples)  # one digit per token
    assert all(0 < r["response_tokens_mean"] <= r["response_tokens_max"] <= 5 for r in rows)


def test_async_disaggregated_run_uses_the_planned_stale_versions(tmp_path):
    out = CliRunner().invoke(main, ["run", str(EXAMPLES / "aipo_async_tiny.yaml"), "--steps", "5", "--out", str(tmp_path), "-q"])
    assert out.exit_code == 0, out.output
    rows = metrics(tmp_path)
    assert [r["weight_version"] for r in rows] == [0, 0, 1, 2, 3]  # max(0, step - 1)
    assert all("clipped_frac" in r for r in rows)  # the AIPO loss ran


def test_no_rank_replans_a_colocated_tensor_parallel_generators_sync(tmp_path):
    """A colocated tp-2 generator beside an fsdp trainer is filled by a DDMA plan. Ranks once planned it
    themselves when the run started (and every sync of more buckets than a plan then stored); the plan now
    stores it, and the ranks run it as stored: the run completes and the generator samples each new version."""
    from graphrl.plan_io import load_plan

    sets = ["cluster=local-cpu-2", "placement.strategy=colocated", "placement.roles.policy.tp=1",
            "placement.roles.policy.sharding=fsdp", "placement.roles.policy/generate.tp=2"]
    args = ["run", str(EXAMPLES / "grpo_tiny.yaml"), "--steps", "3", "--out", str(tmp_path), "-q"]
    out = CliRunner().invoke(main, [*args, *(x for s in sets for x in ("--set", s))])
    assert out.exit_code == 0, out.output
    plan = load_plan(tmp_path / "plan.msgpack")
    (record,) = plan.programs.weight_syncs.values()
    assert plan.chosen.strategy == "colocated" and record.src.devices == record.dst.devices == (0, 1)
    assert record.summary.num_buckets > 0 and record.local
    assert [r["weight_version"] for r in metrics(tmp_path)] == [0, 1, 2]


def test_same_job_runs_sync_when_overridden(tmp_path):
    out = CliRunner().invoke(main, ["run", str(EXAMPLES / "aipo_async_tiny.yaml"), "--steps", "3", "--schedule", "sync",
                                    "--out", str(tmp_path), "-q"])
    assert out.exit_code == 0, out.output
    assert [r["weight_version"] for r in metrics(tmp_path)] == [0, 1, 2]


def test_ppo_with_critic_reference_and_reward_model(tmp_path):
    out = CliRunner().invoke(main, ["run", str(EXAMPLES / "ppo_tiny.yaml"), "--steps", "3", "--out", str(tmp_path), "-q"])
    assert out.exit_code == 0, out.output
    rows = metrics(tmp_path)
    assert len(rows) == 3 and all(r["kl"] != 0.0 for r in rows[1:])


def test_interrupted_and_resumed_run_matches_uninterrupted(tmp_path):
    """A run stopped after step 2 and resumed from its checkpoint must produce exactly the metrics of an
    uninterrupted run: prompts and samples are seeded per step, and the checkpoint holds the weights
    and the optimizer state (here of an FSDP2 trainer: each rank's shards, through DCP)."""
    job = job_file(tmp_path, "grpo_tiny.yaml", **{"  steps: 400": "  steps: 6\n  checkpoint_every: 3",
                                                  "run:\n": "placement:\n  strategy: colocated\n  roles:\n"
                                                             "    policy: {sharding: fsdp}\n\nrun:\n"})
    runner = CliRunner()
    full, part = tmp_path / "full", tmp_path / "part"
    assert runner.invoke(main, ["run", str(job), "--out", str(full), "-q"]).exit_code == 0
    assert runner.invoke(main, ["run", str(job), "--steps", "3", "--out", str(part), "-q"]).exit_code == 0
    out = runner.invoke(main, ["run", str(job), "--out", str(part), "--resume", "-q"])
    assert out.exit_code == 0, out.output
    keys = ("step", "reward_mean", "loss", "weight_version")
    assert [[r[k] for k in keys] for r in metrics(part)] == [[r[k] for k in keys] for r in metrics(full)]


def _faulty_job(tmp_path: Path, fn: str) -> Path:
    return job_file(tmp_path, "grpo_tiny.yaml", **{"fn: digits_copy": f"fn: faulty_rewards:{fn}",
                                                   "  steps: 400": "  steps: 8\n  checkpoint_every: 1"})


def _run_subprocess(job: Path, out_dir: Path) -> tuple[int, str]:
    """The run as a user starts it; the timeout only keeps a hang from stalling the suite (how fast a
    failure ends the run is measured in benchmarks/bench_failure.py)."""
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "graphrl.cli", "run", str(job), "--out", str(out_dir), "-q"],
                          capture_output=True, text=True, env=env, timeout=300)
    return proc.returncode, proc.stderr + proc.stdout


def _run_in_process(job: Path, out_dir: Path) -> tuple[int, str]:
    """The same run from this process (its ranks are still processes): what the CLI says and its exit code.
    Only what a rank might print itself is not seen here; the subprocess test above checks that."""
    result = CliRunner().invoke(main, ["run", str(job), "--out", str(out_dir), "-q"])
    return result.exit_code, result.output


def test_exception_in_a_rank_ends_the_run_naming_it(tmp_path):
    code, output = _run_subprocess(_faulty_job(tmp_path, "raise_on_rank1"), tmp_path / "run")
    assert code != 0
    assert "rank 1 failed" in output and "reward server unreachable" in output
    assert "Traceback" not in output
    assert no_rank_processes_left(tmp_path / "run")


def test_killed_rank_ends_the_run_and_keeps_the_last_checkpoint(tmp_path):
    code, output = _run_in_process(_faulty_job(tmp_path, "kill_rank1"), tmp_path / "run")
    assert code != 0
    assert "rank 1" in output and "SIGKILL" in output
    assert no_rank_processes_left(tmp_path / "run")
    from graphrl.executors.outputs import latest_checkpoint, load_checkpoint

    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt is not None
    state = load_checkpoint(ckpt)  # intact: loads, and has the policy's weights
    assert "policy" in state["roles"] and state["roles"]["policy"]["weights"]


def test_slurm_script_is_written(tmp_path):
    out = CliRunner().invoke(main, ["launch", str(EXAMPLES / "llama3_8b.yaml"), "--emit", "slurm", "--steps", "2",
                                    "-o", str(tmp_path)])
    assert out.exit_code == 0, out.output
    text = (tmp_path / "launch.sbatch").read_text()
    assert "#SBATCH --nodes=8" in text and "-m graphrl.executors" in text and "--nproc-per-node 8" in text
    # SIGTERM before the time limit, and torchrun's wait for the ranks' checkpoint, both the grace period
    assert "#SBATCH --signal=TERM@120" in text and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120" in text


def test_fsdp2_and_ddp_trainers_compute_the_same_updates(tmp_path):
    """`sharding: fsdp` trains through torch's fully_shard, `none` through DDP: the same job must give the
    same losses step by step (the sharding changes where state lives, not the math)."""
    fsdp_job = job_file(tmp_path, "grpo_tiny.yaml", **{"run:\n": "placement:\n  strategy: colocated\n  roles:\n"
                                                                  "    policy: {sharding: fsdp}\n\nrun:\n"})
    runner = CliRunner()
    out = runner.invoke(main, ["run", str(fsdp_job), "--steps", "3", "--out", str(tmp_path / "fsdp"), "-q"])
    assert out.exit_code == 0, out.output
    out = runner.invoke(main, ["run", str(EXAMPLES / "grpo_tiny.yaml"), "--steps", "3", "--out", str(tmp_path / "ddp"), "-q"])
    assert out.exit_code == 0, out.output
    fsdp, ddp = metrics(tmp_path / "fsdp"), metrics(tmp_path / "ddp")
    assert [r["loss"] for r in fsdp] == pytest.approx([r["loss"] for r in ddp], rel=1e-5, abs=1e-7)
    ledger = json.loads((tmp_path / "fsdp" / "ledger" / "rank0.json").read_text())
    assert ledger["measured_state_bytes"] < json.loads((tmp_path / "ddp" / "ledger" / "rank0.json").read_text())["measured_state_bytes"]


def test_memory_ledger_matches_the_plans_accounting(tmp_path):
    """Each rank writes the bytes of weights, gradients and optimizer state it really holds beside the
    plan's figure; the float32 tiny model with AdamW holds 4+4+8 bytes per parameter, as the plan charges
    a float32 model."""
    out = CliRunner().invoke(main, ["run", str(EXAMPLES / "aipo_async_tiny.yaml"), "--steps", "2", "--out", str(tmp_path), "-q"])
    assert out.exit_code == 0, out.output
    trainer = json.loads((tmp_path / "ledger" / "rank1.json").read_text())
    generator = json.loads((tmp_path / "ledger" / "rank0.json").read_text())
    assert trainer["ratio"] == pytest.approx(1.0, rel=0.01)
    assert generator["ratio"] == pytest.approx(1.0, rel=0.01)


def test_ranks_that_do_not_train_keep_only_the_rollouts_still_to_be_read(tmp_path):
    """A generator rank sends its rollouts and never trains: it drops a step's once no later instruction
    of its stream can read them, where it used to keep every step's for the whole run. Two steps
    off-policy, the trainer rank reads a step's rollouts one step late; the metrics are unchanged."""
    out = CliRunner().invoke(main, ["run", str(EXAMPLES / "aipo_async_tiny.yaml"), "--steps", "6", "--out", str(tmp_path),
                                    "-q", "--set", "schedule.max_staleness=2"])
    assert out.exit_code == 0, out.output
    generator = json.loads((tmp_path / "ledger" / "rank0.json").read_text())
    trainer = json.loads((tmp_path / "ledger" / "rank1.json").read_text())
    assert generator["roles"] == ["policy/generate"] and generator["rollout_steps_held"] == [5]
    assert trainer["rollout_steps_held"] == []
    assert [r["step"] for r in metrics(tmp_path)] == list(range(6))


def test_a_nan_reward_fails_the_run_and_leaves_no_nan_checkpoint(tmp_path):
    """A NaN reward was accepted: the run exited 0 with `loss nan`, `latest` pointed at a checkpoint whose
    weights were all NaN and metrics.jsonl held bare NaN. Now the run stops at the step that made it
    (exit 2), naming the node, the function, the step and the prompt, and the newest checkpoint is the
    one before it, with finite weights."""
    import torch

    from graphrl.executors.outputs import latest_checkpoint, load_checkpoint

    code, output = _run_in_process(_faulty_job(tmp_path, "nan_at_step_two"), tmp_path / "run")
    assert code == 2, output
    assert "reward node 'score'" in output and "faulty_rewards:nan_at_step_two" in output
    assert "step 2, rollout" in output and "prompt" in output and "Traceback" not in output
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt is not None and ckpt.name == "step_000001"
    weights = load_checkpoint(ckpt)["roles"]["policy"]["weights"]
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # strict enough: Python accepts NaN, so check the text too
        assert "NaN" not in line


def test_a_reward_function_returning_a_string_fails_naming_it(tmp_path):
    code, output = _run_in_process(_faulty_job(tmp_path, "returns_a_string"), tmp_path / "run")
    assert code == 2, output
    assert "faulty_rewards:returns_a_string" in output and "returned a str" in output
    assert "AttributeError" not in output
