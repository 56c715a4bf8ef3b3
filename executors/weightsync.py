"""Executing a DDMA weight sync: the plan's transfer rounds, as batched point-to-point copies.

Each side holds SHARDS: per parameter, a local tensor and the region of the full tensor it covers
(a full copy is the shard whose region is the whole tensor). A bucket carries slices (regions of
parameters, in full-tensor coordinates, shifted by each side's shard offset) from a trainer rank to
a generator rank. Bytes on the wire are the sender's (`wire_dtype`); the receiver casts to its
shards' dtype, so a precision change happens on the receiving side.

A bucket goes as a few messages, cut the same way on both sides from the plan alone: a large
slice travels alone, straight from and into the shards where they are contiguous and of the wire
dtype (no staging copy, no staging memory); runs of small slices share one packed buffer. All of a
rank's messages of a round go out in one `batch_isend_irecv`; in a round no rank sends or receives
more than one bucket. Where trainer and generator share a rank, the part of the weights that stays on
it is copied shard to shard while the first round's messages are in flight (the plan gives the two
disjoint regions of the destination).

`execute_weight_sync` runs the stored plan (what `compiler/weight_sync.py:ddma_record` writes) on shards;
`run_weight_sync` is the executor's entry point for whole modules: full, FSDP2-sharded (DTensor) or
tensor-parallel generators (`tensor_parallel.py`), whose shards are the plan's regions.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from graphrl.errors import RunError
from graphrl.schemas.weightsync import WeightSyncRecord
from graphrl.executors.tensor_parallel import TensorParallelLlama

Region = tuple[tuple[int, int], ...]  # (start, stop) per dim, in full-tensor coordinates
ShardMap = Mapping[str, tuple[Tensor, Region]]  # param name -> (local tensor, region of the full tensor it holds)

# A slice of at least this many elements is a message of its own (direct when its shard allows);
# below it, per-message latency outweighs a staging copy, so neighbouring small slices are packed.
DIRECT_MIN_ELEMS = 1 << 16


def execute_weight_sync(
    data: WeightSyncRecord,
    rank: int,
    src_shards: ShardMap,
    dst_shards: ShardMap,
    comm_device: torch.device,
    device: torch.device,
    *,
    wire_dtype: torch.dtype,
) -> None:
    """This rank's part of every round of one stored weight sync (sender, receiver, or both).

    `src_shards` are the trainer shards this rank holds, `dst_shards` the generator shards it fills
    (either may be empty). `wire_dtype` is the senders' dtype, what crosses the link; every rank of
    the sync must pass the same one (a receiver cannot infer it). Buffers live on `comm_device`;
    received bytes are unpacked on `device`.
    """
    if data.rounds is None:
        raise RunError(f"the weight sync of {data.model} has {data.summary.num_buckets} buckets; its "
                       "rounds are not stored in the plan and this executor does not replan them",
                       fix="run this plan size on a cluster build, or compile a smaller job")
    src = _checked(src_shards, "source", rank)
    dst = _checked(dst_shards, "destination", rank)
    for name, (tensor, _) in src.items():
        if tensor.dtype != wire_dtype:
            raise RunError(f"rank {rank}: source shard {name} is {tensor.dtype}, but the wire dtype is {wire_dtype}",
                           fix="pass the senders' dtype as wire_dtype; the receiver casts")
    def copy_local() -> None:
        for owner, _, slices in data.local:
            if owner == rank:
                for name, region in slices:
                    _view(dst, name, region, rank, "destination").copy_(_view(src, name, region, rank, "source"))

    local_pending = True
    with torch.no_grad():
        for round_ in data.rounds:
            ops, unpacks = [], []
            for b_src, b_dst, _, slices in round_:
                if b_src == rank:
                    for message in _messages(slices):
                        views = [_view(src, name, region, rank, "source") for name, region in message]
                        ops.append(dist.P2POp(dist.isend, _pack(views, wire_dtype, comm_device), b_dst))
                if b_dst == rank:
                    for message in _messages(slices):
                        targets = [_view(dst, name, region, rank, "destination") for name, region in message]
                        buf = _direct(targets, wire_dtype, comm_device)
                        if buf is None:
                            buf = torch.empty(sum(t.numel() for t in targets), dtype=wire_dtype, device=comm_device)
                            unpacks.append((targets, buf))
                        ops.append(dist.P2POp(dist.irecv, buf, b_src))
            works = dist.batch_isend_irecv(ops) if ops else []
            if local_pending:  # the rank-local copies overlap the first round's transfers
                copy_local()
                local_pending = False
            for work in works:
                work.wait()
            for targets, buf in unpacks:
                _unpack(targets, buf.to(device))
        if local_pending:
            copy_local()


def run_weight_sync(data: WeightSyncRecord, rank: int, src: nn.Module | None, dst: nn.Module | None, rt: Any) -> None:
    """`execute_weight_sync` for whole modules, each side's shards as `module_shards` finds them (`rt`
    gives `comm_device` and `device`). The trainer and generator copies of a model share its dtype,
    so a pure receiver takes its own as the wire dtype. A tensor-parallel generator whose KV heads are
    replicated then completes them over its group."""
    src_shards, dst_shards = module_shards(src), module_shards(dst)
    held = next(iter(src_shards.values()), None) or next(iter(dst_shards.values()), None)
    execute_weight_sync(data, rank, src_shards, dst_shards, rt.comm_device, rt.device,
                        wire_dtype=held[0].dtype if held is not None else torch.float32)
    if isinstance(dst, TensorParallelLlama):
        dst.complete_kv_heads()


def module_shards(module: nn.Module | None) -> dict[str, tuple[Tensor, Region]]:
    """What a module holds of each full parameter: a tensor-parallel generator's shards (the plan's
    regions), a DTensor parameter's local piece (FSDP2) with the region DTensor says it covers, or a
    plain parameter whole."""
    if module is None:
        return {}
    if isinstance(module, TensorParallelLlama):
        return module.shards()
    out: dict[str, tuple[Tensor, Region]] = {}
    for name, p in _params(module).items():
        if isinstance(p, DTensor):
            local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            out[name] = (p.to_local(), tuple((o, o + n) for o, n in zip(offset, local_shape)))
        else:
            out[name] = (p, tuple((0, n) for n in p.shape))
    return out


def _params(module: nn.Module) -> dict[str, Tensor]:
    params = dict(module.named_parameters())
    if "lm_head.weight" not in params and "model.embed_tokens.weight" in params:
        params["lm_head.weight"] = params["model.embed_tokens.weight"]  # tied embeddings
    return params


def _checked(shards: ShardMap, side: str, rank: int) -> dict[str, tuple[Tensor, Region]]:
    """Shards as (detached tensor, tuple region), each tensor's shape the size of its region."""
    out = {}
    for name, (tensor, region) in shards.items():
        region = tuple((int(a), int(b)) for a, b in region)
        if tuple(tensor.shape) != tuple(b - a for a, b in region):
            raise RunError(f"rank {rank}: {side} shard {name} has shape {tuple(tensor.shape)}, "
                           f"but its region {region} has shape {tuple(b - a for a, b in region)}")
        out[name] = (tensor.detach(), region)
    return out


def _view(shards: dict[str, tuple[Tensor, Region]], name: str, region: list[list[int]], rank: int,
          side: str) -> Tensor:
    """`region` (full-tensor coordinates) of `name`, as a view into this rank's shard of it."""
    held = shards.get(name)
    if held is None:
        raise RunError(f"rank {rank}: the weight-sync plan needs {side} {name}{_fmt(region)}, but this rank holds "
                       f"no {side} shard of {name}")
    tensor, within = held
    if len(region) != len(within) or any(not (wa <= a <= b <= wb) for (a, b), (wa, wb) in zip(region, within)):
        raise RunError(f"rank {rank}: the weight-sync plan needs {side} {name}{_fmt(region)}, outside the "
                       f"shard {_fmt(within)} this rank holds",
                       fix="give each rank the shards of the layout the plan was compiled for")
    return tensor[tuple(slice(a - wa, b - wa) for (a, b), (wa, _) in zip(region, within))]


def _messages(slices: list) -> list[list]:
    """A bucket's slices cut into messages: each large slice alone, each run of small ones together."""
    messages: list[list] = []
    run: list = []
    for piece in slices:
        if _numel(piece[1]) < DIRECT_MIN_ELEMS:
            run.append(piece)
            continue
        if run:
            messages.append(run)
            run = []
        messages.append([piece])
    if run:
        messages.append(run)
    return messages


def _numel(region: list[list[int]]) -> int:
    n = 1
    for a, b in region:
        n *= b - a
    return n


def _fmt(region: Any) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"


def _direct(views: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor | None:
    """The bucket's one slice as a flat tensor sharing its shard's memory, when it can go on the wire as is."""
    if len(views) != 1:
        return None
    (v,) = views
    return v.view(-1) if v.is_contiguous() and v.dtype == dtype and v.device == device else None


def _pack(views: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    flat = _direct(views, dtype, device)
    if flat is not None:
        return flat
    flat = torch.empty(sum(v.numel() for v in views), dtype=dtype, device=device)
    offset = 0
    for v in views:
        n = v.numel()
        flat[offset:offset + n].view(v.shape).copy_(v)
        offset += n
    return flat


def _unpack(targets: list[Tensor], flat: Tensor) -> None:
    offset = 0
    for t in targets:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view(t.shape))  # casts to the shard's dtype
        offset += n
