"""Running per-rank programs symbolically: the verifier's deadlock check and the discrete-event simulator.

Both walk exactly the instruction streams the executors run, with blocking semantics:
- a group instruction (an FSDP train step, a DDMA weight sync, a tensor-parallel generate) starts when
  every rank of its group has reached the same instruction, and ends for all of them together;
- a `Send` and its `Recv` (same tag) rendezvous: each waits for the other;
- everything else runs locally.

With `timed=True` each instruction takes its predicted duration (`Programs.durations`); transfers
occupy the sender's outgoing and the receiver's incoming link, so concurrent transfers through one
link queue. The result is the steady-state seconds per step, each rank's busy fraction, and optionally
a timeline (Chrome trace JSON for Perfetto, and a text Gantt).
"""

from __future__ import annotations

import json
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from graphrl.errors import VerifyError
from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.program import INSTRUCTION_TYPES, PHASES, TRAITS, Instruction, Programs, describe, label

from graphrl.compiler.semantics import BY_NAME, SEMANTICS, Costs
from graphrl.compiler.cost import p2p_seconds

_IGNORED_IN_KEY = {"start", "stop", "num_bytes", "peer", "tag"}


def _key_fields(cls: type) -> Callable[[Instruction], Any]:
    """A getter of the operands of kind `cls` that every member of a group must agree on."""
    names = tuple(f for f in cls.__dataclass_fields__ if f not in _IGNORED_IN_KEY)  # type: ignore[attr-defined]
    getter = operator.attrgetter(*names) if names else (lambda ins: ())
    return (lambda ins: (getter(ins),)) if len(names) == 1 else getter


_KEY_FIELDS: dict[type, Callable[[Instruction], Any]] = {cls: _key_fields(cls) for cls in INSTRUCTION_TYPES.values()}


def group_key(ins: Instruction) -> tuple:
    """What every member of a group must agree on: the type and the operands that are not per-rank."""
    cls = type(ins)
    return (cls,) + _KEY_FIELDS[cls](ins)


@dataclass
class Span:
    rank: int
    name: str
    category: str
    start: float
    end: float


@dataclass
class SimResult:
    makespan_s: float
    step_time_s: float
    step_done_s: list[float]
    busy_fraction: list[float]
    spans: list[Span] = field(default_factory=list)
    flows: list[tuple[int, int, float, float]] = field(default_factory=list)  # (src, dst, start, end)


def run_programs(programs: Programs, *, hw: HardwareSpec | None = None, devices_per_node: int = 1,
                 timed: bool = False, trace_ranks: set[int] | None = None) -> SimResult:
    """Execute all streams with blocking semantics. Raises VerifyError naming the rank, the
    instruction index and the reason when the programs deadlock or disagree within a group."""
    streams = programs.streams
    n = len(streams)
    groups = programs.groups
    members_of = {name: frozenset(ranks) for name, ranks in groups.items()}  # membership, in O(1)
    durations = programs.durations
    pc = [0] * n
    clock = [0.0] * n
    busy = [0.0] * n
    link_out = [0.0] * n
    link_in = [0.0] * n
    arrivals: dict[tuple[str, tuple], list[int]] = defaultdict(list)
    waiting_at: dict[int, tuple[str, tuple]] = {}  # rank -> group arrival key it waits in
    pending_p2p: dict[int, int] = {}  # tag -> rank that posted first
    step_done: dict[int, float] = {}
    spans: list[Span] = []
    flows: list[tuple[int, int, float, float]] = []
    trace = timed and trace_ranks is not None

    costs = Costs(durations, hw)

    def duration(ins: Instruction) -> float:
        return SEMANTICS[type(ins)].duration(ins, costs)

    def p2p_time(ins: Instruction, src: int, dst: int) -> float:
        assert hw is not None
        spans_nodes = src // devices_per_node != dst // devices_per_node
        return p2p_seconds(hw, ins.num_bytes, spans_nodes)  # type: ignore[union-attr]

    def finish(ranks: list[int] | tuple[int, ...], ins: Instruction, start: float, dur: float) -> None:
        end = start + dur
        for r in ranks:
            clock[r] = end
            busy[r] += dur
            pc[r] += 1
        if trace:
            traced = [r for r in ranks if r in trace_ranks]  # type: ignore[operator]
            if traced:
                name, kind = label(ins), type(ins).__name__
                spans.extend(Span(r, name, kind, start, end) for r in traced)
        if TRAITS[type(ins)].weights == "produces":
            step_done[ins.step] = max(step_done.get(ins.step, 0.0), end)  # type: ignore[union-attr]

    ready = list(range(n))
    while ready:
        rank = ready.pop()
        stream = streams[rank]
        while pc[rank] < len(stream):
            if rank in waiting_at:
                break
            ins = stream[pc[rank]]
            side = TRAITS[type(ins)].p2p
            if side:
                tag = ins.tag  # type: ignore[union-attr]
                other = pending_p2p.get(tag)
                if other == rank:
                    break  # already posted; still waiting for the peer
                if other is None:
                    pending_p2p[tag] = rank
                    break  # wait for the peer
                peer_ins = streams[other][pc[other]]
                if TRAITS[type(peer_ins)].p2p in ("", side) or ins.peer != other or peer_ins.peer != rank:  # type: ignore[union-attr]
                    raise VerifyError(
                        f"rank {rank} instruction {pc[rank]} ({describe(ins)}) meets rank {other} "
                        f"instruction {pc[other]} ({describe(peer_ins)}) with the same tag but they do not match",
                        fix="compiler bug: sends and receives must pair up")
                del pending_p2p[tag]
                src, dst = (rank, other) if side == "send" else (other, rank)
                if timed:
                    start = max(clock[rank], clock[other], link_out[src], link_in[dst])
                    dur = p2p_time(ins, src, dst)
                    link_out[src] = link_in[dst] = start + dur
                    if trace and (src in trace_ranks or dst in trace_ranks):  # type: ignore[operator]
                        flows.append((src, dst, start, start + dur))
                else:
                    start = dur = 0.0
                finish((rank, other), ins, start, dur)
                ready.append(other)
                continue
            group_name = getattr(ins, "group", "")
            if group_name:
                members = groups.get(group_name)
                if members is None:
                    raise VerifyError(f"rank {rank} instruction {pc[rank]} ({describe(ins)}) names unknown group {group_name!r}")
                if rank not in members_of[group_name]:
                    raise VerifyError(f"rank {rank} instruction {pc[rank]} ({describe(ins)}) is not in its group {group_name!r}")
                if len(members) > 1:
                    key = (group_name, group_key(ins))
                    arrived = arrivals[key]
                    arrived.append(rank)
                    if len(arrived) < len(members):
                        waiting_at[rank] = key
                        break
                    del arrivals[key]
                    start = max(clock[r] for r in arrived) if timed else 0.0
                    dur = duration(ins) if timed else 0.0
                    for r in arrived:
                        waiting_at.pop(r, None)
                    finish(members, ins, start, dur)
                    ready.extend(r for r in members if r != rank)
                    continue
            dur = duration(ins) if timed else 0.0
            finish((rank,), ins, clock[rank], dur)

    unfinished = [r for r in range(n) if pc[r] < len(streams[r])]
    if unfinished:
        raise _deadlock(programs, pc, unfinished, waiting_at, pending_p2p)
    makespan = max(clock) if clock else 0.0
    done = [step_done[k] for k in sorted(step_done)]
    start, end, steps = _steady(done, makespan, programs.steps)
    busy_fraction = [b / makespan if makespan > 0 else 0.0 for b in busy]
    return SimResult(makespan, (end - start) / steps, done, busy_fraction, spans, flows)


def _steady(done: list[float], makespan: float, run_steps: int) -> tuple[float, float, int]:
    """(start, end, steps) of the steady part of a simulated run whose steps completed at `done`: from the
    middle step's completion to the last one's, or the whole run when it has fewer than four steps."""
    if len(done) >= 4:
        k0 = len(done) // 2
        return done[k0], done[-1], len(done) - 1 - k0
    return 0.0, (done[-1] if done else makespan), max(len(done) if done else run_steps, 1)


def steady_window(result: SimResult) -> tuple[float, float, int]:
    """(start, end, steps) of the window `step_time_s` was measured over (`_steady`)."""
    return _steady(result.step_done_s, result.makespan_s, len(result.step_done_s))


# The one window a plan's predicted step time is measured over. A plan shows one predicted step time
# (`graphrl compile --plan`, `graphrl simulate`, the line `graphrl run` prints, `graphrl report`): the
# simulator's steady state (`_steady`) of the plan's own programs over their first STEADY_WINDOW_STEPS
# steps (all of a shorter run; more where a rank's prologue and epilogue need them).
STEADY_WINDOW_STEPS = 8


def window_steps(programs: Programs) -> int:
    """Steps of the window the predicted step time of `programs` is measured over."""
    return min(programs.steps, max([STEADY_WINDOW_STEPS] + [r.min_steps() for r in programs.ranks]))


def predicted_step(programs: Programs, *, hw: HardwareSpec, devices_per_node: int,
                   trace_ranks: set[int] | None = None) -> SimResult:
    """The simulated window (`window_steps`) of a run of `programs`; its `step_time_s` is the predicted
    seconds per step. Trace every rank for `phase_breakdown`."""
    window = programs if window_steps(programs) == programs.steps else programs.with_steps(window_steps(programs))
    return run_programs(window, hw=hw, devices_per_node=devices_per_node, timed=True, trace_ranks=trace_ranks)


WAIT_PHASE = "wait"
_PHASE_OF = {name: TRAITS[kind].phase for name, kind in INSTRUCTION_TYPES.items()}  # a span's kind -> its phase


def phase_breakdown(result: SimResult) -> dict[str, float]:
    """Seconds per step of each phase (`TRAITS[kind].phase`) on the busiest rank over the steady-state
    window, and `wait`, the rest of its step (waiting for peers, or for the other mesh's work it depends
    on): they add up to `result.step_time_s`. Needs a result traced on every rank."""
    start, end, steps = steady_window(result)
    by_rank: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for span in result.spans:
        overlap = min(span.end, end) - max(span.start, start)
        if overlap > 0:
            by_rank[span.rank][_PHASE_OF[span.category]] += overlap
    if not by_rank:
        return {WAIT_PHASE: result.step_time_s} if result.step_time_s > 0 else {}
    busiest = max(sorted(by_rank), key=lambda r: sum(by_rank[r].values()))
    phases = {phase: seconds / steps for phase, seconds in by_rank[busiest].items()}
    busy = sum(phases.values())
    if busy > result.step_time_s > 0:  # spans across the window's edges: shares of the step
        phases = {phase: v * result.step_time_s / busy for phase, v in phases.items()}
    elif result.step_time_s - busy > 1e-9 * result.step_time_s:
        phases[WAIT_PHASE] = result.step_time_s - busy
    order = {phase: i for i, phase in enumerate((*PHASES, WAIT_PHASE))}
    return dict(sorted(phases.items(), key=lambda kv: order[kv[0]]))


def _deadlock(programs: Programs, pc: list[int], unfinished: list[int], waiting_at: dict,
              pending_p2p: dict[int, int]) -> VerifyError:
    rank = unfinished[0]
    ins = programs.streams[rank][pc[rank]]
    if TRAITS[type(ins)].p2p:
        peer = ins.peer  # type: ignore[union-attr]
        peer_ins = programs.streams[peer][pc[peer]] if pc[peer] < len(programs.streams[peer]) else None
        reason = (f"waits for rank {peer} to {'receive' if TRAITS[type(ins)].p2p == 'send' else 'send'} (tag {ins.tag}), "  # type: ignore[union-attr]
                  f"but rank {peer} is at " + (f"instruction {pc[peer]} ({describe(peer_ins)})" if peer_ins else "its end"))
    elif rank in waiting_at:
        group_name, _ = waiting_at[rank]
        members = programs.groups[group_name]
        missing = [r for r in members if waiting_at.get(r) != waiting_at[rank]]
        other = missing[0]
        other_at = (f"instruction {pc[other]} ({describe(programs.streams[other][pc[other]])})"
                    if pc[other] < len(programs.streams[other]) else "its end")
        reason = f"waits for group {group_name!r}, but rank {other} is at {other_at}"
    else:
        reason = "cannot proceed"
    return VerifyError(f"deadlock: rank {rank} instruction {pc[rank]} ({describe(ins)}) {reason} "
                       f"({len(unfinished)} ranks stuck)", fix="the programs' order of sends, receives and group "
                       "instructions must agree across ranks")


# ------------------------------------------------------------------------------------------------
# Outputs


def chrome_trace(result: SimResult, rank_names: dict[int, str] | None = None) -> dict[str, Any]:
    """Chrome trace JSON (opens in Perfetto / chrome://tracing): one process row per rank, instructions as
    spans, transfers as flow arrows. Times in microseconds."""
    events: list[dict[str, Any]] = []
    ranks = sorted({s.rank for s in result.spans} | {f[0] for f in result.flows} | {f[1] for f in result.flows})
    for r in ranks:
        name = f"rank {r}" + (f" ({rank_names[r]})" if rank_names and r in rank_names else "")
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
    for s in result.spans:
        events.append({"ph": "X", "name": s.name, "cat": s.category, "pid": s.rank, "tid": 0,
                       "ts": s.start * 1e6, "dur": max((s.end - s.start) * 1e6, 0.001)})
    for i, (src, dst, start, end) in enumerate(result.flows):
        events.append({"ph": "s", "id": i, "name": "transfer", "cat": "p2p", "pid": src, "tid": 0, "ts": start * 1e6})
        events.append({"ph": "f", "id": i, "name": "transfer", "cat": "p2p", "pid": dst, "tid": 0, "ts": end * 1e6,
                       "bp": "e"})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(result: SimResult, path: Path, rank_names: dict[int, str] | None = None) -> None:
    path.write_text(json.dumps(chrome_trace(result, rank_names)))


def _gantt_char(kind: str) -> str:
    entry = BY_NAME.get(kind)
    return entry.gantt if entry is not None else "?"


def text_gantt(result: SimResult, ranks: list[int], width: int = 100, names: dict[int, str] | None = None) -> str:
    """One line per rank: which instruction kind occupies each slice of time (longest wins)."""
    if result.makespan_s <= 0:
        return ""
    dt = result.makespan_s / width
    lines = []
    by_rank: dict[int, list[Span]] = defaultdict(list)
    for s in result.spans:
        by_rank[s.rank].append(s)
    for r in ranks:
        occupancy = [dict() for _ in range(width)]  # type: list[dict[str, float]]
        for s in by_rank.get(r, []):
            first, last = int(s.start / dt), min(int(s.end / dt), width - 1)
            for c in range(first, last + 1):
                lo, hi = max(s.start, c * dt), min(s.end, (c + 1) * dt)
                if hi > lo:
                    occupancy[c][s.category] = occupancy[c].get(s.category, 0.0) + hi - lo
        row = "".join(_gantt_char(max(o, key=o.get)) if o and max(o.values()) > dt * 0.2 else "."
                      for o in occupancy)
        name = (names or {}).get(r, "")
        lines.append(f"{('rank ' + str(r) + ' ' + name)[:22]:<22} |{row}|")
    legend = "G generate  F forward  R reward  T train  S weight sync  < > transfer  o offload  C checkpoint  . idle"
    return "\n".join(lines + [f"{'':<22}  0{'':<{width - 12}}{result.makespan_s:10.3g}s", legend])
