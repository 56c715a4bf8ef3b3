"""The offload stage: which state of which role leaves the device between its uses, and how many bytes.

A role whose placement offloads part of its state (weights, gradients, optimizer) is onloaded right
before its first instruction of a step and offloaded right after its last; the schedule stage places
those instructions, this stage only decides what moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from graphrl.schemas.plan import Layout



STATE_KINDS = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class RoleOffload:
    """What one role moves off the device between its uses."""

    state: tuple[str, ...]
    """State kinds that move, a subset of `STATE_KINDS`."""
    num_bytes: int
    """Bytes per device that move each way."""


@dataclass(frozen=True)
class OffloadPlan:
    """The offload stage's result: per role that offloads anything, what moves."""

    roles: Mapping[str, RoleOffload]


def plan_offload(layout: Layout) -> OffloadPlan:
    """The offloads the layout's placements ask for."""
    roles = {p.role: RoleOffload(tuple(p.offload), int(sum(getattr(p.memory_bytes, k) for k in p.offload)))
             for p in layout.placements if p.offload}
    return OffloadPlan(MappingProxyType(roles))


def check_offload(plan: OffloadPlan, layout: Layout) -> list[str]:
    """The stage's spec: only placed roles offload, only known state kinds, each at most once, and the
    bytes are what the cost model's memory accounting holds for those kinds."""
    placed = {p.role: p for p in layout.placements}
    problems = []
    for role, off in plan.roles.items():
        p = placed.get(role)
        if p is None:
            problems.append(f"role {role} offloads but is not placed")
            continue
        unknown = [s for s in off.state if s not in STATE_KINDS]
        if unknown or len(set(off.state)) != len(off.state) or not off.state:
            problems.append(f"role {role} offloads {off.state}: each of {STATE_KINDS} at most once, at least one")
            continue
        expected = int(sum(getattr(p.memory_bytes, k) for k in off.state))
        if off.num_bytes != expected:
            problems.append(f"role {role} offloads {off.num_bytes} bytes, its placement holds {expected} for {off.state}")
    return problems


__all__ = ["OffloadPlan", "RoleOffload", "STATE_KINDS", "check_offload", "plan_offload"]
