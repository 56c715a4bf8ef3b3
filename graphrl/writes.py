"""What a command writes: never over a file it reads, never half of it.

`graphrl compile JOB -o JOB` used to replace the user's job with a plan, `graphrl simulate JOB --trace JOB`
with a trace. Every output path a command takes is checked against what the command reads (the job file,
the files and folders the job names, a plan file, a run folder's records), and written whole or not at all
(a temporary file beside it, renamed into place), so an interrupted command leaves the old file as it was.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel

from graphrl.errors import OutputError


def same_place(a: Path, b: Path) -> bool:
    """Whether two paths name the same file, or `a` lies inside folder `b` (resolved, links followed)."""
    try:
        if a.exists() and b.exists() and os.path.samefile(a, b):
            return True
    except OSError:
        pass
    ra, rb = a.resolve(), b.resolve()
    return ra == rb or rb in ra.parents


def refuse_overwriting_inputs(output: Path, inputs: Iterable[Path], option: str, instead: Path) -> None:
    """Refuse `output` (written for `option`) when it is one of `inputs` or inside an input folder; the fix
    suggests `instead`."""
    for source in inputs:
        if same_place(output, source):
            what = "its input" if output.resolve() == source.resolve() else "a folder it reads"
            raise OutputError(f"{option} {output} would write over {what} {source}",
                              fix=f"pass {option} a path of its own, e.g. {instead}")


def job_inputs(loaded: Any) -> list[Path]:
    """What a loaded job reads: its own file and every path it names (datasets, checkpoints, cluster files,
    run folders it takes lengths from), as resolved when it loaded."""
    found: list[Path] = [loaded.path] if loaded.path is not None else []

    def walk(value: Any) -> None:
        if isinstance(value, Path):
            found.append(value if value.is_absolute() else loaded.base_dir / value)
        elif isinstance(value, BaseModel):
            for name in type(value).model_fields:
                walk(getattr(value, name))
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(loaded.spec)
    cluster = loaded.spec.cluster
    if isinstance(cluster, str) and cluster.endswith((".yaml", ".yml")):
        found.append(Path(cluster) if Path(cluster).is_absolute() else loaded.base_dir / cluster)
    return found


def write_atomically(path: Path, data: str | bytes) -> None:
    """Write `path` whole: into a temporary file beside it, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


__all__ = ["job_inputs", "refuse_overwriting_inputs", "same_place", "write_atomically"]
