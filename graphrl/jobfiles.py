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
        if node.op != "dataset" or node.file is None:
            nodes[name] = node
            continue
        path = _absolute(node.file, base_dir)
        try:
            read_examples(path, node.fields)
        except GraphRLError as exc:
            field = "fields" if "no field" in exc.message else "file"
            raise JobError(exc.message, path=("nodes", name, field), fix=exc.fix) from None
        nodes[name] = node.model_copy(update={"file": path})
    return spec.model_copy(update={"models": models, "nodes": nodes})
