"""Figures from instruction spans: which RL step a span belongs to, seconds per step in each instruction
kind, and each rank's busy fraction. The same functions read measured spans (timeline.json) and the
simulator's, so the two sides of the report are computed alike and compare.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from graphrl.report.records import TimedSpan
from graphrl.schemas.program import INSTRUCTION_TYPES, TRAITS

# The simulator closes a Send/Recv rendezvous on both ranks with the instruction that completed it, so
# its Send and Recv spans are not told apart per rank; both sides are compared as one kind.
KIND_ALIASES = {"Send": "Send/Recv", "Recv": "Send/Recv"}

# Each kind the report names (an instruction type, or an alias above) -> the phase of an RL step it counts to.
PHASE_OF_KIND: dict[str, str] = {name: TRAITS[cls].phase for name, cls in INSTRUCTION_TYPES.items()}
PHASE_OF_KIND.update({alias: PHASE_OF_KIND[name] for name, alias in KIND_ALIASES.items()})
assert all(PHASE_OF_KIND[alias] == PHASE_OF_KIND[name] for name, alias in KIND_ALIASES.items()), \
    "the kinds one row joins count to one phase"

_STEP_IN_LABEL = re.compile(r"\bstep=(-?\d+)")
_VERSION_IN_LABEL = re.compile(r"\bv=(-?\d+)")


def attribute_steps(spans: list[TimedSpan]) -> list[int | None]:
    """The RL step of each span, from its label: `step=k`; else a weight version `v=k` (the weights
    step k generates with in a synchronous schedule); else the step of the span before it on its rank
    (or after it, for the first spans of a rank). None only when a rank's labels carry no step at all."""
    steps: list[int | None] = [None] * len(spans)
    by_rank: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(spans):
        by_rank[s.rank].append(i)
    for indices in by_rank.values():
        indices.sort(key=lambda i: spans[i].start_s)
        last: int | None = None
        leading: list[int] = []
        for i in indices:
            match = _STEP_IN_LABEL.search(spans[i].name) or _VERSION_IN_LABEL.search(spans[i].name)
            if match:
                last = int(match.group(1))
                for j in leading:
                    steps[j] = last
                leading = []
            elif last is None:
                leading.append(i)
            steps[i] = last
    return steps


def steady_spans(spans: list[TimedSpan], warmup_steps: int) -> tuple[list[TimedSpan], list[int]]:
    """The spans of the steps after the first `warmup_steps` (all spans when no later step exists), and
    those steps."""
    steps = attribute_steps(spans)
    known = sorted({s for s in steps if s is not None})
    kept_steps = known[warmup_steps:] or known
    keep = set(kept_steps)
    return [sp for sp, st in zip(spans, steps) if st in keep], kept_steps


def seconds_per_kind(spans: list[TimedSpan], num_steps: int) -> dict[str, float]:
    """Seconds per step in each instruction kind on a rank that runs it (averaged over those ranks)."""
    per_rank: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    for s in spans:
        per_rank[KIND_ALIASES.get(s.kind, s.kind)][s.rank] += s.dur_s
    steps = max(num_steps, 1)
    return {kind: sum(ranks.values()) / len(ranks) / steps for kind, ranks in per_rank.items()}


def phase_of(kind: str) -> str:
    """The phase of an RL step a span's kind counts to (`TRAITS[...].phase`); "other" for a name that is no
    instruction kind (a span a rank records around something else)."""
    return PHASE_OF_KIND.get(kind, "other")



def busy_fractions(spans: list[TimedSpan], num_ranks: int) -> list[float]:
    """Each rank's share of the window from the first span's start to the last span's end (any rank)
    that it spends inside some span (overlapping spans count once)."""
    if not spans:
        return [0.0] * num_ranks
    t0 = min(s.start_s for s in spans)
    window = max(s.end_s for s in spans) - t0
    intervals: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for s in spans:
        intervals[s.rank].append((s.start_s, s.end_s))
    out = []
    for rank in range(num_ranks):
        covered, reach = 0.0, -math.inf
        for start, end in sorted(intervals.get(rank, [])):
            if end > reach:
                covered += end - max(start, reach)
                reach = end
        out.append(covered / window if window > 0 else 0.0)
    return out

