"""Per-rank programs: ordered streams of small typed instructions with explicit operands.

Instructions are frozen, slotted pydantic dataclasses in strict mode: every field is typed and described
(`FIELD_DOCS`, the plan format's reference, also in `graphrl schema --plan`), construction validates in
pydantic's core (no slower than a plain frozen dataclass), and the simulator and executors walk them as
plain objects. On disk each is `[type name, field values...]` inside the plan's msgpack; decoding checks
the type name, the arity and every field's type, so a plan file is data, never code.

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
import functools
import operator
from collections.abc import Iterator
from dataclasses import fields
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Union, get_args

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from graphrl.schemas.weightsync import WeightSyncRecord

# What each instruction field means; one entry per field name, shared by every kind that has it (the plan
# format's reference: the pydantic field descriptions below, hence `graphrl schema --plan`, use these words).
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
    "src_role": "role the weights are copied from (the trainer)",
    "dst_role": "role the weights are copied into (the generator)",
}

_STRICT = ConfigDict(strict=True)
"""Instruction fields take exactly their type: no '3' for 3, no True for 1, no 3.0 for 3."""

Step = Annotated[int, Field(description=FIELD_DOCS["step"])]
Node = Annotated[str, Field(description=FIELD_DOCS["node"])]
Role = Annotated[str, Field(description=FIELD_DOCS["role"])]
Version = Annotated[int, Field(description=FIELD_DOCS["version"])]
Start = Annotated[int, Field(ge=0, description=FIELD_DOCS["start"])]
Stop = Annotated[int, Field(ge=0, description=FIELD_DOCS["stop"])]
Group = Annotated[str, Field(description=FIELD_DOCS["group"])]
What = Annotated[str, Field(description=FIELD_DOCS["what"])]
Peer = Annotated[int, Field(ge=0, description=FIELD_DOCS["peer"])]
NumBytes = Annotated[int, Field(ge=0, description=FIELD_DOCS["num_bytes"])]
Tag = Annotated[int, Field(description=FIELD_DOCS["tag"])]
State = Annotated[tuple[Literal["params", "grads", "optimizer"], ...], Field(description=FIELD_DOCS["state"])]
ModelName = Annotated[str, Field(description=FIELD_DOCS["model"])]
Transfer = Annotated[str, Field(description=FIELD_DOCS["transfer"])]
SrcRole = Annotated[str, Field(description=FIELD_DOCS["src_role"])]
DstRole = Annotated[str, Field(description=FIELD_DOCS["dst_role"])]


def instruction(cls: type) -> type:
    """An instruction kind: a frozen, slotted, strict pydantic dataclass."""
    return dataclass(frozen=True, slots=True, config=_STRICT)(cls)


@instruction
class Generate:
    """Sample responses [start, stop) of `step` with policy weights `version` on the generator."""

    step: Step
    node: Node
    role: Role
    version: Version
    start: Start
    stop: Stop
    group: Group
    kind: ClassVar[str] = "compute"


@instruction
class Logprob:
    """Forward pass of `role` over responses [start, stop): per-token log-probabilities."""

    step: Step
    node: Node
    role: Role
    start: Start
    stop: Stop
    group: Group
    kind: ClassVar[str] = "compute"


@instruction
class Value:
    """Forward pass of the critic `role` over responses [start, stop): per-token values."""

    step: Step
    node: Node
    role: Role
    start: Start
    stop: Stop
    group: Group
    kind: ClassVar[str] = "compute"


@instruction
class Reward:
    """Score responses [start, stop): the reward model `role`, or a rule function when `role` is ''."""

    step: Step
    node: Node
    role: Role
    start: Start
    stop: Stop
    group: Group
    kind: ClassVar[str] = "compute"


@instruction
class Advantage:
    """Advantages of responses [start, stop) from their rewards (and values)."""

    step: Step
    node: Node
    start: Start
    stop: Stop
    kind: ClassVar[str] = "compute"


@instruction
class TrainStep:
    """One optimizer update of `role` on responses [start, stop), producing weights `version` (step + 1)."""

    step: Step
    node: Node
    role: Role
    start: Start
    stop: Stop
    version: Version
    group: Group
    kind: ClassVar[str] = "compute"


@instruction
class Send:
    """Point-to-point: send `what` of responses [start, stop) to `peer`."""

    step: Step
    what: What
    start: Start
    stop: Stop
    peer: Peer
    num_bytes: NumBytes
    tag: Tag
    kind: ClassVar[str] = "p2p"


@instruction
class Recv:
    """Point-to-point: receive `what` of responses [start, stop) from `peer`."""

    step: Step
    what: What
    start: Start
    stop: Stop
    peer: Peer
    num_bytes: NumBytes
    tag: Tag
    kind: ClassVar[str] = "p2p"


@instruction
class Offload:
    """Move `state` of `role` from device to host memory."""

    role: Role
    state: State
    num_bytes: NumBytes
    kind: ClassVar[str] = "memory"


@instruction
class Onload:
    """Move `state` of `role` from host back to device memory."""

    role: Role
    state: State
    num_bytes: NumBytes
    kind: ClassVar[str] = "memory"


@instruction
class WeightSync:
    """DDMA: this rank's part of every transfer round that copies `model` version `version` from the
    trainer layout to the generator layout (`Programs.weight_syncs[transfer]` holds the rounds)."""

    model: ModelName
    version: Version
    transfer: Transfer
    src_role: SrcRole
    dst_role: DstRole
    group: Group
    kind: ClassVar[str] = "collective"


@instruction
class ReshardInPlace:
    """Colocated: fill the generator's weights from the trainer's shards on the same devices (a
    tensor-parallel generator's by the DDMA plan of `model` in `Programs.weight_syncs`)."""

    model: ModelName
    version: Version
    src_role: SrcRole
    dst_role: DstRole
    group: Group
    kind: ClassVar[str] = "collective"


@instruction
class ReleaseWeights:
    """Colocated: free the generator's gathered weights and KV cache after generation."""

    role: Role
    kind: ClassVar[str] = "memory"


@instruction
class Checkpoint:
    """Save the run's state after `step` (when `checkpoint_due` says so)."""

    step: Step
    group: Group
    kind: ClassVar[str] = "collective"


Instruction = Union[Generate, Logprob, Value, Reward, Advantage, TrainStep, Send, Recv, Offload, Onload,
                    WeightSync, ReshardInPlace, ReleaseWeights, Checkpoint]
INSTRUCTION_TYPES: dict[str, type] = {t.__name__: t for t in Instruction.__args__}  # type: ignore[attr-defined]
_NAMES: dict[type, tuple[str, ...]] = {t: tuple(f.name for f in fields(t)) for t in INSTRUCTION_TYPES.values()}
"""Each kind's field names, in order (the order of its values on disk)."""


Phase = Literal["generate", "logprob", "reward", "advantage", "train", "weight_sync", "transfer", "offload",
                "checkpoint", "other"]
PHASES: tuple[str, ...] = get_args(Phase)
"""The phases of an RL step, in the order the preview and the report list them (logprob: every forward
pass of a frozen model or a critic's values; transfer: rollouts between meshes; offload: moving idle state
off the device and back)."""


@dataclasses.dataclass(frozen=True)
class KindTraits:
    """What an instruction kind does that every reader of a program must agree on: the executors, the
    simulator and `verify` (their own parts of its meaning, its handler, duration and memory effect,
    live with each of them)."""

    weights: Literal["", "sets", "uses", "produces"] = ""
    """Its part in weight versions: sets the version a rank holds, uses it, or produces a new one."""
    p2p: Literal["", "send", "recv"] = ""
    """Its side of a point-to-point pair: a "send" meets the "recv" with the same tag, and each waits
    for the other."""
    moves: Literal[-1, 0, 1] = 0
    """-1 moves state off the device, +1 back onto it (a loop body's moves must cancel)."""
    rollout: bool = False
    """Makes or moves a step's rollouts (a resumed run skips those the checkpoint holds)."""
    phase: Phase = "other"
    """The phase of an RL step its time counts to, in the preview, the simulator's breakdown and the run
    report (predicted against measured)."""


TRAITS: dict[type, KindTraits] = {
    Generate: KindTraits(weights="uses", rollout=True, phase="generate"),
    Logprob: KindTraits(phase="logprob"),
    Value: KindTraits(phase="logprob"),
    Reward: KindTraits(phase="reward"),
    Advantage: KindTraits(phase="advantage"),
    TrainStep: KindTraits(weights="produces", phase="train"),
    Send: KindTraits(p2p="send", rollout=True, phase="transfer"),
    Recv: KindTraits(p2p="recv", rollout=True, phase="transfer"),
    Offload: KindTraits(moves=-1, phase="offload"),
    Onload: KindTraits(moves=1, phase="offload"),
    WeightSync: KindTraits(weights="sets", phase="weight_sync"),
    ReshardInPlace: KindTraits(weights="sets", phase="weight_sync"),
    ReleaseWeights: KindTraits(phase="offload"),
    Checkpoint: KindTraits(phase="checkpoint"),
}
"""Instruction kind -> its traits; one entry per kind (checked below)."""
assert set(TRAITS) == set(INSTRUCTION_TYPES.values()), "every instruction kind needs its traits"


def encode(ins: Instruction) -> list[Any]:
    out: list[Any] = [type(ins).__name__]
    for name in _NAMES[type(ins)]:
        value = getattr(ins, name)
        out.append(list(value) if isinstance(value, tuple) else value)
    return out


def decode(raw: Any) -> Instruction:
    """Rebuild an instruction from `[name, values...]`, checking name, arity and (through the kind's
    pydantic validator) every field's type and bounds."""
    if not isinstance(raw, (list, tuple)) or not raw or not isinstance(raw[0], str):
        raise ValueError(f"instruction {raw!r} is not [type, fields...]")
    cls = INSTRUCTION_TYPES.get(raw[0])
    if cls is None:
        raise ValueError(f"unknown instruction type {raw[0]!r}")
    names = _NAMES[cls]
    if len(raw) - 1 != len(names):
        raise ValueError(f"{raw[0]} takes {len(names)} fields, got {len(raw) - 1}")
    values = [tuple(v) if isinstance(v, list) else v for v in raw[1:]]  # msgpack has no tuples
    try:
        return cls(*values)
    except ValidationError as exc:
        first = exc.errors()[0]
        at = first["loc"][0]  # the position of the value among the kind's fields
        raise ValueError(f"{raw[0]}.{names[at]} = {values[at]!r} is not valid: {first['msg']}") from None


def describe(ins: Instruction) -> str:
    """One readable line, e.g. `Generate step=3 v=2 [0:64) policy/generate`."""
    name = type(ins).__name__
    parts = [name]
    for field_name in _NAMES[type(ins)]:
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

def _shift_spec(cls: type) -> tuple[Any, tuple[int, ...], int | None] | None:
    """How `shift` moves a kind: a getter of its values, the indices of step and version, that of the tag."""
    names = _NAMES[cls]
    moved = tuple(k for k, n in enumerate(names) if n in ("step", "version"))
    if not moved:
        return None
    return operator.attrgetter(*names), moved, names.index("tag") if "tag" in names else None


_SHIFT_SPECS = {cls: _shift_spec(cls) for cls in INSTRUCTION_TYPES.values()}


# Cached: expanding or folding programs shifts the equal instruction of every rank of a group (one
# `Generate` per generator replica rank, one `TrainStep` per trainer rank) by the same steps, and
# instructions are frozen values, so one shifted copy serves them all.
@functools.lru_cache(maxsize=1 << 16)
def shift(ins: Instruction, steps: int) -> Instruction:
    """`ins` moved `steps` steps later: its step, its weight version and its tag all advance together."""
    spec = _SHIFT_SPECS[type(ins)]
    if steps == 0 or spec is None:
        return ins
    values, moved, tag = spec
    out = list(values(ins))
    for k in moved:
        out[k] += steps
    if tag is not None:
        out[tag] += steps * TAG_STRIDE
    return type(ins)(*out)


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

    prologue: Annotated[list[Instruction], Field(description="Instructions before the loop, with absolute steps and versions.")]
    body: Annotated[list[Instruction], Field(description="One loop iteration: steps and versions are offsets from the loop counter k.")]
    epilogue: Annotated[list[Instruction], Field(description="Instructions after the loop: steps and versions are offsets from the run's step count.")]
    first: int = Field(default=0, ge=0, description="The loop's first k.")
    tail: int = Field(default=0, ge=0, description="Steps after the loop (the loop runs k in [first, steps - tail)).")

    def iterations(self, steps: int) -> range:
        return range(self.first, max(self.first, steps - self.tail))

    def instructions(self, steps: int, every: int = 0) -> Iterator[Instruction]:
        """The instructions this rank executes in a run of `steps` steps, in order."""
        def due(ins: Instruction) -> bool:
            return not isinstance(ins, Checkpoint) or checkpoint_due(ins.step, steps, every)

        for ins in self.prologue:
            if due(ins):
                yield ins
        # The body runs once per step (~10^5 instructions in a window of a large plan): which of its
        # instructions are checkpoints is found once, not at every iteration.
        checkpoints = [isinstance(ins, Checkpoint) for ins in self.body]
        for k in self.iterations(steps):
            for ins, checkpoint in zip(self.body, checkpoints):
                ins = shift(ins, k)
                if not checkpoint or checkpoint_due(ins.step, steps, every):  # type: ignore[attr-defined]
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


CostKind = Literal["Generate", "Logprob", "Value", "Reward", "Advantage", "TrainStep", "Send", "Recv", "Offload",
                   "Onload", "WeightSync", "ReshardInPlace", "ReleaseWeights", "Checkpoint", "Forward", "Rule"]
"""What a predicted duration is of: an instruction kind, 'Forward' (any role's forward pass: Logprob, Value
and model-based Reward share it) or 'Rule' (a rule-based reward)."""
COST_KINDS: frozenset[str] = frozenset(get_args(CostKind))


class CostKey(NamedTuple):
    """The key of a predicted duration in `Programs.durations`: the op kind and what it acts on.
    In a plan file it is written 'kind:subject' (or 'kind' alone), as `str()` gives."""

    kind: CostKind
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
        if kind not in COST_KINDS:
            raise ValueError(f"duration key {text!r}: unknown kind {kind!r} (known: {', '.join(sorted(COST_KINDS))})")
        return cls(kind, subject)  # type: ignore[arg-type]


@dataclass
class Programs:
    """Everything the executors run: one periodic program per rank, the named rank groups, the DDMA
    transfer plans, and the predicted duration of each instruction (for the simulator).

    The size of a `Programs` does not depend on `steps`: the body of each rank's loop is one step."""

    steps: Annotated[int, Field(ge=1, description="RL steps of the run.")]
    ranks: Annotated[list[RankProgram], Field(description="One periodic program per rank, by rank.")]
    groups: Annotated[dict[str, tuple[int, ...]], Field(description="Rank groups by name: the ranks that run a grouped instruction together.")]
    weight_syncs: Annotated[dict[str, WeightSyncRecord], Field(description="DDMA transfer plans by transfer id.")]
    durations: Annotated[dict[CostKey, float], Field(description="Predicted seconds by (kind, subject); what the simulator charges.")]
    checkpoint_every: int = Field(default=0, ge=0, description="Checkpoint after every this many steps (0: only after the last).")

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


def programs_json_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """JSON Schema of `Programs.to_data()` (the programs as a plan file stores them) and the `$defs` it
    refers to: each instruction kind is an array `[kind, field values...]` whose items carry the fields'
    types, bounds and descriptions, taken from the pydantic definitions above."""
    defs: dict[str, Any] = {}
    for name, cls in INSTRUCTION_TYPES.items():
        props = TypeAdapter(cls).json_schema()["properties"]
        items = [{"const": name, "description": "instruction kind"}] + [
            {**props[field], "title": field} for field in _NAMES[cls]]
        defs[name] = {"type": "array", "title": name, "description": _doc(cls),
                      "prefixItems": items, "items": False, "minItems": len(items)}
    defs["Instruction"] = {"anyOf": [{"$ref": f"#/$defs/{n}"} for n in INSTRUCTION_TYPES]}
    sync = TypeAdapter(WeightSyncRecord).json_schema(ref_template="#/$defs/{model}", mode="serialization")
    defs.update(sync.pop("$defs", {}))
    defs["WeightSyncRecord"] = sync

    stream = {"type": "array", "items": {"$ref": "#/$defs/Instruction"}}
    whole = {"type": "integer", "minimum": 0}
    defs["RankProgram"] = _record(RankProgram, {
        "first": whole, "tail": whole, "prologue": stream, "body": stream, "epilogue": stream})
    kinds = "|".join(sorted(COST_KINDS))
    schema = _record(Programs, {
        "steps": {"type": "integer", "minimum": 1},
        "checkpoint_every": whole,
        "ranks": {"type": "array", "items": {"$ref": "#/$defs/RankProgram"}},
        "groups": {"type": "object", "additionalProperties": {"type": "array", "items": whole}},
        "weight_syncs": {"type": "object", "additionalProperties": {"$ref": "#/$defs/WeightSyncRecord"}},
        "durations": {"type": "object", "additionalProperties": {"type": "number"},
                      "propertyNames": {"pattern": f"^({kinds})(:.*)?$"}},
    })
    return schema, defs


def _doc(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split())


def _record(cls: type, properties: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON Schema of a pydantic dataclass's data form: `properties` (every field, required), each
    with the field's description."""
    fields_ = cls.__pydantic_fields__  # type: ignore[attr-defined]
    return {"type": "object", "title": cls.__name__, "description": _doc(cls),
            "properties": {k: {**v, "description": fields_[k].description} for k, v in properties.items()},
            "required": list(properties), "additionalProperties": False}

