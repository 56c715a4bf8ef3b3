"""Run outputs: metrics (JSON lines and TensorBoard scalars) and atomic checkpoints.

A checkpoint is a folder `checkpoints/step_<k>/` with the trained roles' sharded state (`checkpointing.py`),
their full weights (safetensors), their weight versions, the seed and the data position (the next
step). It is written into a partial folder and renamed into place, so a crash never leaves a half
checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

from safetensors.torch import load_file, save_file


def json_line(row: dict[str, Any]) -> str:
    """One JSON line; a NaN or infinite number is written as null (bare `NaN` is not JSON, and readers
    of metrics.jsonl such as `jq` or a browser refuse the whole file for it)."""
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(row), allow_nan=False) + "\n"


class MetricsWriter:
    """`metrics.jsonl` (one line per step, flushed) and TensorBoard scalars, on the reporting rank."""

    def __init__(self, out_dir: Path, *, enabled: bool, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self._file = None
        self._tb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(out_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out_dir / "tensorboard"))
            except Exception:  # tensorboard is optional at run time; metrics.jsonl is the record
                self._tb = None

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled or self._file is None:
            return
        self._file.write(json_line(row))
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


class _JsonLines:
    """A run folder's JSON-lines file, opened (for appending) at its first line, closed with the run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = None

    def _write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        self._file.write(json_line(row))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class SamplesWriter(_JsonLines):
    """`samples.jsonl`: a few rollouts per step as text (prompt, response, reward, weight version), so a
    person can read what the policy does, and each response's length in tokens (`response_tokens`), so a
    later job can take the run's measured lengths (`response_tokens: {from: RUN_DIR}`). Written by the
    rank that scores a step's first responses."""

    def __init__(self, out_dir: Path, per_step: int) -> None:
        super().__init__(out_dir / "samples.jsonl")
        self.per_step = per_step

    def write(self, step: int, version: int, prompts: list[str], responses: list[str], rewards: list[float],
              response_tokens: list[int], answers: list[str] | None,
              episodes: list[dict[str, Any]] | None = None) -> None:
        """One row per response; an episode's row also holds its turns and why it ended (`episodes`), and its
        `response` is its last model turn, `response_tokens` its model tokens."""
        if self.per_step == 0:
            return
        for i, (prompt, response, reward, tokens) in enumerate(zip(prompts, responses, rewards, response_tokens)):
            row = {"step": step, "index": i, "weight_version": version, "reward": reward, "prompt": prompt,
                   "response": response, "response_tokens": tokens}
            if answers is not None:
                row["answer"] = answers[i]
            if episodes is not None:
                row.update(episodes[i])
            self._write(row)


class EnvErrorsWriter(_JsonLines):
    """`env_errors.jsonl`: each episode an environment failure ended (a timeout, an exception, a return the
    protocol refuses, a first message longer than prompt_len), with its step, response index and the reason in
    words, at most `per_step` a step. Written by the generator ranks (one line each, appended)."""

    def __init__(self, out_dir: Path, rank: int, per_step: int = 16) -> None:
        super().__init__(out_dir / "env_errors.jsonl")
        self.rank, self.per_step = rank, per_step

    def write(self, failures: list[dict[str, Any]]) -> None:
        for row in failures[:self.per_step]:
            self._write({**row, "rank": self.rank})


def checkpoint_folders(out_dir: Path, step: int) -> tuple[Path, Path]:
    """(partial, final) folder of the checkpoint after `step`: every rank writes into the first, and
    `finish_checkpoint` renames it to the second."""
    root = out_dir / "checkpoints"
    return root / f".step_{step:06d}.partial", root / f"step_{step:06d}"


MANIFEST = "manifest.json"


def versions_ahead_file(role: str, version: int) -> str:
    """Where in a checkpoint folder an older weight version of `role` is kept for a longer run's generator."""
    return f"versions_ahead/{role.replace('/', '__')}.v{version:06d}.safetensors"


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checkpoint_files(folder: Path) -> list[str]:
    """Every file of a checkpoint folder, relative to it, in a fixed order (the manifest's)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def file_sums(folder: Path, names: Iterable[str]) -> dict[str, str]:
    """The sha256 of each named file of `folder` that exists (a rank's share of a checkpoint's files)."""
    return {name: file_sha256(folder / name) for name in names if (folder / name).is_file()}


def finish_checkpoint(partial: Path, final: Path, step: int, roles: dict[str, Any],
                      weights: dict[str, dict[str, Any]], seed: int, inflight_steps: list[int],
                      layout: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
                      sums: dict[str, str] | None = None, role_extra: dict[str, dict[str, Any]] | None = None) -> Path:
    """Add the full weights, `meta.json` and the manifest to a partial checkpoint (every rank has written
    its files), move it into place atomically, and only then point `latest` at it. `layout`
    (`checkpoint_layout`) is what a resume compares against its own plan; `extra` goes into meta.json, and
    `role_extra` into a role's entry (a LoRA role's adapters and base).
    The manifest holds every file's size and sha256; `sums` are those the ranks already took of their share
    of the files (the rest are read here)."""
    try:
        meta: dict[str, Any] = {"step": step, "next_step": step + 1, "seed": seed, "roles": {},
                                "inflight_steps": inflight_steps, "layout": layout, **(extra or {})}
        for name, role in roles.items():
            safe = name.replace("/", "__")
            tensors = {k: v.detach().cpu().contiguous() for k, v in weights[name].items()}
            save_file(tensors, str(partial / f"{safe}.safetensors"))
            meta["roles"][name] = {"version": role.version, "file": f"{safe}.safetensors", **(role_extra or {}).get(name, {})}
        (partial / "meta.json").write_text(json.dumps(meta))
        # Every file with its size and checksum: a resume checks them, so a shard lost, cut short or
        # changed afterwards (a full disk, a copy interrupted, a bad block) is found by name before any rank
        # starts, and the checkpoint before it is used instead.
        names = checkpoint_files(partial)
        known = sums or {}
        files = {name: {"bytes": (partial / name).stat().st_size,
                        "sha256": known.get(name) or file_sha256(partial / name)} for name in names}
        (partial / MANIFEST).write_text(json.dumps({"files": files}, indent=0))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    marker = final.parent / "latest"
    marker.with_name("latest.tmp").write_text(final.name)
    os.replace(marker.with_name("latest.tmp"), marker)
    return final


def read_meta(path: Path) -> dict[str, Any]:
    """A checkpoint folder's `meta.json` (its step, the next step, its roles' weight versions ...)."""
    return json.loads((path / "meta.json").read_text())


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint folder `path` cannot be resumed from (naming the file), or None if it is intact:
    its manifest present, every file of it present with its size and checksum, its metadata, DCP metadata and rollout files readable."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        return f"{meta_path} is missing"
    try:
        meta = read_meta(path)
        int(meta["next_step"]), dict(meta["roles"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"{meta_path} is not a checkpoint's metadata ({type(exc).__name__}: {exc})"
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"{manifest} is missing (every checkpoint is written with one)"
    try:  # an earlier graphrl wrote sizes only: those are still checked
        files = {name: (entry, None) if isinstance(entry, int) else (int(entry["bytes"]), str(entry["sha256"]))
                 for name, entry in json.loads(manifest.read_text())["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{manifest} is damaged"
    for name, (size, sha256) in files.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} has {file.stat().st_size} bytes, {size} were written (cut short or changed)"
        if sha256 is not None and file_sha256(file) != sha256:
            return f"{file} does not match its checksum (its contents changed since it was written)"
    for name in meta["roles"]:
        folder = path / "dcp" / name.replace("/", "__")
        try:
            from torch.distributed.checkpoint import FileSystemReader

            FileSystemReader(str(folder)).read_metadata()
        except Exception as exc:  # noqa: BLE001 - any reason the metadata cannot be read is the reason to report
            return f"{folder}/.metadata cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if meta.get("inflight_steps") and not list(path.glob("inflight.rank*.pt")):
        return f"{path} holds no inflight.rank*.pt, but meta.json lists rollouts of steps {meta['inflight_steps']}"
    return None


def checkpoint_layout(plan: Any) -> dict[str, Any]:
    """The layout a checkpoint was written from: the chosen placement's label and the number of ranks.
    A resume on another layout is allowed (DCP reshards the trained state, and every rank reads all
    ranks' in-flight rollouts); the comparison only decides which."""
    return {"label": plan.chosen.label, "ranks": plan.cluster.num_devices}


def latest_checkpoint(out_dir: Path, say: Callable[[str], None] | None = None) -> Path | None:
    """The newest intact checkpoint of a run folder (`checkpoint_problem` finds nothing wrong with it);
    `say` is told of each damaged one passed over."""
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return None
    # A `step_*` folder exists only once it is complete (renamed from its partial folder after every
    # rank wrote), so the newest intact one is the one `latest` names, or a newer one if the run ended
    # between the rename and the marker.
    for path in sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if say is not None:
            say(f"checkpoint {path.name} is damaged: {problem}; trying an earlier one")
    return None


def load_checkpoint(path: Path, *, weights: bool = True) -> dict[str, Any]:
    """A checkpoint's metadata, with each role's full weights unless `weights` is False (a resuming
    rank reads its own shards through `checkpointing.load_role_state` instead)."""
    meta = read_meta(path)
    roles = {}
    for name, info in meta["roles"].items():
        roles[name] = {"version": info["version"],
                       "weights": load_file(str(path / info["file"])) if weights else None}
    return {"path": path, "step": meta["step"], "next_step": meta["next_step"], "roles": roles,
            "inflight_steps": meta.get("inflight_steps", []), "layout": meta.get("layout"),
            "versions_ahead": meta.get("versions_ahead", {})}
