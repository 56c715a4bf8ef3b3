"""Dataset files: JSON lines and parquet with a field mapping, seeded shuffling that resumes exactly,
missing files and fields refused by name, and chat-templated left-padded prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphrl.cli import main
from graphrl.datasets import read_examples, step_indices
from graphrl.errors import GraphRLError
from graphrl.schemas.job import PromptFields

ROWS = [{"question": f"What is {i} + 1?", "solution": str(i + 1), "sys": "Be brief."} for i in range(10)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_read_the_same(tmp_path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    fields = PromptFields(prompt="question", answer="solution", system="sys")
    from_jsonl = read_examples(_jsonl(tmp_path / "d.jsonl", ROWS), fields)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    assert read_examples(tmp_path / "d.parquet", fields) == from_jsonl
    assert from_jsonl[3].prompt == "What is 3 + 1?" and from_jsonl[3].answer == "4" and from_jsonl[3].system == "Be brief."


def test_missing_file_and_field_are_named(tmp_path) -> None:
    with pytest.raises(GraphRLError, match="does not exist"):
        read_examples(tmp_path / "none.jsonl", PromptFields())
    _jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(GraphRLError, match=r"row 1: no field 'prompt'.*'question'"):
        read_examples(tmp_path / "d.jsonl", PromptFields(answer="solution"))


def test_each_epoch_visits_every_row_once_and_resuming_continues_exactly() -> None:
    order = [i for step in range(5) for i in step_indices(10, 4, step, seed=3)]  # 20 positions = 2 epochs
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:]) == list(range(10))
    assert order[:10] != order[10:]  # each epoch is reshuffled
    assert step_indices(10, 4, 3, seed=3) == order[12:16]  # a run resumed at step 3 draws the same rows
    assert step_indices(10, 4, 0, seed=4) != order[:4]


def test_chat_template_prompts_are_left_padded(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from graphrl.models.tokenizer import encode_left_padded, prompt_text, stop_token_ids

    words = ["<pad>", "<|im_end|>", "<|im_start|>", "user", "assistant", "system", "hi", "there", "\n"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    text = prompt_text(tok, "hi there", None, chat_template=True)
    assert text == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    ids, mask = encode_left_padded(tok, [text, prompt_text(tok, "hi", None, True)], length=16)
    assert mask[:, -1].all() and mask.sum(1).tolist() == [7, 6] and ids[1, :10].eq(0).all()
    assert ids[0, -7:].tolist() == [2, 3, 6, 7, 1, 2, 4]
    assert stop_token_ids(tok) == [1]
    with pytest.raises(GraphRLError, match="prompt_len"):
        encode_left_padded(tok, [text], length=4)


def test_job_with_missing_dataset_field_exits_2(tmp_path) -> None:
    from click.testing import CliRunner

    _jsonl(tmp_path / "train.jsonl", ROWS)
    job = tmp_path / "job.yaml"
    job.write_text(f"""name: files
cluster: local-cpu-1
models:
  policy: {{preset: tiny-digits, dtype: float32}}
nodes:
  prompts: {{op: dataset, file: train.jsonl, fields: {{prompt: question, answer: answer}}, batch_size: 2, prompt_len: 8}}
  rollout: {{op: generate, model: policy, max_new_tokens: 4, inputs: {{prompts: prompts.prompts}}}}
  score: {{op: reward, rules: {{numeric_answer: 1.0}}, inputs: {{rollouts: rollout.rollouts}}}}
  adv: {{op: advantage, estimator: grpo, inputs: {{rewards: score.rewards, rollouts: rollout.rollouts}}}}
  update: {{op: train, model: policy, loss: grpo, inputs: {{rollouts: rollout.rollouts, advantages: adv.advantages}}}}
""")
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 2
    assert "no field 'answer'" in result.output and "nodes.prompts.fields" in result.output
    job.write_text(job.read_text().replace("train.jsonl", "missing.jsonl"))
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 2 and "missing.jsonl does not exist" in result.output
