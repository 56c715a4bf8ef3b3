"""What each instruction kind means to the compiler, in one table: to the simulator and `verify`.

Every kind of `graphrl.schemas.program` has one `Semantics` entry here:
- the simulator times it with its entry's `duration` and lets it meet the peer kind its traits name
  (`TRAITS[kind].p2p`: a send meets the receive with its tag), or its group when it names one;
- `verify` applies its entry's `memory` effect to a rank's ledger and follows its traits' `weights`
  part (which instruction sets the weight version a rank holds, which uses it, which produces one).

What every reader of a program must agree on (weights, p2p, moves, rollout) is `schemas.program.TRAITS`,
read by the executors too; the executors' handlers are their own table (`HANDLERS` in the executor).
Adding an instruction kind is its dataclass and traits in `schemas/program.py`, its entry below and its
handler; `tests/unit/test_semantics.py` refuses a kind that lacks any of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from graphrl.errors import VerifyError
from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.plan import RolePlacement
from graphrl.schemas.program import (
    INSTRUCTION_TYPES,
    Advantage,
    Checkpoint,
    CostKey,
    Generate,
    Instruction,
    Logprob,
    Offload,
    Onload,
    Recv,
    ReleaseWeights,
    ReshardInPlace,
    Reward,
    Send,
    TrainStep,
    Value,
    WeightSync,
    describe,
)

STATE = ("params", "grads", "optimizer")


@dataclass
class Ledger:
    """One rank's device memory as `verify` accounts it: per role, the bytes of each kind of state it
    keeps on the device (`resident`), and their sum (`held`)."""

    placements: Mapping[str, RolePlacement]
    resident: dict[str, dict[str, float]] = field(default_factory=dict)
    held: float = 0.0
    at: tuple[int, int, Instruction | None] = (0, 0, None)  # (rank, index, instruction) being applied

    @property
    def where(self) -> str:
        rank, index, ins = self.at
        return f"rank {rank} instruction {index} ({describe(ins) if ins is not None else '?'})"

    def keep(self, role: str, kinds: tuple[str, ...]) -> None:
        """`role` holds exactly `kinds` of its state from now on."""
        bytes_ = self.placements[role].memory_bytes
        self.held -= sum(self.resident.get(role, {}).values())
        self.resident[role] = {k: getattr(bytes_, k) for k in kinds}
        self.held += sum(self.resident[role].values())

    def drop(self, role: str, kinds: tuple[str, ...]) -> None:
        state = self.resident.get(role, {})
        self.held -= sum(state.pop(k, 0.0) for k in kinds)

    def load(self, role: str, kinds: tuple[str, ...]) -> None:
        state = self.resident.setdefault(role, {})
        bytes_ = self.placements[role].memory_bytes
        for k in kinds:
            self.held += getattr(bytes_, k) - state.get(k, 0.0)
            state[k] = getattr(bytes_, k)

    def run(self, role: str, needs: tuple[str, ...]) -> float:
        """`role` computes: the state it `needs` must be on the device; its activations and KV cache are
        the transient bytes of the instruction."""
        bytes_ = self.placements[role].memory_bytes
        state = self.resident.get(role, {})
        missing = [k for k in needs if getattr(bytes_, k) > 0 and k not in state]
        if missing:
            raise VerifyError(f"{self.where}: {role}'s {', '.join(missing)} are not on the device "
                              "(offloaded and never onloaded)")
        return bytes_.activations + bytes_.kv_cache


@dataclass(frozen=True)
class Costs:
    """What durations are read from: the plan's predicted seconds per `CostKey`, and the hardware."""

    durations: Mapping[CostKey, float]
    hw: HardwareSpec | None = None

    def of(self, key: CostKey) -> float:
        value = self.durations.get(key)
        if value is None:
            raise VerifyError(f"no predicted duration for {key}", fix="this is a compiler bug; please report it")
        return value

    def host_link(self, num_bytes: int) -> float:
        if self.hw is None:
            raise VerifyError("timing an offload needs the hardware's host link bandwidth")
        return num_bytes / self.hw.host_link_bandwidth


def _no_memory(ins: Instruction, ledger: Ledger) -> float:
    return 0.0


def _compute_memory(needs: tuple[str, ...]) -> Callable[[Instruction, Ledger], float]:
    def effect(ins: Instruction, ledger: Ledger) -> float:
        role = ins.role  # type: ignore[union-attr]
        return ledger.run(role, needs) if role else 0.0
    return effect


def _by_kind(ins: Instruction, costs: Costs) -> float:
    return costs.of(CostKey(type(ins).__name__))


def _forward(ins: Instruction, costs: Costs) -> float:
    role = ins.role  # type: ignore[union-attr]
    return costs.of(CostKey("Forward", role) if role else CostKey("Rule"))


def _of_role(ins: Instruction, costs: Costs) -> float:
    return costs.of(CostKey(type(ins).__name__, ins.role))  # type: ignore[union-attr]


def _not_timed_here(ins: Instruction, costs: Costs) -> float:
    raise VerifyError(f"{type(ins).__name__} is a point-to-point transfer: the simulator times it by the links it uses")


@dataclass(frozen=True)
class Semantics:
    """One instruction kind's meaning to the compiler (its traits, shared with the executors, are
    `schemas.program.TRAITS`)."""

    duration: Callable[[Instruction, Costs], float]
    """Its predicted seconds, for the simulator."""
    gantt: str
    """Its letter in the simulator's text Gantt chart."""
    memory: Callable[[Instruction, Ledger], float] = _no_memory
    """Its effect on the rank's memory ledger; returns the transient bytes while it runs."""


SEMANTICS: dict[type, Semantics] = {
    Generate: Semantics(_of_role, "G", _compute_memory(("params",))),
    Logprob: Semantics(_forward, "F", _compute_memory(("params",))),
    Value: Semantics(_forward, "F", _compute_memory(("params",))),
    Reward: Semantics(_forward, "R", _compute_memory(("params",))),
    Advantage: Semantics(_by_kind, "a"),
    TrainStep: Semantics(_of_role, "T", _compute_memory(STATE)),
    Send: Semantics(_not_timed_here, ">"),
    Recv: Semantics(_not_timed_here, "<"),
    Offload: Semantics(lambda ins, c: c.host_link(ins.num_bytes), "o",  # type: ignore[union-attr]
                       lambda ins, ledger: ledger.drop(ins.role, ins.state) or 0.0),  # type: ignore[union-attr]
    Onload: Semantics(lambda ins, c: c.host_link(ins.num_bytes), "o",  # type: ignore[union-attr]
                      lambda ins, ledger: ledger.load(ins.role, ins.state) or 0.0),  # type: ignore[union-attr]
    WeightSync: Semantics(lambda ins, c: c.of(CostKey("WeightSync", ins.transfer)), "S"),  # type: ignore[union-attr]
    ReshardInPlace: Semantics(lambda ins, c: c.of(CostKey("ReshardInPlace", ins.model)), "S",  # type: ignore[union-attr]
                              lambda ins, ledger: ledger.keep(ins.dst_role, ("params",)) or 0.0),  # type: ignore[union-attr]
    ReleaseWeights: Semantics(_by_kind, ".", lambda ins, ledger: ledger.keep(ins.role, ()) or 0.0),  # type: ignore[union-attr]
    Checkpoint: Semantics(_by_kind, "C"),
}
"""Instruction kind -> its meaning."""

BY_NAME: dict[str, Semantics] = {cls.__name__: s for cls, s in SEMANTICS.items()}

_missing = set(INSTRUCTION_TYPES.values()) - set(SEMANTICS)
assert not _missing, f"instruction kinds without semantics: {sorted(t.__name__ for t in _missing)}"


def semantics(ins: Instruction) -> Semantics:
    return SEMANTICS[type(ins)]


__all__ = ["BY_NAME", "Costs", "Ledger", "SEMANTICS", "STATE", "Semantics", "semantics"]
