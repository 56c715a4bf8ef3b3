"""Clusters: how many nodes, how many devices each, and what kind of device.

A cluster lives in its own YAML file so that one job compiles for many clusters.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from graphrl.schemas.base import Frozen, Integer, Real
from graphrl.schemas.hardware import GiB, HARDWARE_PRESETS, HardwareSpec


class ClusterSpec(Frozen):
    """A homogeneous set of nodes with the same number of identical devices each."""

    name: str = Field(description="Name shown in plans.")
    num_nodes: Integer = Field(gt=0, description="Number of hosts.")
    devices_per_node: Integer = Field(gt=0, description="Devices (GPUs, or CPU ranks) per host.")
    hardware: str | HardwareSpec = Field(
        description=f"A hardware preset ({', '.join(HARDWARE_PRESETS)}) or an explicit description."
    )
    host_memory_bytes: Real = Field(
        default=2048 * GiB, gt=0, description="Host (CPU) memory per node, bytes; offloaded state lives here."
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        default="auto", description="torch.distributed backend; 'auto' picks NCCL for GPUs and gloo for CPUs."
    )

    @model_validator(mode="after")
    def _known_hardware(self) -> "ClusterSpec":
        if isinstance(self.hardware, str) and self.hardware not in HARDWARE_PRESETS:
            raise ValueError(
                f"unknown hardware preset {self.hardware!r}; known presets: {', '.join(HARDWARE_PRESETS)}"
            )
        return self

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node


CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    f"local-cpu-{n}": ClusterSpec(
        name=f"local-cpu-{n}", num_nodes=1, devices_per_node=n, hardware="cpu-local",
        host_memory_bytes=16 * GiB, backend="gloo",
    )
    for n in (1, 2, 4)
}
