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

import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor

from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from graphrl.errors import RunError
from graphrl.schemas.job import JobSpec
from graphrl.schemas.sharding import is_adapter

from graphrl.executors.guards import check_weights
from graphrl.executors.models.llama import Llama
from graphrl.executors.outputs import (checkpoint_files, checkpoint_folders, file_sums, finish_checkpoint,
                                       versions_ahead_file)
from graphrl.executors.parallel import full_state_dict
from graphrl.executors.roles import RoleState, role_group
from graphrl.executors.rollouts import Piece
from graphrl.executors.runtime import Runtime



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


def _options() -> StateDictOptions:
    """The trained state alone: a LoRA model's frozen base is loaded from where it came from, never saved."""
    return StateDictOptions(ignore_frozen_params=True)


def save_role_state(root: Path, role: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    group: Any) -> None:
    """This rank's part of `role`'s model and optimizer state (a collective over `group`, the ranks
    that hold the role; None when one rank holds it)."""
    model_sd, optim_sd = get_state_dict(module, _local_optimizer(optimizer), options=_options())
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
    model_sd, optim_sd = get_state_dict(module, local, options=_options())
    state = {"model": model_sd, "optim": optim_sd}
    try:
        with _one_rank_quietly():
            dcp.load(state, checkpoint_id=folder, process_group=group, no_dist=group is None)
    except Exception as exc:  # DCP wraps each rank's failure; the first line of its reason names the file
        raise RunError(f"checkpoint {root}: cannot load the state of {role} from {folder}: {_reason(exc)}",
                       fix="resume from an earlier checkpoint (move this one aside), or start without --resume") from exc
    # strict=False: the keys loaded are exactly those `get_state_dict` gave above (a LoRA model's adapters, not
    # its frozen base), so nothing the checkpoint should hold can be missing.
    set_state_dict(module, local, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))


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




def write_checkpoint(out_dir: Path, step: int, roles: dict[str, RoleState], rt: Runtime, group: Any, job: JobSpec, *,
                     reporter: bool, inflight: dict[int, list[Piece]], layout: dict[str, Any],
                     versions_ahead: dict[str, dict[int, dict[str, Tensor]]]) -> None:
    """The checkpoint after `step`, written by every rank of `group` (a collective): each writes its
    shards of the trained `roles` and the rollouts it holds for later steps (`inflight`); the `reporter`
    adds the full weights, a trained policy's Hugging Face folder, the weight versions a longer run's
    generator reads (`versions_ahead`: model -> version -> weights), the manifest, and moves the folder
    into place. Weights holding NaN are refused before anything is written."""
    partial, final = checkpoint_folders(out_dir, step)
    # Sharded weights are gathered tensor by tensor by every rank of the shard group (a collective);
    # only the reporting rank keeps them, in host memory, and saves them once.
    weights = {name: full_state_dict(r.module, keep=reporter, to_host=True) for name, r in roles.items()}
    # A LoRA role's file holds its adapters (the base is where the job loaded it from, named in meta.json);
    # its exports below still read the full weights.
    saved = {name: {k: v for k, v in w.items() if is_adapter(k)} if job.models[roles[name].placement.model].lora
             else w for name, w in weights.items()}
    if reporter:
        check_weights(weights, step)  # before anything is written: a NaN checkpoint never exists
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier(group)
    for name, r in roles.items():
        assert r.optimizer is not None
        save_role_state(partial, name, r.module, r.optimizer, role_group(r, rt))
    save_inflight(partial, rt.rank, inflight)
    _barrier(group)
    sums = _shared_sums(partial, group, reporter)
    if reporter:
        _export_trained(partial, roles, weights, job)  # inside the manifest, before `latest` names it
        ahead = _write_versions_ahead(partial, versions_ahead)
        lora = {name: {"lora": spec.lora.model_dump(mode="json"),
                       "base": None if spec.checkpoint is None else str(spec.checkpoint)}
                for name, r in roles.items() if (spec := job.models[r.placement.model]).lora is not None}
        finish_checkpoint(partial, final, step, roles, saved, job.run.seed, sorted(inflight), layout,
                          extra={"versions_ahead": ahead}, sums=sums, role_extra=lora)
    _barrier(group)


def _shared_sums(partial: Path, group: Any, reporter: bool) -> dict[str, str]:
    """The checksums of the files every rank has written, each rank reading its share of them (a
    collective over `group`), gathered on the reporter for the manifest: no one rank reads a large
    checkpoint whole. A file one rank does not see (a shared file system's late listing) is left to the
    reporter."""
    if group is None:
        return {}
    names = checkpoint_files(partial)
    members = dist.get_world_size(group)
    mine = file_sums(partial, names[dist.get_rank(group)::members])
    gathered: list[Any] = [None] * members
    dist.all_gather_object(gathered, mine, group=group)
    return {name: digest for share in gathered for name, digest in share.items()} if reporter else {}


def _barrier(group: Any) -> None:
    if group is not None:
        dist.barrier(group=group)


def _write_versions_ahead(folder: Path, versions: dict[str, dict[int, dict[str, Tensor]]]) -> dict[str, list[int]]:
    """The older weight versions a longer run's generator reads, beside the last checkpoint (other
    checkpoints hold the rollouts generated ahead instead); model -> the versions written."""
    from safetensors.torch import save_file

    for model, by_version in versions.items():
        for version, tensors in sorted(by_version.items()):
            target = folder / versions_ahead_file(model, version)
            target.parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(target))
    return {model: sorted(by_version) for model, by_version in versions.items()}


def _export_trained(folder: Path, roles: dict[str, RoleState], weights: dict[str, dict[str, Tensor]],
                    job: JobSpec) -> None:
    """Trained policies started from a real checkpoint also become `<role>_hf/`, a folder transformers loads (a
    LoRA policy's with its adapters merged into the base), and a LoRA policy's adapters `<role>_adapter/`, in
    the PEFT library's format."""
    from graphrl.models import export_trained
    from graphrl.models.adapters import merge_adapters, save_peft_adapter

    for name, role in roles.items():
        spec = job.models[role.placement.model]
        if role.placement.kind != "train" or not isinstance(role.module, Llama):
            continue
        safe, dims, state = name.replace("/", "__"), spec.resolved_dims(), weights[name]
        if spec.lora is not None:
            adapters = {k: v for k, v in state.items() if is_adapter(k)}
            save_peft_adapter(folder / f"{safe}_adapter", adapters, spec.lora, dims,
                              None if spec.checkpoint is None else str(spec.checkpoint))
            state = merge_adapters({k: v for k, v in state.items() if not is_adapter(k)}, adapters, spec.lora)
        if spec.checkpoint is not None:
            export_trained(folder / f"{safe}_hf", dims, state, spec.checkpoint)


__all__ = ["load_inflight", "load_role_state", "save_inflight", "save_role_state", "write_checkpoint"]
