"""What a command writes: never over a file it reads, never half of it.

`graphrl compile JOB -o JOB` used to replace the user's job with a plan, `graphrl simulate JOB --trace JOB`
with a trace. Every output path a command takes is checked against what the command reads (the job file,
the files and folders the job names, a plan file, a run folder's records), and written whole or not at all
(a temporary file beside it, renamed into place), so an interrupted command leaves the old file as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

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




def write_folder(target: Path, fill: Callable[[Path], None], marker: str, record: dict[str, Any]) -> None:
    """Write a folder whole or not at all: `fill` writes into a temporary sibling, `marker` (a JSON file listing
    `record` and every file written) is added, and the sibling replaces `target` (which the caller checked is
    empty, or an earlier folder of the same marker: moved aside, deleted once replaced). An interrupted write
    leaves `target` as it was."""
    tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
    target.parent.mkdir(parents=True, exist_ok=True)
    old = None
    try:
        fill(tmp)
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / marker).write_text(json.dumps({**record, "files": files}, indent=2) + "\n")
        if target.is_dir():
            old = target.with_name(f".{target.name}.replaced-{os.getpid()}")
            target.rename(old)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old)


def writable_folder(out: Path, *, label: str, command: str, marker: str, force: bool, inputs: Iterable[Path],
                    example: str) -> Path:
    """The absolute folder `graphrl <command>` may write as `out` (the option `label`), refusing any place where
    it would delete what it did not write: a non-empty folder (with `force`, only one an earlier run of the
    command wrote, its `marker` listing the files and nothing else beside them), a file, the working folder or a
    folder holding it or one of the command's `inputs`. `example`: an `out` to suggest."""
    target = out.resolve()
    cwd = Path.cwd().resolve()
    held = [p.resolve() for p in inputs]
    if target == target.parent or target == cwd or target in cwd.parents or \
            any(target == p or target in p.parents for p in held):
        place = "the working folder" if target == cwd else "a folder holding the working folder or what it reads"
        raise OutputError(f"{label} {out} is {place}", fix=f"name a new folder for the {command}, e.g. {example}")
    if target.exists() and not target.is_dir():
        raise OutputError(f"{label} {out} is a file", fix=f"name a new folder for the {command}")
    if target.is_dir() and any(target.iterdir()):
        written_by = target / marker
        if not force:
            raise OutputError(f"{label} {out} is not empty; {command}ing would replace what it holds",
                              fix="name a new folder" + (f" (or pass --force to replace this earlier {command})"
                                                         if written_by.is_file() else ""))
        try:
            written = set(json.loads(written_by.read_text())["files"])
        except (OSError, ValueError, KeyError, TypeError):
            raise OutputError(f"{label} {out} was not written by `graphrl {command}` (it has no readable {marker}); "
                              f"--force only replaces an earlier {command}",
                              fix="name a new folder, or empty this one yourself") from None
        others = sorted(p.name for p in target.iterdir() if p.name not in written | {marker})
        if others:
            raise OutputError(f"{label} {out} holds files the earlier {command} did not write ({', '.join(others[:5])}); "
                              "--force would delete them", fix="move them elsewhere first, or name a new folder")
    return target


__all__ = ["job_inputs", "refuse_overwriting_inputs", "same_place", "writable_folder", "write_atomically",
           "write_folder"]
