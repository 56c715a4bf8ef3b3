"""Executing a DDMA weight sync: the plan's transfer rounds, as batched point-to-point copies.

Each bucket is one flat buffer from a trainer rank to a generator rank: the sender packs its slices
(regions of parameters, in full-tensor coordinates) in order, the receiver unpacks them into its
copy, casting to its own dtype (a precision change happens on the receiving side). All buckets of a
round go out together with `batch_isend_irecv`; in a round no rank sends or receives more than one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from graphrl.errors import RunError


def _region(param: Tensor, region: list[list[int]]) -> Tensor:
    return param[tuple(slice(a, b) for a, b in region)]


def _params(module: nn.Module | None) -> dict[str, Tensor]:
    if module is None:
        return {}
    params = dict(module.named_parameters())
    if "lm_head.weight" not in params and "model.embed_tokens.weight" in params:
        params["lm_head.weight"] = params["model.embed_tokens.weight"]  # tied embeddings
    return params


def _pack(params: dict[str, Tensor], slices: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    parts = [_region(params[name].detach(), region).reshape(-1).to(dtype) for name, region in slices]
    return torch.cat(parts).to(device) if parts else torch.empty(0, dtype=dtype, device=device)


def _unpack(params: dict[str, Tensor], slices: list, flat: Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for name, region in slices:
            target = _region(params[name], region)
            n = target.numel()
            target.copy_(flat[offset:offset + n].view(target.shape).to(target.dtype))
            offset += n


def run_weight_sync(data: dict[str, Any], rank: int, src: nn.Module | None, dst: nn.Module | None, rt: Any) -> None:
    """This rank's part of every round of one weight sync (sender, receiver, or both)."""
    if "rounds" not in data:
        raise RunError(f"the weight sync of {data.get('model')} has {data['summary']['num_buckets']} buckets; its "
                       "rounds are not stored in the plan and this executor does not replan them",
                       fix="run this plan size on a cluster build, or compile a smaller job")
    src_params, dst_params = _params(src), _params(dst)
    wire = next(iter(src_params.values())).dtype if src_params else next(iter(dst_params.values())).dtype
    for rank_, _, slices in data.get("local", []):
        if rank_ == rank and src_params and dst_params:
            with torch.no_grad():
                for name, region in slices:
                    _region(dst_params[name], region).copy_(_region(src_params[name], region))
    for round_ in data["rounds"]:
        ops, receives = [], []
        for b_src, b_dst, _, slices in round_:
            if b_src == rank:
                if not src_params:
                    raise RunError(f"rank {rank} must send weights but holds no trainer copy")
                ops.append(dist.P2POp(dist.isend, _pack(src_params, slices, wire, rt.comm_device), b_dst))
            if b_dst == rank:
                if not dst_params:
                    raise RunError(f"rank {rank} must receive weights but holds no generator copy")
                count = sum(_numel(region) for _, region in slices)
                buf = torch.empty(count, dtype=wire, device=rt.comm_device)
                ops.append(dist.P2POp(dist.irecv, buf, b_src))
                receives.append((slices, buf))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for slices, buf in receives:
            _unpack(dst_params, slices, buf.to(rt.device))


def _numel(region: list[list[int]]) -> int:
    n = 1
    for a, b in region:
        n *= b - a
    return n
