"""The schedule stage: the order of every rank's instructions, step by step.

`sync` gives generate(i) version i. `async` with staleness s gives generate(i) version max(0, i - s):
the newest version that is ready without waiting when generation runs s steps ahead of training. The
trainer receives every batch that the generator sends before a weight sync ahead of that sync, so
programs never wait on each other in a cycle. Roles that offload are onloaded right before their first
instruction of a step and offloaded right after their last; every step ends with a checkpoint
instruction, which runs when `checkpoint_due` says so (so the schedule's period stays one step
whatever `checkpoint_every` is).

The stage writes the run out for a few short lengths (`Schedule.transcripts`); the lower stage folds
them into a loop. A run shorter than the warm-up, or one asked for unrolled, is written out whole.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from graphrl.ir import JobGraph, OpNode
from graphrl.schemas.job import JobSpec, ScheduleMode
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.plan import Layout
from graphrl.schemas.program import (
    Advantage,
    Checkpoint,
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
    TAG_STRIDE,
    TrainStep,
    Value,
    WeightSync,
)

from graphrl.compiler.offload import OffloadPlan
from graphrl.compiler.roles import JobShape, effective_mode, lora_bases
from graphrl.compiler.reshard import ReshardPlan, split_range
from graphrl.compiler.weight_sync import WeightSyncPlan


Streams = tuple[tuple[Instruction, ...], ...]


def version_for(step: int, mode: str, staleness: int) -> int:
    return step if mode == "sync" else max(0, step - staleness)


def fold_length(staleness: int) -> int:
    """Steps of the short transcripts the periodic form is folded from: enough for the warm-up (the
    generator runs `staleness` steps ahead), two steady-state steps, and the drain."""
    return 2 * staleness + 6


@dataclass(frozen=True)
class Schedule:
    """The schedule stage's result."""

    steps: int
    """The run's length."""
    mode: str
    """`sync` or `async`."""
    staleness: int
    """The most versions a rollout's weights may lag (async)."""
    checkpoint_every: int
    """Steps between checkpoints (0: none)."""
    groups: Mapping[str, tuple[int, ...]]
    """Named rank groups the instructions run on (`all`, `trainer`, `gen.j`, `sync`)."""
    transcripts: Mapping[int, Streams]
    """Per run length written out: every rank's instructions, in order."""
    fold_from: int | None
    """The shortest length the loop is folded from (lengths `fold_from` .. `fold_from + 2` are written
    out); None: `transcripts[steps]` is the whole run."""


@dataclass(frozen=True)
class ProgramSettings:
    """What a run's programs are built for, besides the layout: the job's schedule section by default;
    the simulated ranking and `graphrl simulate` build other lengths and modes from the same passes."""

    steps: int
    """Steps of the run."""
    mode: ScheduleMode | None = None
    """The schedule's mode; None: the job's (`effective_mode` on the layout)."""
    checkpoint_every: int | None = None
    """Steps between checkpoints; None: the job's."""
    periodic: bool = True
    """One loop per rank; False unrolls the whole run (the reference the loop is checked against)."""
    stored: bool = True
    """Programs a plan stores for its ranks; False for programs only simulated (the ranking, the baseline),
    which need no DDMA plan of a colocated reshard (its time is the layout's own)."""

    @classmethod
    def of(cls, job: JobSpec) -> "ProgramSettings":
        return cls(steps=job.schedule.steps)


def build_schedule(graph: JobGraph, shape: JobShape, layout: Layout, offload: OffloadPlan, reshard: ReshardPlan,
                   sync: WeightSyncPlan, settings: ProgramSettings) -> Schedule:
    """The schedule of the job's stages on `layout` for the run `settings` describes."""
    job = graph.job
    mode = settings.mode or effective_mode(job.schedule.mode, layout.strategy)
    staleness = job.schedule.max_staleness
    every = job.schedule.checkpoint_every if settings.checkpoint_every is None else settings.checkpoint_every
    steps = settings.steps
    warm = fold_length(staleness if mode == "async" else 0)
    lengths = (warm, warm + 1, warm + 2) if settings.periodic and steps >= warm else (steps,)
    groups = _groups(shape, layout)
    transcripts = {n: _transcript(graph, shape, layout, offload, reshard, sync, groups, n, mode, staleness)
                   for n in lengths}
    return Schedule(steps, mode, staleness, every, MappingProxyType(groups), MappingProxyType(transcripts),
                    warm if len(lengths) > 1 else None)


def _groups(shape: JobShape, layout: Layout) -> dict[str, tuple[int, ...]]:
    train, gen = shape.policy_meshes(layout)
    groups: dict[str, tuple[int, ...]] = {"all": tuple(range(shape.num_devices)), "trainer": train.ranks()}
    if gen is not None:
        for j in range(gen.data_parallel):
            groups[f"gen.{j}"] = gen.ranks_of_data_index(j)
        groups["sync"] = tuple(sorted(set(train.ranks()) | set(gen.ranks())))
    return groups


class _Streams:
    def __init__(self, num_ranks: int) -> None:
        self.streams: list[list[Instruction]] = [[] for _ in range(num_ranks)]

    def emit(self, ranks: range | list[int] | tuple[int, ...], ins: Instruction) -> None:
        for r in ranks:
            self.streams[r].append(ins)


def _reshard(step: int, plan: ReshardPlan, out: _Streams, sends: bool = True, recvs: bool = True) -> None:
    """Emit one step's reshard: the sends, the receives, or both."""
    for t in plan.transfers:
        num_bytes = plan.num_bytes(t)
        tag = step * TAG_STRIDE + t.src * 1009 + t.dst
        if sends:
            out.streams[t.src].append(Send(step, "rollouts", t.start, t.stop, t.dst, num_bytes, tag))
        if recvs:
            out.streams[t.dst].append(Recv(step, "rollouts", t.start, t.stop, t.src, num_bytes, tag))


# One builder per op kind that runs on the trainer side: (node, step, start, stop, placement group, role) -> ins
_TRAINER_OPS: dict[str, Callable[[OpNode, int, int, int, str, str], Instruction]] = {
    "logprob": lambda n, i, a, b, g, r: Logprob(i, n.name, r, a, b, g),
    "value": lambda n, i, a, b, g, r: Value(i, n.name, r, a, b, g),
    "reward": lambda n, i, a, b, g, r: Reward(i, n.name, r, a, b, g if r else ""),
    "advantage": lambda n, i, a, b, g, r: Advantage(i, n.name, a, b),
    "train": lambda n, i, a, b, g, r: TrainStep(i, n.name, r, a, b, i + 1, g),
}


def _role_of(node: OpNode, bases: dict[str, str]) -> str:
    """The role that runs `node` ("" for none): its model's, or, for a model that is a LoRA model's base
    (`lora_bases`), the LoRA model's trained role."""
    model = node.spec.model if node.op in ("logprob", "value", "train") or (node.op == "reward" and node.spec.model) else ""
    return bases.get(model, model)


def _trainer_step(graph: JobGraph, step: int, train: Mesh, responses: int, group: int, offload: OffloadPlan,
                  out: _Streams) -> None:
    """The frozen forwards, the advantage and the updates of one step, in topological order."""
    nodes = [graph.node(n) for n in graph.topo_order() if graph.node(n).op in _TRAINER_OPS]
    bases = lora_bases(graph.job)
    last_use: dict[str, int] = {}
    for k, node in enumerate(nodes):
        role = _role_of(node, bases)
        if role:
            last_use[role] = k
    loaded: set[str] = set()
    for d in range(train.data_parallel):
        ranks = train.ranks_of_data_index(d)
        lo, hi = split_range(responses, train.data_parallel, d, group)
        loaded.clear()
        for k, node in enumerate(nodes):
            role = _role_of(node, bases)
            off = offload.roles.get(role) if role else None
            if off and role not in loaded:
                out.emit(ranks, Onload(role, off.state, off.num_bytes))
                loaded.add(role)
            out.emit(ranks, _TRAINER_OPS[node.op](node, step, lo, hi, "trainer", role))
            if off and last_use[role] == k:
                out.emit(ranks, Offload(role, off.state, off.num_bytes))


def _transcript(graph: JobGraph, shape: JobShape, layout: Layout, offload: OffloadPlan, reshard: ReshardPlan,
                sync: WeightSyncPlan, groups: dict[str, tuple[int, ...]], steps: int, mode: str,
                staleness: int) -> Streams:
    """`steps` steps of the job on `layout`, one instruction stream per rank."""
    out = _Streams(shape.num_devices)
    train, gen = shape.policy_meshes(layout)
    gen_role = shape.generator
    gen_node = next(n for n in graph.nodes() if n.op == "generate")
    group, responses = reshard.group, reshard.responses
    policy, model = shape.policy, shape.policy.model
    # Which versions some generate uses, and where each is first needed.
    versions = [version_for(i, mode, staleness) for i in range(steps)]
    first_use = {v: versions.index(v) for v in sorted(set(versions))}

    def generate(i: int, v: int) -> None:
        for j in range(gen.data_parallel):
            lo, hi = split_range(responses, gen.data_parallel, j, group)
            out.emit(groups[f"gen.{j}"], Generate(i, gen_node.name, gen_role.name, v, lo, hi, f"gen.{j}"))

    if sync.kind == "none":
        for i in range(steps):
            _trainer_step(graph, i, train, responses, group, offload, out)
            out.emit(range(shape.num_devices), Checkpoint(i, "all"))
    elif sync.kind == "in_place":
        for i in range(steps):
            if i == 0:
                for role, off in offload.roles.items():
                    out.emit(train.ranks(), Offload(role, off.state, off.num_bytes))
            out.emit(train.ranks(), ReshardInPlace(model, i, policy.name, gen_role.name, "all"))
            generate(i, i)
            out.emit(gen.ranks(), ReleaseWeights(gen_role.name))
            _reshard(i, reshard, out)
            _trainer_step(graph, i, train, responses, group, offload, out)
            out.emit(range(shape.num_devices), Checkpoint(i, "all"))
    else:
        # Generator: sync a version when first needed, generate, send.
        for i in range(steps):
            v = versions[i]
            if first_use[v] == i:
                out.emit(gen.ranks(), WeightSync(model, v, sync.transfer, policy.name, gen_role.name, "sync"))
            generate(i, v)
            _reshard(i, reshard, out, recvs=False)
        # Trainer: version 0 first; then per step receive, train, receive every step generated with
        # the versions it had (so a checkpoint after step i holds all rollouts made from weights older
        # than its own: a resumed run never needs those weights), and sync the next version when a
        # generate needs it.
        received = -1
        last_from = [max((j for j, v in enumerate(versions) if v <= i), default=-1) for i in range(steps)]

        def receive_through(last: int) -> None:
            nonlocal received
            while received < min(last, steps - 1):
                received += 1
                _reshard(received, reshard, out, sends=False)

        for i in range(steps):
            if i == 0 and 0 in first_use:
                out.emit(train.ranks(), WeightSync(model, 0, sync.transfer, policy.name, gen_role.name, "sync"))
            receive_through(i)
            _trainer_step(graph, i, train, responses, group, offload, out)
            receive_through(last_from[i])
            if i + 1 in first_use:
                out.emit(train.ranks(), WeightSync(model, i + 1, sync.transfer, policy.name, gen_role.name, "sync"))
            out.emit(train.ranks(), Checkpoint(i, "trainer"))
    return tuple(tuple(s) for s in out.streams)


def check_schedule(schedule: Schedule) -> list[str]:
    """The stage's spec, for every length written out: each send has one receive of the same bytes
    and tag on its peer; a generate uses a version its mode allows (sync: its own step; async: at
    most `staleness` behind, never ahead); a rank that generates has received that version first;
    every rank ends each step it takes part in with one checkpoint instruction."""
    problems = []
    for n, streams in schedule.transcripts.items():
        sends, recvs = Counter(), Counter()
        for rank, stream in enumerate(streams):
            synced: set[int] = set()
            checkpoints = []
            for ins in stream:
                if isinstance(ins, Send):
                    sends[(rank, ins.peer, ins.tag, ins.num_bytes)] += 1
                elif isinstance(ins, Recv):
                    recvs[(ins.peer, rank, ins.tag, ins.num_bytes)] += 1
                elif isinstance(ins, WeightSync):
                    synced.add(ins.version)
                elif isinstance(ins, Generate):
                    lag = ins.step - ins.version
                    allowed = lag == 0 if schedule.mode == "sync" else 0 <= lag <= schedule.staleness
                    if not allowed:
                        problems.append(f"{n} steps, rank {rank}: generate of step {ins.step} uses version "
                                        f"{ins.version} ({schedule.mode}, staleness {schedule.staleness})")
                    if any(isinstance(x, WeightSync) for x in stream) and ins.version not in synced:
                        problems.append(f"{n} steps, rank {rank}: generates with version {ins.version} before syncing it")
                elif isinstance(ins, Checkpoint):
                    checkpoints.append(ins.step)
            if checkpoints and checkpoints != list(range(n)):
                problems.append(f"{n} steps, rank {rank}: checkpoint instructions at steps {checkpoints[:8]}...")
        if sends != recvs:
            odd = sorted((sends - recvs) + (recvs - sends))[:3]
            problems.append(f"{n} steps: sends and receives do not pair up, e.g. (src, dst, tag, bytes) {odd}")
    return problems



__all__ = ["ProgramSettings", "Schedule", "build_schedule", "check_schedule", "fold_length", "version_for"]
