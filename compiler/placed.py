"""`PlacedLayout`: the placement pass's result, one frozen typed record.

Later passes (schedule, verify), `plan_of`, `graphrl simulate` and the benchmarks read its fields
instead of string keys, so a renamed or missing part of the result fails where it is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from graphrl.ir import JobGraph
from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.plan import CandidateSummary, Layout
from graphrl.schemas.program import Programs

from graphrl.compiler.placement import Evaluated, Problem, policy_meshes
from graphrl.compiler.programs import build_programs


@dataclass(frozen=True)
class PlacedLayout:
    """What placement decided, and what it needs to hand the passes that build programs on it."""

    problem: Problem
    """The search problem: roles, workload, cluster, hardware, pins (private to the search)."""
    chosen_eval: Evaluated
    """The chosen candidate as the search evaluated it (the input of program building)."""
    baseline_eval: Evaluated | None
    """The colocated-synchronous baseline as evaluated, when one exists."""
    ranking: Literal["analytical", "simulated"]
    """How the chosen candidate was ranked: the analytical estimate or simulated programs."""
    chosen: Layout
    """The chosen layout, as the plan records it."""
    baseline: Layout | None
    """The baseline layout, as the plan records it."""
    candidates_considered: int
    """Number of layouts the search evaluated."""
    candidates: tuple[CandidateSummary, ...]
    """Summaries of the best and the rejected candidates, best first."""

    @property
    def hardware(self) -> HardwareSpec:
        """The device type every mesh runs on."""
        return self.problem.hw

    @property
    def usable_bytes(self) -> float:
        """Memory a device may fill (capacity less the reserve)."""
        return self.problem.usable

    @property
    def devices_per_node(self) -> int:
        """Devices that share one node's fast links."""
        return self.problem.per_node

    def meshes(self) -> tuple[Mesh, Mesh | None]:
        """(the policy trainer's mesh, the generator's mesh or None) of the chosen layout."""
        return policy_meshes(self.problem, self.chosen)

    def programs(self, graph: JobGraph, *, baseline: bool = False, steps: int, mode: str | None = None,
                 checkpoint_every: int | None = None, periodic: bool = True) -> Programs:
        """The job's programs on the chosen layout (or on the baseline): `build_programs` on this record."""
        ev, layout = (self.baseline_eval, self.baseline) if baseline else (self.chosen_eval, self.chosen)
        assert ev is not None and layout is not None, "no baseline layout for this job"
        return build_programs(graph, self.problem, ev, layout, steps=steps, mode=mode,
                              checkpoint_every=checkpoint_every, periodic=periodic)


__all__ = ["PlacedLayout"]
