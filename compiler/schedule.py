"""Lowering a placed layout to per-rank programs: reshard, weight sync (DDMA), offload, and the schedule.

`build_programs` unrolls the job's steps into one instruction stream per rank:

- **reshard**: each step's responses are split over the generator replicas and over the trainer's
  data-parallel ranks (ranges aligned to prompt groups, so group-relative advantages stay local, and
  balanced by tokens since every response has the same padded length); every overlap between what a
  replica produced and what a trainer rank needs becomes a `Send`/`Recv` pair, or nothing when both are
  the same rank. Within a step all transfers run in one global (src, dst) order, which cannot deadlock
  under blocking semantics: the smallest pending pair is always next on both of its ranks.
- **weight sync**: disaggregated layouts get one DDMA plan (graphrl.compiler.ddma) per trained model
  that generates, executed as a `WeightSync` group instruction whenever the generator needs a new
  version; colocated layouts gather the generator's weights in place (`ReshardInPlace`).
- **offload**: roles whose idle state the layout offloads are onloaded right before their first
  instruction of a step and offloaded right after their last.
- **schedule**: `sync` gives generate(i) version i. `async` with staleness s gives generate(i) version
  max(0, i - s): the newest version that is ready without waiting when generation runs s steps ahead
  of training. The trainer receives every batch that the generator sends before a weight sync ahead of
  that sync, so programs never wait on each other in a cycle.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

from graphrl.ir import JobGraph, OpNode
from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.model import ModelDims
from graphrl.schemas.plan import Layout
from graphrl.schemas.program import (
    Advantage,
    Checkpoint,
    CostKey,
    Generate,
    Instruction,
    Logprob,
    Offload,
    Onload,
    Programs,
    Recv,
    TAG_STRIDE,
    RankProgram,
    ReleaseWeights,
    ReshardInPlace,
    Reward,
    Send,
    TrainStep,
    Value,
    WeightSync,
    shift,
)

from graphrl.schemas.weightsync import Bucket, LocalCopy, Slice, WeightSyncRecord, WeightSyncSummary

from graphrl.compiler import cost
from graphrl.compiler.ddma import plan_summary, plan_weight_sync
from graphrl.compiler.layout import llama_param_layout, llama_params
from graphrl.compiler.placement import (
    ROLLOUT_BYTES_PER_TOKEN,
    Evaluated,
    Problem,
    generation_time,
    reshard_in_place_time,
    role_times,
)

# DDMA plans with more buckets than this keep only their summary in the plan file (a 405B plan has
# ~10^5 buckets); executors of such plans recompute the rounds with the same deterministic planner.
MAX_STORED_BUCKETS = 20_000
DDMA_BUCKET_BYTES = 256 << 20


def split_range(total: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """Range `index` of `total` items cut into `parts` pieces of whole `unit`s (torch.tensor_split rule)."""
    units = total // unit
    base, extra = divmod(units, parts)
    start = index * base + min(index, extra)
    stop = start + base + (1 if index < extra else 0)
    return start * unit, stop * unit


def version_for(step: int, mode: str, staleness: int) -> int:
    return step if mode == "sync" else max(0, step - staleness)


class _Streams:
    def __init__(self, num_ranks: int) -> None:
        self.streams: list[list[Instruction]] = [[] for _ in range(num_ranks)]

    def emit(self, ranks: range | list[int] | tuple[int, ...], ins: Instruction) -> None:
        for r in ranks:
            self.streams[r].append(ins)


def reshard_pairs(gen: Mesh, train: Mesh, responses: int, group: int) -> list[tuple[int, int, int, int]]:
    """(src, dst, start, stop) of every cross-rank copy of one step's responses, in the global (src, dst)
    order that all ranks follow: each generator replica's range goes to the trainer ranks whose
    data-parallel range overlaps it; replica ranks share the sending (round robin)."""
    transfers: list[tuple[int, int, int, int]] = []
    gen_ranges = [split_range(responses, gen.data_parallel, j, group) for j in range(gen.data_parallel)]
    for d in range(train.data_parallel):
        need = split_range(responses, train.data_parallel, d, group)
        for j, have in enumerate(gen_ranges):
            lo, hi = max(need[0], have[0]), min(need[1], have[1])
            if lo >= hi:
                continue
            senders = list(gen.ranks_of_data_index(j))
            for k, dst in enumerate(train.ranks_of_data_index(d)):
                src = dst if dst in senders else senders[(d + k) % len(senders)]
                if src != dst:
                    transfers.append((src, dst, lo, hi))
    return sorted(transfers)


def _reshard(step: int, pairs: list[tuple[int, int, int, int]], seq_len: int, out: _Streams,
             sends: bool = True, recvs: bool = True) -> None:
    """Emit one step's reshard: the sends, the receives, or both."""
    for src, dst, lo, hi in pairs:
        num_bytes = (hi - lo) * seq_len * ROLLOUT_BYTES_PER_TOKEN
        tag = step * TAG_STRIDE + src * 1009 + dst
        if sends:
            out.streams[src].append(Send(step, "rollouts", lo, hi, dst, num_bytes, tag))
        if recvs:
            out.streams[dst].append(Recv(step, "rollouts", lo, hi, src, num_bytes, tag))


# One builder per op kind that runs on the trainer side: (node, step, start, stop, role placement) -> ins
_TRAINER_OPS: dict[str, Callable[[OpNode, int, int, int, str], Instruction]] = {
    "logprob": lambda n, i, a, b, g: Logprob(i, n.name, n.spec.model, a, b, g),
    "value": lambda n, i, a, b, g: Value(i, n.name, n.spec.model, a, b, g),
    "reward": lambda n, i, a, b, g: Reward(i, n.name, n.spec.model or "", a, b, g if n.spec.model else ""),
    "advantage": lambda n, i, a, b, g: Advantage(i, n.name, a, b),
    "train": lambda n, i, a, b, g: TrainStep(i, n.name, n.spec.model, a, b, i + 1, g),
}


def _role_of(node: OpNode) -> str | None:
    return node.spec.model if node.op in ("logprob", "value", "train") or (node.op == "reward" and node.spec.model) else None


def _trainer_step(graph: JobGraph, step: int, train: Mesh, responses: int, group: int,
                  offloaded: dict[str, tuple[str, ...]], offload_bytes: dict[str, int], out: _Streams) -> None:
    """The frozen forwards, the advantage and the updates of one step, in topological order."""
    nodes = [graph.node(n) for n in graph.topo_order() if graph.node(n).op in _TRAINER_OPS]
    last_use: dict[str, int] = {}
    for k, node in enumerate(nodes):
        role = _role_of(node)
        if role:
            last_use[role] = k
    loaded: set[str] = set()
    for d in range(train.data_parallel):
        ranks = train.ranks_of_data_index(d)
        lo, hi = split_range(responses, train.data_parallel, d, group)
        loaded.clear()
        for k, node in enumerate(nodes):
            role = _role_of(node)
            if role and offloaded.get(role) and role not in loaded:
                out.emit(ranks, Onload(role, offloaded[role], offload_bytes[role]))
                loaded.add(role)
            out.emit(ranks, _TRAINER_OPS[node.op](node, step, lo, hi, "trainer"))
            if role and offloaded.get(role) and last_use[role] == k:
                out.emit(ranks, Offload(role, offloaded[role], offload_bytes[role]))


def build_programs(graph: JobGraph, problem: Problem, ev: Evaluated, layout: Layout, *, steps: int,
                   mode: str | None = None, checkpoint_every: int | None = None, periodic: bool = True) -> Programs:
    """The job's programs on `layout` for a run of `steps` steps: periodic (one loop per rank, whose
    size does not depend on `steps`), or with `periodic=False` the whole run unrolled (the reference
    the periodic form is checked against)."""
    def transcript(n: int) -> Programs:
        return build_transcript(graph, problem, ev, layout, steps=n, mode=mode, checkpoint_every=checkpoint_every)

    if not periodic:
        return transcript(steps)
    job = graph.job
    mode_ = mode or (job.schedule.mode if layout.strategy == "disaggregated" else "sync")
    warm = fold_length(job.schedule.max_staleness if mode_ == "async" else 0)
    if steps < warm:
        return transcript(steps)
    short, longer = transcript(warm), transcript(warm + 1)
    ranks = fold_streams([r.prologue for r in short.ranks], [r.prologue for r in longer.ranks], warm)
    folded = dataclasses.replace(short, steps=steps, ranks=ranks)
    # The fold reproduces the two transcripts it came from by construction; it is a claim about every
    # run length, so check it on one more before trusting it.
    check = transcript(warm + 2)
    for rank, reference in enumerate(check.ranks):
        if list(folded.rank_stream(rank, warm + 2)) != list(reference.instructions(warm + 2, check.checkpoint_every)):
            raise AssertionError(f"rank {rank}: the periodic program differs from the {warm + 2}-step transcript")
    return folded


def fold_length(staleness: int) -> int:
    """Steps of the short transcripts the periodic form is folded from: enough for the warm-up (the
    generator runs `staleness` steps ahead), two steady-state steps, and the drain."""
    return 2 * staleness + 6


def fold_streams(short: list[list[Instruction]], longer: list[list[Instruction]], steps: int) -> list[RankProgram]:
    """Each rank's loop, from its transcripts of `steps` and `steps + 1` steps (checkpoints not yet
    filtered): the longer one is the shorter with one more body iteration in the middle."""
    return [_fold_rank(x, y, steps) for x, y in zip(short, longer)]


def _fold_rank(x: list[Instruction], y: list[Instruction], steps: int) -> RankProgram:
    """x = prologue + body(first) + ... + body(steps - tail - 1) + epilogue; y has one iteration more, so
    y = x[:cut] + body(first) + shift(x[cut:], 1): the cut is where x's end, one step later, stops being
    y's end."""
    extra = len(y) - len(x)
    assert extra >= 0, "a longer run has fewer instructions"
    matched = 0
    while matched < len(x) and shift(x[len(x) - 1 - matched], 1) == y[len(y) - 1 - matched]:
        matched += 1
    cut = len(x) - matched
    assert x[:cut] == y[:cut], "the transcripts of two run lengths share no periodic middle"
    if extra == 0:
        return RankProgram(x[:cut], [], [shift(i, -steps) for i in x[cut:]])
    block = y[cut:cut + extra]
    first = min(getattr(i, "step", getattr(i, "version", 0)) for i in block)
    body = [shift(i, -first) for i in block]
    count = 0  # body iterations inside x
    while x[cut + count * extra:cut + (count + 1) * extra] == [shift(i, first + count) for i in body]:
        count += 1
    epilogue = [shift(i, -steps) for i in x[cut + count * extra:]]
    return RankProgram(x[:cut], body, epilogue, first=first, tail=steps - first - count)


def build_transcript(graph: JobGraph, problem: Problem, ev: Evaluated, layout: Layout, *, steps: int,
                     mode: str | None = None, checkpoint_every: int | None = None) -> Programs:
    """Unroll `steps` steps of the job on `layout` into one instruction stream per rank."""
    job = graph.job
    mode = mode or (job.schedule.mode if layout.strategy == "disaggregated" else "sync")
    staleness = job.schedule.max_staleness
    checkpoint_every = job.schedule.checkpoint_every if checkpoint_every is None else checkpoint_every
    w = problem.workload
    num_ranks = problem.num_devices
    out = _Streams(num_ranks)
    by_role = {p.role: p for p in layout.placements}
    policy = by_role[problem.policy.name]
    train = layout.role_mesh(policy)
    gen_role = problem.generator
    gen_pl = by_role[gen_role.name] if gen_role else None
    gen = layout.role_mesh(gen_pl) if gen_pl else None
    gen_node = next(n for n in graph.nodes() if n.op == "generate")
    group = gen_node.spec.samples_per_prompt

    groups: dict[str, tuple[int, ...]] = {"all": tuple(range(num_ranks)), "trainer": train.ranks()}
    if gen is not None:
        for j in range(gen.data_parallel):
            groups[f"gen.{j}"] = gen.ranks_of_data_index(j)
        groups["sync"] = tuple(sorted(set(train.ranks()) | set(gen.ranks())))

    offloaded = {p.role: tuple(p.offload) for p in layout.placements if p.offload}
    offload_bytes = {p.role: int(sum(getattr(p.memory_bytes, k) for k in p.offload)) for p in layout.placements}

    durations = dict(role_times(problem, ev.train))
    durations.update({CostKey("Rule"): problem.hw.op_overhead_s, CostKey("Advantage"): problem.hw.op_overhead_s,
                      CostKey("Checkpoint"): problem.hw.op_overhead_s, CostKey("ReleaseWeights"): 0.0})
    weight_syncs: dict[str, WeightSyncRecord] = {}
    if gen is not None and ev.gen is not None:
        free = problem.usable
        if layout.strategy == "colocated":
            free = problem.usable - sum(p.memory_bytes.params + p.memory_bytes.grads + p.memory_bytes.optimizer
                                        for p in layout.placements if p.kind != "generate")
        res = generation_time(problem, ev.gen, free)
        durations[CostKey("Generate", gen_role.name)] = res[0] if res else math.inf
    colocated = layout.strategy == "colocated"
    transfer = f"{problem.policy.model}:trainer->generator"
    if gen is not None and colocated:
        durations[CostKey("ReshardInPlace", problem.policy.model)] = reshard_in_place_time(problem, ev.train, ev.gen)[0]
    elif gen is not None:
        weight_syncs[transfer], durations[CostKey("WeightSync", transfer)] = _ddma(
            problem.policy.dims, problem.policy.model, problem.hw, problem.per_node, train, gen, gen_pl.precision)

    # Which versions some generate uses, and where each is first needed.
    versions = [version_for(i, mode, staleness) for i in range(steps)]
    first_use = {v: versions.index(v) for v in sorted(set(versions))}
    responses = w.responses
    pairs = reshard_pairs(gen, train, responses, group) if gen is not None else []

    if gen is None:
        for i in range(steps):
            _trainer_step(graph, i, train, responses, group, offloaded, offload_bytes, out)
            _checkpoint(i, steps, checkpoint_every, out)
    elif colocated:
        for i in range(steps):
            for role, state in offloaded.items():
                if i == 0:
                    out.emit(train.ranks(), Offload(role, state, offload_bytes[role]))
            out.emit(train.ranks(), ReshardInPlace(problem.policy.model, i, problem.policy.name, gen_role.name, "all"))
            for j in range(gen.data_parallel):
                lo, hi = split_range(responses, gen.data_parallel, j, group)
                out.emit(groups[f"gen.{j}"], Generate(i, gen_node.name, gen_role.name, i, lo, hi, f"gen.{j}"))
            out.emit(gen.ranks(), ReleaseWeights(gen_role.name))
            _reshard(i, pairs, w.seq_len, out)
            _trainer_step(graph, i, train, responses, group, offloaded, offload_bytes, out)
            _checkpoint(i, steps, checkpoint_every, out)
    else:
        # Generator: sync a version when first needed, generate, send.
        for i in range(steps):
            v = versions[i]
            if first_use[v] == i:
                out.emit(gen.ranks(), WeightSync(problem.policy.model, v, transfer, "sync"))
            for j in range(gen.data_parallel):
                lo, hi = split_range(responses, gen.data_parallel, j, group)
                out.emit(groups[f"gen.{j}"], Generate(i, gen_node.name, gen_role.name, v, lo, hi, f"gen.{j}"))
            _reshard(i, pairs, w.seq_len, out, recvs=False)
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
                _reshard(received, pairs, w.seq_len, out, sends=False)

        for i in range(steps):
            if i == 0 and 0 in first_use:
                out.emit(train.ranks(), WeightSync(problem.policy.model, 0, transfer, "sync"))
            receive_through(i)
            _trainer_step(graph, i, train, responses, group, offloaded, offload_bytes, out)
            receive_through(last_from[i])
            if i + 1 in first_use:
                out.emit(train.ranks(), WeightSync(problem.policy.model, i + 1, transfer, "sync"))
            _checkpoint(i, steps, checkpoint_every, out, group="trainer", ranks=train.ranks())
    return Programs.unrolled(steps, out.streams, groups, weight_syncs, durations, checkpoint_every)


def _checkpoint(step: int, steps: int, every: int, out: _Streams, group: str = "all",
                ranks: range | None = None) -> None:
    """Every step ends with a checkpoint instruction; it runs when `checkpoint_due` says so, which keeps
    the schedule periodic with a period of one step whatever `checkpoint_every` is."""
    out.emit(ranks if ranks is not None else range(len(out.streams)), Checkpoint(step, group))


@functools.lru_cache(maxsize=16)
def _ddma(dims: ModelDims, model: str, hw: HardwareSpec, per_node: int, src: Mesh, dst: Mesh,
          precision: str, bucket_bytes: int = DDMA_BUCKET_BYTES) -> tuple[WeightSyncRecord, float]:
    """Plan the trainer -> generator weight copy; return (the record the plan stores, predicted seconds).

    Cached: the periodic schedule is folded from short transcripts of the same layout, and `simulate`
    schedules one layout both sync and async; a 405B plan takes seconds to plan. The record is frozen."""
    plan = plan_weight_sync(llama_params(dims), src_mesh=src, src_layout=llama_param_layout, dst_mesh=dst,
                            dst_layout=llama_param_layout, src_bytes_per_elem=cost.BF16_BYTES,
                            dst_bytes_per_elem=cost.PRECISION_BYTES[precision], bucket_bytes=bucket_bytes)
    spans = cost.group_spans_nodes(list(src.devices) + list(dst.devices), per_node)
    bw = (hw.inter_node_bandwidth if spans else hw.intra_node_bandwidth) * hw.link_efficiency
    seconds = sum(r.max_bucket_bytes / bw + hw.link_latency_s for r in plan.rounds)
    stored = plan.num_buckets <= MAX_STORED_BUCKETS

    def slices(bucket) -> tuple[Slice, ...]:  # noqa: ANN001
        return tuple(Slice(s.param, tuple(tuple(x) for x in s.src_region)) for s in bucket.slices)

    record = WeightSyncRecord(
        model=model,
        src=src, dst=dst,
        src_bytes_per_elem=plan.src_bytes_per_elem, dst_bytes_per_elem=plan.dst_bytes_per_elem,
        bucket_bytes=bucket_bytes, summary=WeightSyncSummary(**plan_summary(plan)), predicted_s=seconds,
        rounds=[[Bucket(b.src, b.dst, b.num_bytes, slices(b)) for b in r.buckets] for r in plan.rounds]
        if stored else None,
        local=[LocalCopy(b.src, b.num_bytes, slices(b)) for b in plan.local_copies] if stored else [],
    )
    return record, seconds
