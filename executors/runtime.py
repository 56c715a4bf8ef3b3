"""What a rank needs from torch.distributed: device and backend choice, process groups, point-to-point,
gradient averaging, state movement to host, and instruction-level profiling spans.

Device-agnostic: CUDA + NCCL when the rank has a GPU, CPU + gloo otherwise. Point-to-point on NCCL
needs device tensors and on gloo CPU tensors; `comm_device` is where buffers must live.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


def collective_timeout_s() -> float:
    """Seconds a collective waits for its peers before it fails (`GRAPHRL_COLLECTIVE_TIMEOUT_S`, default 60):
    a peer that dies must not leave the others blocked for gloo's default 30 minutes. Read when a group is
    made, not at import: a rank forked from a server that imported this module earlier sees its own run's
    setting."""
    return float(os.environ.get("GRAPHRL_COLLECTIVE_TIMEOUT_S", "60"))


def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("run.device is 'cuda' but no CUDA device is available")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


class Runtime:
    """One rank's view of the job's process groups and devices."""

    def __init__(self, rank: int, world_size: int, device: torch.device, groups: dict[str, tuple[int, ...]]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.comm_device = device if self.backend == "nccl" else torch.device("cpu")
        self._groups: dict[str, Any] = {}
        if world_size > 1:
            # Every rank must create every group, in the same order.
            for name in sorted(groups):
                members = list(groups[name])
                if len(members) > 1:
                    group = dist.new_group(members, timeout=timedelta(seconds=collective_timeout_s()))
                    if rank in members:
                        self._groups[name] = group

    @classmethod
    def init(cls, rank: int, world_size: int, device_pref: str, groups: dict[str, tuple[int, ...]],
             local_rank: int | None = None) -> "Runtime":
        device = pick_device(device_pref, rank if local_rank is None else local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=collective_timeout_s()))
        return cls(rank, world_size, device, groups)

    def group(self, name: str) -> Any:
        """The process group `name` if this rank is in it and it has more than one member, else None."""
        return self._groups.get(name)

    # -- point to point ----------------------------------------------------------------------------
    def send(self, tensor: Tensor, peer: int) -> None:
        dist.send(tensor.to(self.comm_device).contiguous(), peer)

    def recv(self, buffer: Tensor, peer: int) -> None:
        dist.recv(buffer, peer)

    # -- training ----------------------------------------------------------------------------------
    def move_state(self, role: Any, state: tuple[str, ...], *, to_host: bool) -> None:
        """Offload (to_host) or onload a role's weights, gradients or optimizer state.

        On CUDA this moves tensors to pinned host memory and back; on a CPU rank host and device are the
        same memory, so only the bookkeeping changes (the ledger still follows the plan)."""
        if self.device.type != "cuda":
            return
        target = torch.device("cpu") if to_host else self.device

        def move(t: Tensor) -> Tensor:
            if to_host:
                return t.to("cpu", non_blocking=True).pin_memory() if t.device.type == "cuda" else t
            return t.to(target, non_blocking=True)

        if "params" in state:
            for p in role.module.parameters():
                p.data = move(p.data)
        if "grads" in state:
            for p in role.module.parameters():
                if p.grad is not None:
                    p.grad = move(p.grad)
        if "optimizer" in state and role.optimizer is not None:
            for st in getattr(role.optimizer, "optim", role.optimizer).state.values():  # ZeRO-1: this rank's share
                for k, v in st.items():
                    if isinstance(v, Tensor) and v.dim() > 0:
                        st[k] = move(v)
        torch.cuda.synchronize(self.device)

    def device_bytes(self, modules: list[nn.Module], optimizers: list[Any]) -> int:
        """Bytes of parameters (with the buffers that belong to them: an fp8 layer's scales), gradients
        and optimizer state this rank holds on its device (the local shard of a sharded tensor)."""

        def local_bytes(t: Tensor) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size() if t.device == self.device else 0

        total = 0
        for m in modules:
            for p in m.parameters():
                total += local_bytes(p.data if not hasattr(p, "to_local") else p)
                if p.grad is not None:
                    total += local_bytes(p.grad)
            for b in m.buffers():
                total += local_bytes(b)
        for opt in optimizers:
            # ZeRO-1's ZeroRedundancyOptimizer keeps this rank's share of the state in its inner optimizer.
            opt = getattr(opt, "optim", opt)
            for st in opt.state.values():
                for v in st.values():
                    if isinstance(v, Tensor) and v.dim() > 0:
                        total += local_bytes(v)
        return total
