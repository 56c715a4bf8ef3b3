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

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar, NamedTuple, Union

from pydantic import ValidationError

from graphrl.schemas.weightsync import WeightSyncRecord


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


# What each instruction field means; one entry per field name, shared by every kind that has it (the plan
# format's reference: `graphrl inspect` and the README's plan section use the same words).
FIELD_DOCS: dict[str, str] = {
    "step": "RL step the instruction belongs to (in a body: an offset from the loop counter)",
    "node": "the job graph node it executes",
    "role": "the role whose weights it uses or moves ('' for a rule-based reward)",
    "version": "policy weight version it uses (Generate), produces (TrainStep) or copies (syncs)",
    "start": "first response index of the batch slice it covers",
    "stop": "one past the last response index of that slice",
    "group": "the named rank group that runs it together (Programs.groups)",
    "what": "the data a point-to-point transfer carries ('rollouts')",
    "peer": "the rank on the other end of the transfer",
    "num_bytes": "bytes moved (transfer) or offloaded/onloaded (memory)",
    "tag": "message tag pairing this send with its receive",
    "state": "which of params, grads, optimizer it moves between device and host",
    "model": "the model whose weights are synced",
    "transfer": "the weight-sync plan's id in Programs.weight_syncs",
    "src_role": "role the weights are gathered from",
    "dst_role": "role the gathered weights are for",
}


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


TAG_STRIDE = 1_000_003
"""Tags of a step's point-to-point pairs lie in [step * TAG_STRIDE, (step + 1) * TAG_STRIDE)."""

_SHIFTED = ("step", "version")
_NAMES: dict[type, tuple[str, ...]] = {t: tuple(name for name, _ in spec) for t, spec in _FIELDS.items()}


def shift(ins: Instruction, steps: int) -> Instruction:
    """`ins` moved `steps` steps later: its step, its weight version and its tag all advance together."""
    if steps == 0:
        return ins
    cls = type(ins)
    names = _NAMES[cls]
    if "step" not in names and "version" not in names:
        return ins
    values = [getattr(ins, n) for n in names]
    for k, n in enumerate(names):
        if n in _SHIFTED:
            values[k] += steps
        elif n == "tag":
            values[k] += steps * TAG_STRIDE
    return cls(*values)


def checkpoint_due(step: int, steps: int, every: int) -> bool:
    """A run checkpoints after its last step and, with `every` > 0, after every `every`-th step."""
    return step == steps - 1 or (every > 0 and (step + 1) % every == 0)


@dataclass
class RankProgram:
    """One rank's program as a loop: a prologue, a body of one step run for k in [first, steps - tail),
    and an epilogue.

    - `prologue` instructions carry absolute steps and versions;
    - `body` instructions carry offsets from the loop counter k (`Generate step=0 v=-1` is step k with
      version k - 1), so iteration k executes `shift(ins, k)`;
    - `epilogue` instructions carry offsets from the run's step count (`step=-1` is the last step).
    Checkpoints stand in every iteration and run when `checkpoint_due` says so.
    """

    prologue: list[Instruction]
    body: list[Instruction]
    epilogue: list[Instruction]
    first: int = 0
    tail: int = 0

    def iterations(self, steps: int) -> range:
        return range(self.first, max(self.first, steps - self.tail))

    def instructions(self, steps: int, every: int = 0) -> Iterator[Instruction]:
        """The instructions this rank executes in a run of `steps` steps, in order."""
        def due(ins: Instruction) -> bool:
            return not isinstance(ins, Checkpoint) or checkpoint_due(ins.step, steps, every)

        for ins in self.prologue:
            if due(ins):
                yield ins
        for k in self.iterations(steps):
            for ins in self.body:
                ins = shift(ins, k)
                if due(ins):
                    yield ins
        for ins in self.epilogue:
            ins = shift(ins, steps)
            if due(ins):
                yield ins

    def step_view(self, steps: int, step: int, every: int = 0) -> list[tuple[str, Instruction]]:
        """What runs for step `step`, with where it comes from: the prologue's and epilogue's instructions
        of that step, and the whole body iteration k = `step` (absolute operands; checkpoints that are
        not due left out). Found without expanding the run."""
        def of_step(ins: Instruction) -> bool:
            return getattr(ins, "step", getattr(ins, "version", None)) == step

        def due(ins: Instruction) -> bool:
            return not isinstance(ins, Checkpoint) or checkpoint_due(ins.step, steps, every)

        out = [(f"prologue {i}", ins) for i, ins in enumerate(self.prologue) if of_step(ins) and due(ins)]
        if step in self.iterations(steps):
            out += [(f"body k={step} {j}", shift(ins, step)) for j, ins in enumerate(self.body)
                    if due(shift(ins, step))]
        moved = [shift(ins, steps) for ins in self.epilogue]
        out += [(f"epilogue {i}", ins) for i, ins in enumerate(moved) if of_step(ins) and due(ins)]
        return out

    def min_steps(self) -> int:
        """The shortest run this form describes: the prologue's and the epilogue's steps must not overlap."""
        return self.first + self.tail

    def __len__(self) -> int:
        return len(self.prologue) + len(self.body) + len(self.epilogue)


class CostKey(NamedTuple):
    """The key of a predicted duration in `Programs.durations`: the op kind and what it acts on.
    In a plan file it is written 'kind:subject' (or 'kind' alone), as `str()` gives."""

    kind: str
    """The op kind: an instruction type name, or 'Forward' for any role's forward pass and 'Rule'
    for a rule-based reward."""
    subject: str = ""
    """The role (TrainStep, Generate, Forward), the transfer (WeightSync) or the model
    (ReshardInPlace); empty for kinds with one duration per job."""

    def __str__(self) -> str:
        return f"{self.kind}:{self.subject}" if self.subject else self.kind

    @classmethod
    def parse(cls, text: str) -> "CostKey":
        """The key `str()` wrote; the subject may itself hold ':' (a transfer id)."""
        kind, _, subject = text.partition(":")
        return cls(kind, subject)


@dataclass
class Programs:
    """Everything the executors run: one periodic program per rank, the named rank groups, the DDMA
    transfer plans, and the predicted duration of each instruction (for the simulator).

    The size of a `Programs` does not depend on `steps`: the body of each rank's loop is one step."""

    steps: int
    ranks: list[RankProgram]
    groups: dict[str, tuple[int, ...]]
    weight_syncs: dict[str, WeightSyncRecord]  # transfer id -> the DDMA rounds
    durations: dict[CostKey, float]  # predicted seconds (read through graphrl.compiler.semantics)
    checkpoint_every: int = 0

    @classmethod
    def unrolled(cls, steps: int, streams: list[list[Instruction]], groups: dict[str, tuple[int, ...]],
                 weight_syncs: dict[str, WeightSyncRecord], durations: dict[CostKey, float], checkpoint_every: int = 0) -> "Programs":
        """A transcript: every rank's whole run in its prologue (short runs, references and tests)."""
        return cls(steps, [RankProgram(list(s), [], []) for s in streams], groups, weight_syncs, durations,
                   checkpoint_every)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_instructions(self) -> int:
        """Instructions stored in the plan (not executed: the body runs once per step)."""
        return sum(len(r) for r in self.ranks)

    def rank_stream(self, rank: int, steps: int | None = None) -> Iterator[Instruction]:
        return self.ranks[rank].instructions(self.steps if steps is None else steps, self.checkpoint_every)

    @property
    def streams(self) -> list[list[Instruction]]:
        """Every rank's instructions for the whole run, expanded (only for short runs)."""
        return [list(self.rank_stream(r)) for r in range(self.num_ranks)]

    def with_steps(self, steps: int) -> "Programs":
        """The same programs for a run of `steps` steps (a window for simulating and verifying)."""
        if steps < max((r.min_steps() for r in self.ranks), default=0):
            raise ValueError(f"these programs describe runs of at least "
                             f"{max(r.min_steps() for r in self.ranks)} steps, not {steps}")
        return dataclasses.replace(self, steps=steps)

    def window_steps(self, iterations: int) -> int:
        """Steps of a run that holds every prologue, `iterations` body iterations per rank and every
        epilogue (or the whole run when it is shorter)."""
        return min(self.steps, max((r.min_steps() for r in self.ranks), default=0) + iterations)

    def to_data(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "checkpoint_every": self.checkpoint_every,
            "ranks": [{"first": r.first, "tail": r.tail,
                       "prologue": [encode(i) for i in r.prologue], "body": [encode(i) for i in r.body],
                       "epilogue": [encode(i) for i in r.epilogue]} for r in self.ranks],
            "groups": {k: list(v) for k, v in self.groups.items()},
            "weight_syncs": {k: v.model_dump(mode="json") for k, v in self.weight_syncs.items()},
            "durations": {str(k): v for k, v in self.durations.items()},
        }

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> "Programs":
        ranks = []
        for r in data["ranks"]:
            first, tail = r["first"], r["tail"]
            if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (first, tail)):
                raise ValueError(f"rank loop bounds must be whole numbers >= 0, got first={first!r} tail={tail!r}")
            ranks.append(RankProgram([decode(i) for i in r["prologue"]], [decode(i) for i in r["body"]],
                                     [decode(i) for i in r["epilogue"]], first, tail))
        steps = data["steps"]
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps must be a whole number >= 1, got {steps!r}")
        return cls(
            steps=steps,
            ranks=ranks,
            groups={k: tuple(int(r) for r in v) for k, v in data["groups"].items()},
            weight_syncs={k: _weight_sync(k, v) for k, v in data["weight_syncs"].items()},
            durations={CostKey.parse(k): float(v) for k, v in data["durations"].items()},
            checkpoint_every=int(data["checkpoint_every"]),
        )


def _weight_sync(transfer: str, data: Any) -> WeightSyncRecord:
    """A stored weight sync, or a one-line error naming the transfer and the field."""
    try:
        return WeightSyncRecord.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise ValueError(f"weight sync {transfer!r}: {first['msg']} at {where}") from None
