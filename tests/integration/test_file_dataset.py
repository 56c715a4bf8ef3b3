"""A job on a model folder with its own tokenizer and a JSON-lines dataset, run by `graphrl run`.

A tiny random Llama (the digit preset's dims) with a 16-word tokenizer and a chat template stands in
for a real checkpoint, so the whole path (chat-templated prompts, stop tokens, answer rules, samples,
the exported policy folder) runs in seconds. A rule that raises must be reported with its rollout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
transformers = pytest.importorskip("transformers")

WORDS = ["<pad>", "<|im_end|>", "<|im_start|>", "user", "assistant", "system"] + [str(d) for d in range(10)]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _model_folder(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from graphrl.executors.models.llama import Llama
    from graphrl.models import save_pretrained
    from graphrl.schemas.model import MODEL_PRESETS

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                                     pad_token="<pad>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    save_pretrained(Llama(MODEL_PRESETS["tiny-digits-tied"]), folder, tokenizer)


def _job(tmp_path: Path, rules: str) -> Path:
    _model_folder(tmp_path / "model")
    rows = [{"q": f"{a} {b}", "a": str(a + b)} for a in range(5) for b in range(5)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = tmp_path / "job.yaml"
    job.write_text(f"""name: file_dataset
cluster: local-cpu-1
models:
  policy: {{checkpoint: model, dtype: float32}}
nodes:
  prompts: {{op: dataset, file: train.jsonl, fields: {{prompt: q, answer: a}}, batch_size: 4, prompt_len: 16}}
  rollout: {{op: generate, model: policy, samples_per_prompt: 2, max_new_tokens: 4, inputs: {{prompts: prompts.prompts}}}}
  score: {{op: reward, rules: {rules}, inputs: {{rollouts: rollout.rollouts}}}}
  adv: {{op: advantage, estimator: grpo, inputs: {{rewards: score.rewards, rollouts: rollout.rollouts}}}}
  update: {{op: train, model: policy, loss: grpo, inputs: {{rollouts: rollout.rollouts, advantages: adv.advantages}}}}
algorithm: {{lr: 1.0e-3}}
schedule: {{steps: 2}}
run: {{samples_per_step: 3}}
""")
    return job


def _run(job: Path, out: Path) -> tuple[int, str]:
    """`graphrl run JOB` from this process (its ranks are processes; `faulty_rewards` is on their path, as
    this folder is on the test's): its exit code and what it said."""
    from click.testing import CliRunner

    from graphrl.cli import main

    result = CliRunner().invoke(main, ["run", str(job), "--out", str(out), "-q"])
    return result.exit_code, result.output


def test_file_dataset_job_runs_and_writes_readable_samples(tmp_path) -> None:
    code, output = _run(_job(tmp_path, "{numeric_answer: 1.0, boxed_format: 0.5}"), tmp_path / "run")
    assert code == 0, output[-2000:]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["index"]) for s in samples] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    first = samples[0]
    a, b = first["prompt"].split("user")[1].split()[:2]  # the rendered chat prompt holds the row's question
    assert first["answer"] == str(int(a) + int(b)) and first["weight_version"] == 0
    assert samples[0]["prompt"] == samples[1]["prompt"]  # two samples of one prompt (the GRPO group)
    exported = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1] / "policy_hf"
    assert transformers.AutoTokenizer.from_pretrained(exported).chat_template == TEMPLATE


def test_a_raising_answer_rule_is_reported_with_its_rollout(tmp_path) -> None:
    code, output = _run(_job(tmp_path, "{faulty_rewards:answer_rule_raising_on_twos: 1.0}"), tmp_path / "run")
    assert code != 0
    match = re.search(r"answer_rule_raising_on_twos' raised ValueError: cannot compare this answer \(injected\) "
                      r"on response (\d+) \(response .*, answer '(\d+)'\) of step 0, rollout (\d+); "
                      r"prompt 'user (\d) (\d) assistant'", output)
    assert match is not None, output[-2000:]
    index, answer, rollout, a, b = match.groups()
    assert "2" in answer and int(a) + int(b) == int(answer)  # the named rollout is the one that triggered it
    assert index == rollout  # one reward instruction scores the whole step here


def test_an_answer_rule_returning_nan_fails_the_run_naming_node_rule_and_prompt(tmp_path) -> None:
    """A rule's NaN was summed into the reward and the run finished with NaN weights; it is now refused
    where it is made (exit 2), naming the reward node, the rule, the step, the rollout and its prompt."""
    code, output = _run(_job(tmp_path, "{faulty_rewards:rule_returning_nan: 1.0}"), tmp_path / "run")
    assert code == 2, output[-2000:]
    assert re.search(r"reward node 'score': reward rule 'faulty_rewards:rule_returning_nan' returned nan, not a "
                     r"finite number on response 0 .* of step 0, rollout 0; prompt 'user \d \d assistant'", output), output[-2000:]
    assert "Traceback" not in output and not (tmp_path / "run" / "checkpoints").exists()
