"""Resumable training state: every trained role's weights and optimizer state through
torch.distributed.checkpoint (DCP), each rank writing its own shards, plus the rollouts in flight.

A checkpoint folder `checkpoints/step_<k>/` holds:
- `dcp/<role>/`: the role's model and optimizer state dicts as `get_state_dict` gives them: DTensor
  shards for FSDP2 and fsdp x tp trainers (each rank writes what it holds, DCP records the global
  layout), plain tensors for DDP and single-rank trainers (written once, replicas deduplicated);
- `inflight.rank<r>.pt`: the rollouts of later steps that rank `r` had already received when the
  checkpoint was taken (an asynchronous schedule generates ahead with older weights; keeping those
  rollouts makes a resumed run exactly the uninterrupted one, without the older weights); a resume on
  another layout reads all ranks' files (`load_inflight`);
- `<role>.safetensors` and `meta.json` (`outputs.py`): full weights, weight versions, the next step.

Every trainer rank writes into `.step_<k>.partial/`; once all have (a barrier over the trainer group)
the reporting rank adds the full weights and `meta.json` and renames the folder into place, so an
interrupted save never leaves a checkpoint that looks complete.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp

from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from graphrl.errors import RunError
from graphrl.executors.rollouts import Piece



@contextmanager
def _one_rank_quietly() -> Iterator[None]:
    """DCP warns that it assumes one process whenever `no_dist` is set, which is what a role held by
    one rank asks for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _folder(root: Path, role: str) -> Path:
    return root / "dcp" / role.replace("/", "__")


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this rank holds: ZeRO-1's `ZeroRedundancyOptimizer` steps an inner one
    over this rank's share of the parameters, whose state DCP saves under the parameters' names (every
    rank its own share; a resume on another layout reads each share wherever it was written)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def save_role_state(root: Path, role: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    group: Any) -> None:
    """This rank's part of `role`'s model and optimizer state (a collective over `group`, the ranks
    that hold the role; None when one rank holds it)."""
    model_sd, optim_sd = get_state_dict(module, _local_optimizer(optimizer))
    with _one_rank_quietly():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=_folder(root, role), process_group=group,
                 no_dist=group is None)


def load_role_state(root: Path, role: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    group: Any) -> None:
    """Load `role`'s state saved by `save_role_state` into this rank's shards, whatever the layout
    they were written from, as long as the parameter names and shapes agree."""
    folder = _folder(root, role)
    if not folder.is_dir():
        raise RunError(f"checkpoint {root} has no sharded state for {role} ({folder} is missing)",
                       fix="resume from a checkpoint written by this version of graphrl, or start without --resume")
    local = _local_optimizer(optimizer)
    model_sd, optim_sd = get_state_dict(module, local)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        with _one_rank_quietly():
            dcp.load(state, checkpoint_id=folder, process_group=group, no_dist=group is None)
    except Exception as exc:  # DCP wraps each rank's failure; the first line of its reason names the file
        raise RunError(f"checkpoint {root}: cannot load the state of {role} from {folder}: {_reason(exc)}",
                       fix="resume from an earlier checkpoint (move this one aside), or start without --resume") from exc
    set_state_dict(module, local, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save_inflight(root: Path, rank: int, pieces: dict[int, list[Piece]]) -> None:
    """The rollouts this rank holds for steps after the checkpoint, on the host."""
    host = {step: [(a, b, {k: v.cpu() for k, v in data.items()}) for a, b, data in held]
            for step, held in pieces.items()}
    torch.save(host, root / f"inflight.rank{rank}.pt")


def load_inflight(root: Path, rank: int | None, device: torch.device) -> dict[int, list[Piece]]:
    """The rollouts rank `rank` saved; with `rank` None, those of every rank that saved some, each
    range once. A resume on another layout takes the latter: the ranks that consume a step's rollouts
    are not the ones that held them, and a piece names its responses by their place in the batch
    (start, stop), which does not depend on the layout, so joining rollouts takes what it needs."""
    paths = [root / f"inflight.rank{rank}.pt"] if rank is not None else sorted(root.glob("inflight.rank*.pt"))
    out: dict[int, list[Piece]] = {}
    seen: set[tuple[int, int, int]] = set()
    for path in paths:
        if not path.exists():
            continue
        try:
            held = torch.load(path, weights_only=True)
        except Exception as exc:
            raise RunError(f"checkpoint {root}: cannot read the rollouts in {path}: {_reason(exc)}",
                           fix="resume from an earlier checkpoint (move this one aside)") from exc
        for step, pieces in held.items():
            for a, b, data in pieces:
                key = (int(step), int(a), int(b))
                if key not in seen:
                    seen.add(key)
                    out.setdefault(int(step), []).append((int(a), int(b), {k: v.to(device) for k, v in data.items()}))
    return out


def _reason(exc: BaseException) -> str:
    """A one-line reason from an exception that may span many lines (DCP's CheckpointException holds
    every rank's traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


__all__ = ["load_inflight", "load_role_state", "save_inflight", "save_role_state"]
