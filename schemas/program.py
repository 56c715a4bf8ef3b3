"""Per-rank programs: ordered streams of small typed instructions with explicit operands.

Instructions are frozen, slotted dataclasses rather than pydantic models: a 405B plan on 1024 ranks has
hundreds of thousands of them, and the simulator and executors walk them in tight loops. On disk each
is `[type name, field values...]` inside the plan's msgpack; decoding checks the type name, the arity
and every field's type, so a plan file is data, never code.

Operand conventions:
- `step` is the RL step; responses of a step are numbered 0..N-1 and `start:stop` is a range of them.
- `version` is a weight version: version k = the weights after k optimizer steps.
- `group` names a set of ranks (see `Programs.groups`) that execute the instruction together (a
  collective such as an FSDP train step, or a DDMA weight sync); a rank blocks until the whole group
  arrives.
- `peer` is the other rank of a point-to-point `Send`/`Recv`; both carry the same `tag`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union


@dataclass(frozen=True, slots=True)
class Generate:
    step: int
    node: str
    role: str
    version: int
    start: int
    stop: int
    group: str
    kind: ClassVar[str] = "compute"


@dataclass(frozen=True, slots=True)
class Logprob:
    step: int
    node: str
    role: str
    start: int
    stop: int
    group: str
    kind: ClassVar[str] = "compute"


@dataclass(frozen=True, slots=True)
class Value:
    step: int
    node: str
    role: str
    start: int
    stop: int
    group: str
    kind: ClassVar[str] = "compute"


@dataclass(frozen=True, slots=True)
class Reward:
    step: int
    node: str
    role: str  # the reward model's role, or "" for a rule function
    start: int
    stop: int
    group: str
    kind: ClassVar[str] = "compute"


@dataclass(frozen=True, slots=True)
class Advantage:
    step: int
    node: str
    start: int
    stop: int
    kind: ClassVar[str] = "compute"


@dataclass(frozen=True, slots=True)
class TrainStep:
    step: int
    node: str
    role: str
    start: int
    stop: int
    version: int  # the version this update produces (step + 1)
    group: str
    kind: ClassVar[str] = "compute"


@dataclass(frozen=True, slots=True)
class Send:
    step: int
    what: str
    start: int
    stop: int
    peer: int
    num_bytes: int
    tag: int
    kind: ClassVar[str] = "p2p"


@dataclass(frozen=True, slots=True)
class Recv:
    step: int
    what: str
    start: int
    stop: int
    peer: int
    num_bytes: int
    tag: int
    kind: ClassVar[str] = "p2p"


@dataclass(frozen=True, slots=True)
class Offload:
    role: str
    state: tuple[str, ...]  # "params", "grads", "optimizer"
    num_bytes: int
    kind: ClassVar[str] = "memory"


@dataclass(frozen=True, slots=True)
class Onload:
    role: str
    state: tuple[str, ...]
    num_bytes: int
    kind: ClassVar[str] = "memory"


@dataclass(frozen=True, slots=True)
class WeightSync:
    """DDMA: this rank's part of every transfer round that copies `model` version `version` from the
    trainer layout to the generator layout (`Programs.weight_syncs[transfer]` holds the rounds)."""

    model: str
    version: int
    transfer: str
    group: str
    kind: ClassVar[str] = "collective"


@dataclass(frozen=True, slots=True)
class ReshardInPlace:
    """Colocated: gather the generator's tensor-parallel weights from the trainer's shards on the same devices."""

    model: str
    version: int
    src_role: str
    dst_role: str
    group: str
    kind: ClassVar[str] = "collective"


@dataclass(frozen=True, slots=True)
class ReleaseWeights:
    """Colocated: free the generator's gathered weights and KV cache after generation."""

    role: str
    kind: ClassVar[str] = "memory"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    group: str
    kind: ClassVar[str] = "collective"


Instruction = Union[Generate, Logprob, Value, Reward, Advantage, TrainStep, Send, Recv, Offload, Onload,
                    WeightSync, ReshardInPlace, ReleaseWeights, Checkpoint]
INSTRUCTION_TYPES: dict[str, type] = {t.__name__: t for t in Instruction.__args__}  # type: ignore[attr-defined]
_FIELDS: dict[type, tuple[tuple[str, type | str], ...]] = {
    t: tuple((f.name, f.type) for f in fields(t)) for t in INSTRUCTION_TYPES.values()
}


def encode(ins: Instruction) -> list[Any]:
    out: list[Any] = [type(ins).__name__]
    for name, _ in _FIELDS[type(ins)]:
        value = getattr(ins, name)
        out.append(list(value) if isinstance(value, tuple) else value)
    return out


def decode(raw: Any) -> Instruction:
    """Rebuild an instruction from `[name, values...]`, checking name, arity and field types."""
    if not isinstance(raw, (list, tuple)) or not raw or not isinstance(raw[0], str):
        raise ValueError(f"instruction {raw!r} is not [type, fields...]")
    cls = INSTRUCTION_TYPES.get(raw[0])
    if cls is None:
        raise ValueError(f"unknown instruction type {raw[0]!r}")
    spec = _FIELDS[cls]
    if len(raw) - 1 != len(spec):
        raise ValueError(f"{raw[0]} takes {len(spec)} fields, got {len(raw) - 1}")
    values = []
    for (name, typ), value in zip(spec, raw[1:]):
        if typ in ("int", int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif typ in ("str", str):
            ok = isinstance(value, str)
        else:  # tuple[str, ...]
            ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
            value = tuple(value) if ok else value
        if not ok:
            raise ValueError(f"{raw[0]}.{name} has a value of the wrong type: {value!r}")
        values.append(value)
    return cls(*values)


def describe(ins: Instruction) -> str:
    """One readable line, e.g. `Generate step=3 v=2 [0:64) policy/generate`."""
    name = type(ins).__name__
    parts = [name]
    for field_name, _ in _FIELDS[type(ins)]:
        value = getattr(ins, field_name)
        if field_name == "version":
            parts.append(f"v={value}")
        elif field_name in ("start", "stop", "node", "group", "tag"):
            continue
        elif isinstance(value, tuple):
            parts.append(f"{field_name}={','.join(value)}")
        else:
            parts.append(f"{field_name}={value}")
    if hasattr(ins, "start"):
        parts.append(f"[{ins.start}:{ins.stop})")  # type: ignore[attr-defined]
    return " ".join(parts)


def label(ins: Instruction) -> str:
    """Short label for profiles and traces: `Generate step=3 v=2`, `WeightSync v=4`."""
    name = type(ins).__name__
    bits = [name]
    step = getattr(ins, "step", None)
    if step is not None:
        bits.append(f"step={step}")
    version = getattr(ins, "version", None)
    if version is not None:
        bits.append(f"v={version}")
    peer = getattr(ins, "peer", None)
    if peer is not None:
        bits.append(f"peer={peer}")
    return " ".join(bits)


@dataclass
class Programs:
    """Everything the executors run: one instruction stream per rank, the named rank groups, the DDMA
    transfer plans, and the predicted duration of each instruction (for the simulator)."""

    steps: int
    streams: list[list[Instruction]]
    groups: dict[str, tuple[int, ...]]
    weight_syncs: dict[str, Any]  # transfer id -> WeightSyncPlan summary (json-able)
    durations: dict[str, float]  # cost key -> predicted seconds (see graphrl.compiler.schedule.cost_key)

    @property
    def num_ranks(self) -> int:
        return len(self.streams)

    def to_data(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "streams": [[encode(i) for i in stream] for stream in self.streams],
            "groups": {k: list(v) for k, v in self.groups.items()},
            "weight_syncs": self.weight_syncs,
            "durations": self.durations,
        }

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> "Programs":
        return cls(
            steps=int(data["steps"]),
            streams=[[decode(i) for i in stream] for stream in data["streams"]],
            groups={k: tuple(int(r) for r in v) for k, v in data["groups"].items()},
            weight_syncs=dict(data["weight_syncs"]),
            durations={k: float(v) for k, v in data["durations"].items()},
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Programs):
            return NotImplemented
        return (self.steps, self.streams, self.groups, self.weight_syncs, self.durations) == (
            other.steps, other.streams, other.groups, other.weight_syncs, other.durations)
