"""The files a job names (model checkpoints, dataset files): made absolute and checked when it loads; a model
given by its checkpoint alone gets the checkpoint's dims here, so nothing after loading reads config.json.

Paths in a job are relative to the job file, never to the working directory, so a job runs the same
from anywhere; a missing checkpoint, dataset file or dataset column is a JobError naming the field, and so
is what a rank would refuse of them when it starts (a config.json it cannot read, no tokenizer for a file
dataset, a prompt longer than prompt_len).
"""

from __future__ import annotations

from pathlib import Path

from graphrl.errors import GraphRLError, JobError
from graphrl.schemas.job import JobSpec
from graphrl.schemas.model import ModelDims


def _absolute(path: Path, base_dir: Path) -> Path:
    return path if path.is_absolute() else (base_dir / path).resolve()


def resolve_job_files(spec: JobSpec, base_dir: Path) -> JobSpec:
    """The job with checkpoint and dataset paths absolute; refuses files or columns that are missing."""
    from graphrl.datasets import check_file_prompts, read_examples

    models = {}
    for name, model in spec.models.items():
        if model.checkpoint is None:
            models[name] = model
            continue
        path = _absolute(model.checkpoint, base_dir)
        if not path.exists():
            raise JobError(f"checkpoint {path} does not exist", path=("models", name, "checkpoint"),
                           fix="point it at a Hugging Face model folder or a .gguf file (relative to the job file)")
        dims = _checked_checkpoint(name, path)
        if model.preset is None and model.dims is None:  # the checkpoint's architecture, read here once
            models[name] = model.model_copy(update={"checkpoint": path, "dims": dims})
        else:
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
        check_file_prompts(name, node, rows, spec.nodes, models)
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


def _checked_checkpoint(name: str, path: Path) -> ModelDims:
    """The architecture of a checkpoint a rank can load (config.json or GGUF metadata, weights present), or
    its error at `models.<name>.checkpoint`."""
    from graphrl.models.checkpoints import check_checkpoint

    try:
        return check_checkpoint(path)
    except GraphRLError as exc:
        raise type(exc)(exc.message, path=("models", name, "checkpoint"), fix=exc.fix) from None
