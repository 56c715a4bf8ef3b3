"""Run outputs: metrics (JSON lines and TensorBoard scalars) and atomic checkpoints.

A checkpoint is a folder `checkpoints/step_<k>/` with the trained roles' weights (safetensors), their
optimizer state, their weight versions, the RNG seed and the data position (the next step). It is
written into a temporary folder and renamed into place, so a crash never leaves a half checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


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
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


class SamplesWriter:
    """`samples.jsonl`: a few rollouts per step as text (prompt, response, reward, weight version), so a
    person can read what the policy does. Written by the rank that scores a step's first responses."""

    def __init__(self, out_dir: Path, per_step: int) -> None:
        self.path = out_dir / "samples.jsonl"
        self.per_step = per_step
        self._file = None

    def write(self, step: int, version: int, prompts: list[str], responses: list[str], rewards: list[float],
              answers: list[str] | None) -> None:
        if self.per_step == 0:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        for i, (prompt, response, reward) in enumerate(zip(prompts, responses, rewards)):
            row = {"step": step, "index": i, "weight_version": version, "reward": reward, "prompt": prompt,
                   "response": response}
            if answers is not None:
                row["answer"] = answers[i]
            self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def save_checkpoint(out_dir: Path, step: int, roles: dict[str, Any], weights: dict[str, dict[str, Any]],
                    seed: int) -> Path:
    root = out_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step:06d}.", dir=root))
    try:
        meta: dict[str, Any] = {"step": step, "next_step": step + 1, "seed": seed, "roles": {}}
        for name, role in roles.items():
            safe = name.replace("/", "__")
            tensors = {k: v.detach().cpu().contiguous() for k, v in weights[name].items()}
            save_file(tensors, str(tmp / f"{safe}.safetensors"))
            # A sharded optimizer's state lives on every rank; only replicated state is saved here.
            keep_optimizer = role.optimizer is not None and role.wrapping != "fsdp2"
            if keep_optimizer:
                torch.save(role.optimizer.state_dict(), tmp / f"{safe}.optimizer.pt")
            meta["roles"][name] = {"version": role.version, "file": f"{safe}.safetensors",
                                   "optimizer": f"{safe}.optimizer.pt" if keep_optimizer else None}
        meta["rng"] = {"torch": torch.get_rng_state().tolist()}
        (tmp / "meta.json").write_text(json.dumps(meta))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (root / "latest").write_text(final.name)
    return final


def latest_checkpoint(out_dir: Path) -> Path | None:
    root = out_dir / "checkpoints"
    marker = root / "latest"
    if marker.exists():
        path = root / marker.read_text().strip()
        if (path / "meta.json").exists():
            return path
    done = sorted(p for p in root.glob("step_*") if (p / "meta.json").exists()) if root.exists() else []
    return done[-1] if done else None


def load_checkpoint(path: Path) -> dict[str, Any]:
    meta = json.loads((path / "meta.json").read_text())
    roles = {}
    for name, info in meta["roles"].items():
        roles[name] = {
            "version": info["version"],
            "weights": load_file(str(path / info["file"])),
            "optimizer": torch.load(path / info["optimizer"], weights_only=True) if info["optimizer"] else None,
        }
    return {"step": meta["step"], "next_step": meta["next_step"], "roles": roles}
