"""The lower stage: the schedule becomes the plan's `Programs`, one loop per rank.

Each rank's run is a prologue, a body of one step whose instructions carry their step and weight
version as offsets from the loop counter, and an epilogue. The loop is folded from the schedule's
transcripts of two lengths (the longer is the shorter with one more body iteration in the middle) and
checked against a third before it is trusted. Predicted durations per (instruction kind, role) are
attached here: the cost model's for the layout (`cost.layout_durations`), and the weight-sync pass's for a
DDMA copy.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from graphrl.schemas.program import Checkpoint, CostKey, Instruction, Programs, RankProgram, checkpoint_due, shift

from graphrl.compiler.schedule import Schedule
from graphrl.compiler.weight_sync import WeightSyncPlan



def lower_schedule(schedule: Schedule, sync: WeightSyncPlan, durations: Mapping[CostKey, float]) -> Programs:
    """The plan's programs for the scheduled run, with `durations` (the cost model's for the layout) and the
    weight sync's seconds and record, read last: a large DDMA plan is still being made meanwhile."""
    groups = dict(schedule.groups)
    every = schedule.checkpoint_every
    if schedule.fold_from is None:
        streams = [list(s) for s in schedule.transcripts[schedule.steps]]
        programs = Programs.unrolled(schedule.steps, streams, groups, {}, {}, every)
    else:
        n = schedule.fold_from
        short, longer, check = (schedule.transcripts[k] for k in (n, n + 1, n + 2))
        ranks = [_fold_rank(list(x), list(y), n) for x, y in zip(short, longer)]
        programs = Programs(schedule.steps, ranks, groups, {}, {}, every)
        # The fold reproduces the two transcripts it came from by construction; it is a claim about every
        # run length, so check it on one more before trusting it.
        window = dataclasses.replace(programs, steps=n + 2)
        for rank, reference in enumerate(check):
            expanded = list(window.rank_stream(rank))
            if expanded != _filtered(reference, n + 2, every):
                raise AssertionError(f"rank {rank}: the periodic program differs from the {n + 2}-step transcript")
    programs.weight_syncs = {sync.transfer: sync.record} if sync.record is not None else {}
    programs.durations = predicted_durations(durations, sync)
    return programs


def _filtered(stream: tuple[Instruction, ...], steps: int, every: int) -> list[Instruction]:
    """A transcript as it executes: the checkpoints that are not due dropped."""
    return [ins for ins in stream if not isinstance(ins, Checkpoint) or checkpoint_due(ins.step, steps, every)]


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


def predicted_durations(placed: Mapping[CostKey, float], sync: WeightSyncPlan) -> dict[CostKey, float]:
    """Seconds of each (instruction kind, role): the cost model's for the layout, with the DDMA copy's from
    the weight-sync pass; what the simulator charges."""
    durations = dict(placed)
    if sync.kind == "ddma":
        durations[CostKey("WeightSync", sync.transfer)] = sync.seconds
    return durations


def check_lowered(programs: Programs, schedule: Schedule) -> list[str]:
    """The stage's spec: the programs are for the scheduled run on the scheduled ranks, and expanded to
    every length the schedule wrote out they give exactly its transcripts (checkpoints filtered)."""
    problems = []
    if programs.steps != schedule.steps:
        problems.append(f"programs for {programs.steps} steps, the schedule is for {schedule.steps}")
    for n, streams in schedule.transcripts.items():
        if len(streams) != programs.num_ranks:
            problems.append(f"{programs.num_ranks} programs for {len(streams)} ranks")
            break
        if n < max((r.min_steps() for r in programs.ranks), default=0):
            continue
        window = dataclasses.replace(programs, steps=n)
        for rank, stream in enumerate(streams):
            if list(window.rank_stream(rank)) != _filtered(stream, n, schedule.checkpoint_every):
                problems.append(f"rank {rank}: the program run for {n} steps is not the schedule's transcript")
    return problems



__all__ = ["check_lowered", "lower_schedule", "predicted_durations"]
