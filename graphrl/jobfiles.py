"""The files a job names (model checkpoints, dataset files): made absolute and checked when it loads.

Paths in a job are relative to the job file, never to the working directory, so a job runs the same
from anywhere; a missing checkpoint, dataset file or dataset column is a JobError naming the field.
"""

from __future__ import annotations

from pathlib import Path

from graphrl.errors import GraphRLError, JobError
from graphrl.schemas.job import JobSpec


def _absolute(path: Path, base_dir: Path) -> Path:
    return path if path.is_absolute() else (base_dir / path).resolve()


def resolve_job_files(spec: JobSpec, base_dir: Path) -> JobSpec:
    """The job with checkpoint and dataset paths absolute; refuses files or columns that are missing."""
    from graphrl.datasets import read_examples

    models = {}
    for name, model in spec.models.items():
        if model.checkpoint is None:
            models[name] = model
            continue
        path = _absolute(model.checkpoint, base_dir)
        if not path.exists():
            raise JobError(f"checkpoint {path} does not exist", path=("models", name, "checkpoint"),
                           fix="point it at a Hugging Face model folder or a .gguf file (relative to the job file)")
        models[name] = model.model_copy(update={"checkpoint": path})
    nodes = {}
    for name, node in spec.nodes.items():
        if node.op == "generate":
            nodes[name] = _measured_lengths(name, node, base_dir)
            continue
        if node.op != "dataset" or node.file is None:
            nodes[name] = node
            continue
        path = _absolute(node.file, base_dir)
        try:
            rows = read_examples(path, node.fields)
        except GraphRLError as exc:
            field = "fields" if "no field" in exc.message else "file"
            raise JobError(exc.message, path=("nodes", name, field), fix=exc.fix) from None
        node = node.model_copy(update={"file": path})
        _check_prompt_lengths(name, node, rows, _generating_checkpoint(spec, name, models))
        nodes[name] = node
    return spec.model_copy(update={"models": models, "nodes": nodes})


def _measured_lengths(name: str, node, base_dir: Path):  # noqa: ANN001, ANN202
    """A generate node whose `response_tokens.from` names a run folder, with the lengths that run recorded."""
    lengths = node.response_tokens
    if lengths is None or lengths.from_run is None:
        return node
    from graphrl.compiler.lengths import read_measured

    folder = _absolute(lengths.from_run, base_dir)
    path = ("nodes", name, "response_tokens", "from")
    if not folder.is_dir():
        raise JobError(f"run folder {folder} does not exist", path=path,
                       fix="give the folder of an earlier `graphrl run` (relative to the job file)")
    measured = read_measured(folder)
    if not measured:
        raise JobError(f"{folder / 'samples.jsonl'} records no response lengths", path=path,
                       fix="run with run.samples_per_step > 0 first, or give response_tokens: {mean: ..., max: ...}")
    return node.model_copy(update={"response_tokens": lengths.model_copy(
        update={"from_run": folder, "measured": measured})})


def _generating_checkpoint(spec: JobSpec, dataset: str, models: dict) -> Path | None:  # noqa: ANN001
    """The checkpoint of the model that generates from `dataset`'s prompts (its tokenizer renders them)."""
    for node in spec.nodes.values():
        if node.op == "generate" and any(ref.split(".")[0] == dataset for ref in node.inputs.values()):
            return models[node.model].checkpoint
    return None


def _check_prompt_lengths(name: str, node, rows: list, checkpoint: Path | None) -> None:  # noqa: ANN001
    """Tokenize every prompt as the run will and refuse one longer than prompt_len now, not at run time."""
    from graphrl.datasets import check_prompt_lengths, prompt_token_rows
    from graphrl.models import has_tokenizer
    from graphrl.models.tokenizer import load_tokenizer

    if checkpoint is None or node.long_prompts == "truncate" or not has_tokenizer(checkpoint):
        return
    try:
        check_prompt_lengths(node, prompt_token_rows(node, load_tokenizer(checkpoint), rows))
    except GraphRLError as exc:
        raise JobError(exc.message, path=("nodes", name, "prompt_len"), fix=exc.fix) from None
