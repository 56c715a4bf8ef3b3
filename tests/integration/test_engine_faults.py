"""A vLLM generator that fails ends the run cleanly: exit 2 naming the role, the rank, the cause and its
remedy, every rank ended, the last checkpoint intact.

The ranks run with a stand-in for vllm on their path (`fake_vllm/vllm`: samples over the model's vocabulary
and fails where `GRAPHRL_FAKE_VLLM_FAIL` says), so the whole run, launcher and ranks, is the real one on
machines without vllm. Real vLLM's own start and generation are `test_vllm_engine.py`'s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphrl.executors.outputs import latest_checkpoint, load_checkpoint

from run_processes import no_rank_processes_left

HERE = Path(__file__).resolve().parent
JOB = HERE.parents[1] / "examples" / "grpo_tiny.yaml"

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, fault: str) -> tuple[int, str, Path]:
    """grpo_tiny on two ranks, its generator on the stand-in engine, a checkpoint after every step."""
    job = tmp_path / "job.yaml"
    job.write_text(JOB.read_text().replace("  steps: 400", "  steps: 4\n  checkpoint_every: 1"))
    out = tmp_path / "run"
    env = {**os.environ, "GRAPHRL_FAKE_VLLM_FAIL": fault,
           "PYTHONPATH": os.pathsep.join([str(HERE / "fake_vllm"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "graphrl.cli", "run", str(job), "--out", str(out), "-q",
                           "--set", "placement.roles.policy/generate.engine=vllm"],
                          capture_output=True, text=True, env=env, timeout=300)
    return proc.returncode, proc.stderr + proc.stdout, out


def test_an_engine_that_dies_mid_run_ends_every_rank_and_keeps_the_last_checkpoint(tmp_path) -> None:
    code, output, out = _run(tmp_path, "generate:1:3")  # rank 1's third generation: step 2
    assert code == 2, output
    assert "rank 1: the vLLM engine of role policy/generate failed while generating step 2" in output
    assert "EngineCore encountered an issue (injected)" in output
    assert "the last checkpoint is intact" in output  # the rank's remedy reaches the user, then the launcher's
    assert "continue from step_000001" in output and "Traceback" not in output
    assert no_rank_processes_left(out)
    ckpt = latest_checkpoint(out)
    assert ckpt is not None and ckpt.name == "step_000001"
    state = load_checkpoint(ckpt)  # intact: its manifest and weights load
    assert state["roles"]["policy"]["weights"]


def test_an_engine_that_fails_to_start_is_named_with_its_cause(tmp_path) -> None:
    code, output, out = _run(tmp_path, "start:0")
    assert code == 2, output
    assert "rank 0: the vLLM engine of role policy/generate failed to start" in output
    assert "No available memory for the cache blocks (injected)" in output
    assert "of KV cache fit next to the weights; or use engine: native" in output
    assert no_rank_processes_left(out) and latest_checkpoint(out) is None
