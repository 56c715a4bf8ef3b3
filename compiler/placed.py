"""`PlacedLayout`: the placement pass's result, one frozen typed record.

Later passes (offload, reshard, weight sync, schedule, lower, verify), `plan_of`, `graphrl simulate`
and the benchmarks read its fields, so a renamed or missing part of the result
fails where it is read. The search's own records (`Problem`, `Evaluated`) stay inside placement: what
the later passes need of them is here as the job's shape and each layout's predicted durations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.plan import CandidateSummary, Layout, LoraSummary
from graphrl.schemas.program import CostKey

from graphrl.compiler.roles import JobShape


@dataclass(frozen=True)
class Contender:
    """A candidate layout the pipeline may simulate before choosing, with its predicted durations."""

    layout: Layout
    durations: Mapping[CostKey, float]
    lora: LoraSummary | None = None
    """A LoRA job's costs on this layout beside the same job trained in full."""


@dataclass(frozen=True)
class PlacedLayout:
    """What placement decided, and what it hands the passes that build programs on it."""

    shape: JobShape
    """The job's roles and step sizes, the cluster's size and its device type."""
    ranking: Literal["analytical", "simulated"]
    """How the chosen candidate was ranked: the analytical estimate or simulated programs."""
    chosen: Layout
    """The chosen layout, as the plan records it."""
    durations: Mapping[CostKey, float]
    """Predicted seconds of each (instruction kind, role) on the chosen layout (weight syncs by DDMA
    excepted: the weight-sync pass times those)."""
    baseline: Layout | None
    """The colocated-synchronous baseline layout, when one exists."""
    baseline_durations: Mapping[CostKey, float] | None
    """Predicted seconds of each (instruction kind, role) on the baseline."""
    candidates_considered: int
    """Number of layouts the search evaluated."""
    candidates: tuple[CandidateSummary, ...]
    """Summaries of the best and the rejected candidates, best first."""
    lora: LoraSummary | None = None
    """A LoRA job's costs on the chosen layout beside the same job trained in full (`cost.lora_comparison`)."""
    contenders: tuple[Contender, ...] = ()
    """The analytically best candidates, best first, when the cluster is small enough to rank them by
    simulating their programs (the pipeline's `refine_placement`); empty otherwise."""

    @property
    def hardware(self) -> HardwareSpec:
        """The device type every mesh runs on."""
        return self.shape.hardware

    @property
    def usable_bytes(self) -> float:
        """Memory a device may fill (capacity less the reserve)."""
        return self.shape.usable_bytes

    @property
    def devices_per_node(self) -> int:
        """Devices that share one node's fast links."""
        return self.shape.devices_per_node

    def meshes(self) -> tuple[Mesh, Mesh | None]:
        """(the policy trainer's mesh, the generator's mesh or None) of the chosen layout."""
        return self.shape.policy_meshes(self.chosen)


__all__ = ["Contender", "PlacedLayout"]
