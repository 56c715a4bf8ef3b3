"""What damaged or misleading files the job reads get: exit 2, the file and the place in it, and the
fix, never a traceback or "internal error" (the companion of test_bad_inputs.py's job-file corpus; the
files here are made by each test, since they are binary, damaged, or need a model folder beside them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main

REPO = Path(__file__).resolve().parents[2]

transformers = pytest.importorskip("transformers")

WORDS = ["<pad>", "<|im_end|>", "<|im_start|>", "user", "assistant", "system"] + [str(d) for d in range(10)]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:  # noqa: ANN001
    """A tiny Llama folder with a word-level tokenizer and a chat template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    from graphrl.executors.models.llama import Llama
    from graphrl.models import save_pretrained
    from graphrl.schemas.model import MODEL_PRESETS

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("model") / "model"
    save_pretrained(Llama(MODEL_PRESETS["tiny-digits-tied"]), folder, tokenizer)
    return folder


def _job(tmp_path: Path, checkpoint: Path | str, data: str = "train.jsonl", prompt_len: int = 16,
         extra: str = "") -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(f"""name: bad_files
cluster: local-cpu-1
models:
  policy: {{checkpoint: {checkpoint}, dtype: float32}}
nodes:
  prompts: {{op: dataset, file: {data}, fields: {{prompt: q, answer: a}}, batch_size: 4, prompt_len: {prompt_len}{extra}}}
  rollout: {{op: generate, model: policy, samples_per_prompt: 2, max_new_tokens: 4, inputs: {{prompts: prompts.prompts}}}}
  score: {{op: reward, rules: {{numeric_answer: 1.0}}, inputs: {{rollouts: rollout.rollouts}}}}
  adv: {{op: advantage, estimator: grpo, inputs: {{rewards: score.rewards, rollouts: rollout.rollouts}}}}
  update: {{op: train, model: policy, loss: grpo, inputs: {{rollouts: rollout.rollouts, advantages: adv.advantages}}}}
""")
    return job


def _rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


GOOD_ROWS = [{"q": f"{a} {b}", "a": str(a + b)} for a in range(3) for b in range(3)]


def _refused(job: Path, *says: str, sets: tuple[str, ...] = ()) -> str:
    result = CliRunner().invoke(main, ["validate", str(job), *(f"--set={s}" for s in sets)])
    assert result.exit_code == 2, f"exit {result.exit_code}:\n{result.output}"
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    assert result.stderr.startswith("error: ") and len(result.stderr.rstrip("\n").split("\n")) <= 2, result.stderr
    for fragment in says:
        assert fragment in result.stderr, f"{fragment!r} not in {result.stderr!r}"
    return result.stderr


def test_a_dataset_that_is_not_utf8_names_line_and_byte(tmp_path, model_folder) -> None:
    """A Latin-1 dataset ended in a UnicodeDecodeError traceback."""
    (tmp_path / "train.jsonl").write_bytes(b'{"q": "1 2", "a": "3"}\n{"q": "caf\xe9", "a": "1"}\n')
    _refused(_job(tmp_path, model_folder), "train.jsonl:2: not valid UTF-8 (byte 0xe9", "save the file as UTF-8")


def test_a_corrupt_parquet_file_is_named(tmp_path, model_folder) -> None:
    """A damaged parquet file ended in pyarrow's ArrowInvalid traceback."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(GOOD_ROWS), tmp_path / "train.parquet")
    data = (tmp_path / "train.parquet").read_bytes()
    (tmp_path / "train.parquet").write_bytes(data[: len(data) // 2])
    _refused(_job(tmp_path, model_folder, "train.parquet"), "train.parquet is not a readable parquet file")


def test_a_directory_given_as_dataset_file_says_so(tmp_path, model_folder) -> None:
    """A folder given as `file:` was reported as a file that "does not exist"."""
    (tmp_path / "data").mkdir()
    _refused(_job(tmp_path, model_folder, "data"), "is a directory", "nodes.prompts.file")


def test_a_null_answer_is_refused_not_read_as_the_text_none(tmp_path, model_folder) -> None:
    """A null answer became the answer "None", which no response can match: the row silently scored 0."""
    _rows(tmp_path / "train.jsonl", GOOD_ROWS + [{"q": "1 1", "a": None}])
    _refused(_job(tmp_path, model_folder), f"row {len(GOOD_ROWS) + 1}: the answer field 'a' is null")


def test_a_prompt_longer_than_prompt_len_is_found_when_the_job_loads(tmp_path, model_folder) -> None:
    """A prompt longer than prompt_len was found only at run time, as "prompt 7" (0-based), naming
    neither the file nor the field."""
    _rows(tmp_path / "train.jsonl", GOOD_ROWS + [{"q": " ".join("7" * 30), "a": "7"}])
    err = _refused(_job(tmp_path, model_folder), "nodes.prompts.prompt_len", f"train.jsonl, row {len(GOOD_ROWS) + 1}:",
                   "longer than prompt_len 16", "long_prompts: truncate")
    assert "the prompt is 35 tokens" in err  # 30 digits and the chat template's 5 tokens
    ok = CliRunner().invoke(main, ["validate", str(_job(tmp_path, model_folder, extra=", long_prompts: truncate"))])
    assert ok.exit_code == 0, ok.output


def test_long_prompts_truncate_keeps_the_end_of_each_prompt() -> None:
    from graphrl.datasets import left_padded

    ids, mask = left_padded([[1, 2, 3, 4, 5], [7]], 3, 0)
    assert ids.tolist() == [[3, 4, 5], [0, 0, 7]] and mask.tolist() == [[True] * 3, [False, False, True]]


@pytest.mark.parametrize(("config", "says"), [("{not json", "is not valid JSON"),
                                              ('{"model_type": "llama", "hidden_size": 64}', "lacks 'num_attention_heads'"),
                                              ("[1, 2]", "holds a list, not a JSON object")])
def test_a_bad_config_json_is_named_at_validate(tmp_path, model_folder, config: str, says: str) -> None:
    """A config.json that is not JSON, or lacks a key, ended in "internal error (a bug in graphrl)"."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    (folder / "config.json").write_text(config)
    _rows(tmp_path / "train.jsonl", GOOD_ROWS)
    err = _refused(_job(tmp_path, folder), "config.json", says)
    # At the model's checkpoint line, where the user acts: it was placed at nodes.prompts.prompt_len, since
    # the tokenizer that read it was loaded to measure the prompts.
    assert "job.yaml:4:" in err and ": models.policy.checkpoint: " in err and "prompt_len" not in err, err


def _copy(model_folder: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(model_folder, tmp_path / "model"))


def test_a_bad_config_json_is_named_at_the_checkpoint_with_a_task_dataset(tmp_path, model_folder) -> None:
    """With a task dataset no tokenizer reads config.json at validate: a broken one was refused with no place
    at all (only the file), and an architecture the model cannot hold (biases) the same way."""
    folder = _copy(model_folder, tmp_path)
    job = tmp_path / "task.yaml"
    job.write_text((REPO / "examples" / "grpo_tiny.yaml").read_text().replace(
        "preset: tiny-digits-tied", f"checkpoint: {folder}"))
    (folder / "config.json").write_text("{not json")
    err = _refused(job, "is not valid JSON", "restore config.json")
    assert err.startswith(f"error: {job}:10:") and ": models.policy.checkpoint: " in err, err
    config = json.loads((model_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    _refused(job, ": models.policy.checkpoint: ", "attention_bias=true", "use a checkpoint without them")
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": "wide"}))
    _refused(job, ": models.policy.checkpoint: ", "does not describe a model graphrl can build (ValueError")


def test_a_checkpoint_without_weights_is_refused_at_validate(tmp_path, model_folder) -> None:
    """A folder of config.json and tokenizer only (a download of the small files) passed validate; a rank
    refused it loading the weights."""
    folder = _copy(model_folder, tmp_path)
    (folder / "model.safetensors").unlink()
    _rows(tmp_path / "train.jsonl", GOOD_ROWS)
    _refused(_job(tmp_path, folder), ": models.policy.checkpoint: ", "has no *.safetensors weights", "fix: download")


def test_weights_that_differ_from_the_config_are_refused_at_validate(tmp_path, model_folder) -> None:
    """A checkpoint whose tensors do not fit its config.json (here: another model's weights beside it) passed
    validate and the preview; a rank refused it loading the weights. Read from the safetensors headers alone."""
    from safetensors.torch import load_file, save_file

    folder = _copy(model_folder, tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    name = next(n for n in weights if n.endswith("mlp.down_proj.weight"))
    weights[name] = weights[name][:, :-1].contiguous()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _rows(tmp_path / "train.jsonl", GOOD_ROWS)
    _refused(_job(tmp_path, folder), ": models.policy.checkpoint: ", f"{name} has shape",
             "fix: use an unmodified checkpoint")


def test_a_file_dataset_on_a_preset_model_is_refused_at_validate(tmp_path) -> None:
    """A file dataset whose generating model is a preset (no checkpoint, so no tokenizer) passed validate; the
    rank refused it when it started."""
    _rows(tmp_path / "train.jsonl", GOOD_ROWS)
    job = _job(tmp_path, "unused")
    job.write_text(job.read_text().replace("checkpoint: unused", "preset: tiny-digits-tied"))
    err = _refused(job, ": nodes.prompts.file: ", "model 'policy' (which generates from it in node 'rollout')",
                   "fix: set models.policy.checkpoint to a Hugging Face folder or GGUF file with a tokenizer")
    assert "job.yaml:6:" in err, err


def test_a_checkpoint_without_a_tokenizer_is_refused_at_validate(tmp_path, model_folder) -> None:
    """A file dataset on a checkpoint of weights only passed validate (the prompt check skipped it), and the
    rank's error was cut after transformers' first line ("...from one of: ")."""
    from graphrl.errors import GraphRLError
    from graphrl.models.tokenizer import load_tokenizer

    folder = _copy(model_folder, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    _rows(tmp_path / "train.jsonl", GOOD_ROWS)
    err = _refused(_job(tmp_path, folder), ": models.policy.checkpoint: ", "holds no tokenizer", "fix: save the tokenizer")
    assert "job.yaml:4:" in err, err
    with pytest.raises(GraphRLError) as raised:  # the rank's own check, kept: whole, on one line
        load_tokenizer(folder)
    assert "holds no tokenizer" in raised.value.message and "\n" not in raised.value.message
    (folder / "tokenizer.json").write_text("{not json")
    _refused(_job(tmp_path, folder), ": models.policy.checkpoint: ", "has no tokenizer that transformers can read")


def test_a_tokenizer_without_chat_template_is_refused_at_its_field(tmp_path, model_folder) -> None:
    """A base model's tokenizer has no chat template: the rank refused it rendering the prompts; validate
    must, at nodes.prompts.chat_template, and `--set` must be able to turn the template off (the job's files
    were checked before the overrides applied, so no --set could fix them)."""
    folder = _copy(model_folder, tmp_path)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    _rows(tmp_path / "train.jsonl", GOOD_ROWS)
    job = _job(tmp_path, folder)
    _refused(job, ": nodes.prompts.chat_template: ", "has no chat template", "chat_template: false")
    ok = CliRunner().invoke(main, ["validate", str(job), "--set", "nodes.prompts.chat_template=false"])
    assert ok.exit_code == 0, ok.output


def test_a_stop_string_of_several_tokens_is_refused_at_validate(tmp_path, model_folder) -> None:
    """A stop string the tokenizer splits into two tokens was refused by the rank when it started."""
    _rows(tmp_path / "train.jsonl", GOOD_ROWS)
    _refused(_job(tmp_path, model_folder), "--set nodes.rollout.stop=", ": nodes.rollout.stop: ",
             "stop string '1 2' is 2 tokens", "single tokens", sets=("nodes.rollout.stop=['1 2']",))


def test_an_answer_rule_with_the_wrong_signature_is_refused_at_validate(tmp_path, model_folder) -> None:
    """An answer rule `module:function` that cannot take (response, answer) raised TypeError on the rank."""
    _rows(tmp_path / "train.jsonl", GOOD_ROWS)
    job = _job(tmp_path, model_folder)
    job.write_text(job.read_text().replace("numeric_answer: 1.0", "'os.path:join': 1.0, 'operator:add': 1.0"))
    assert CliRunner().invoke(main, ["validate", str(job)]).exit_code == 0  # join(*paths), add(a, b) fit
    job.write_text(job.read_text().replace("'operator:add'", "'os.path:basename'"))
    err = _refused(job, ": nodes.score.rules.os.path:basename: ", "cannot be called as fn(response, answer)",
                   "fix: define it as def basename(response, answer)")
    assert "job.yaml:8:" in err, err


def test_a_truncated_gguf_file_is_named_at_validate(tmp_path) -> None:
    """A GGUF file cut short ended in a traceback from inside the gguf reader."""
    pytest.importorskip("gguf")
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x05" * 20)
    _rows(tmp_path / "train.jsonl", GOOD_ROWS)
    _refused(_job(tmp_path, "model.gguf"), "model.gguf cannot be read as GGUF", "truncated")


def test_a_truncated_safetensors_file_names_the_checkpoint(tmp_path, model_folder) -> None:
    """Loading weights from a checkpoint cut short named no path."""
    import shutil

    from graphrl.errors import GraphRLError
    from graphrl.models.checkpoints import load_state

    folder = tmp_path / "model"
    shutil.copytree(model_folder, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(GraphRLError, match=f"checkpoint {folder} cannot be loaded"):
        load_state(folder)
