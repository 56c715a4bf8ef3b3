"""The compiler's state between passes: one frozen record with a typed field per stage's result.

A pass reads the fields it requires and returns a new record with the field it ensures filled in
(`dataclasses.replace`); a field is None until its pass has run. The type checker sees every read, so a
renamed or missing result fails where it is read, not as a missing string key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from graphrl.ir import JobGraph
from graphrl.schemas.job import JobSpec
from graphrl.schemas.program import Programs

from graphrl.compiler.offload import OffloadPlan
from graphrl.compiler.placed import PlacedLayout
from graphrl.compiler.reshard import ReshardPlan
from graphrl.compiler.schedule import ProgramSettings, Schedule
from graphrl.compiler.weight_sync import WeightSyncPlan

T = TypeVar("T")


@dataclass(frozen=True)
class Verified:
    """What `verify` proved: the programs run to the end, and the memory they reach."""

    peak_bytes: float
    """The most bytes any device holds at any instruction."""


@dataclass(frozen=True)
class Compilation:
    """The job graph and every pass's typed result so far."""

    graph: JobGraph
    """The job graph (type-checked: with its symbolic sizes)."""
    settings: ProgramSettings
    """What the programs are built for."""
    placement: PlacedLayout | None = None
    offload: OffloadPlan | None = None
    reshard: ReshardPlan | None = None
    weight_sync: WeightSyncPlan | None = None
    schedule: Schedule | None = None
    programs: Programs | None = None
    verified: Verified | None = None

    @property
    def job(self) -> JobSpec:
        return self.graph.job

    def has(self, fact: str) -> bool:
        """Whether the result named `fact` is there (`types`: the graph is type-checked)."""
        if fact == "types":
            return self.graph.sizes is not None
        return getattr(self, fact) is not None


def need(value: T | None, what: str) -> T:
    """`value`, which the pass's contract says is there (the runner checked its `requires`)."""
    if value is None:
        raise AssertionError(f"{what} is missing although the pass requires it")
    return value


__all__ = ["Compilation", "ProgramSettings", "Verified", "need"]
