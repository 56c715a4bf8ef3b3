"""Training parallelism as the plan says: torch's FSDP2 (`fully_shard`) or DDP over the trainer's ranks.

The RL losses need per-token log-probabilities (or values) of the response positions only, computed
through the model's trunk; DDP and FSDP2 hook a module's `forward`, so the trainable module handed to
them is a thin adapter whose forward is exactly that computation. Its parameters are the model's.

- `sharding: fsdp` with more than one data-parallel rank: every decoder layer and then the adapter
  are `fully_shard`ed on a device mesh made from the trainer's process group (parameters become
  DTensors sharded on dim 0; gathered layer by layer in forward and backward).
- `none`, `zero1`, `zero2`: DDP over the trainer's group (bucketed gradient all-reduce overlapped with
  backward). The ZeRO variants' optimizer-state sharding is a memory-accounting choice of the plan;
  this executor keeps the optimizer state replicated.
- one data-parallel rank: the adapter as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from graphrl.executors.models.llama import LlamaCritic, token_logprobs_and_entropy, token_values


class PolicyForward(nn.Module):
    """forward(prompt_ids, prompt_mask, response_ids, response_mask) -> (logprobs, entropy) [B, R]."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor,
                response_mask: Tensor) -> tuple[Tensor, Tensor]:
        return token_logprobs_and_entropy(self.model, prompt_ids, prompt_mask, response_ids, response_mask)


class CriticForward(nn.Module):
    """forward(prompt_ids, prompt_mask, response_ids, response_mask) -> values [B, R]."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor) -> Tensor:
        return token_values(self.model, prompt_ids, prompt_mask, response_ids, response_mask)


def wrap_trainer(model: nn.Module, sharding: str, group: Any, device: torch.device) -> tuple[nn.Module, str]:
    """The trainable module for `model` and the name of the wrapping used ('fsdp2', 'ddp' or 'local')."""
    adapter: nn.Module = CriticForward(model) if isinstance(model, LlamaCritic) else PolicyForward(model)
    if group is None:
        return adapter, "local"
    if sharding == "fsdp":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, device.type)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(adapter, mesh=mesh)
        return adapter, "fsdp2"
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(adapter, process_group=group, device_ids=device_ids), "ddp"


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Unsharded weights (a collective over the shard group when the model is FSDP2-sharded)."""
    out = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        out[name] = full.detach()
    return out
