"""The pass contract and the runner.

A pass is a plain function `(state, ctx) -> state` over the compiler's typed state (`Compilation`),
wrapped with the results (field names) it requires and ensures, and optionally its stage's spec: a
check of what the pass produced (every
trainer rank gets its responses exactly once, no rank sends twice in a DDMA round, ...). The runner
checks requires -> call -> ensures; when asked (tests, `graphrl --debug`) it also runs the graph
invariants and the pass's spec between passes. A failure is reported with the pass's name and the
passes that ran before it.
A user's mistake found by a pass stays a `GraphRLError` (exit 2, with its place), and a `LayoutError` of the
schemas (a mesh or layout that cannot place what it is asked to) becomes a `PlacementError` in its words;
anything else is a bug and is wrapped in `PassFailure`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import networkx as nx

from graphrl.errors import GraphRLError, InternalError, PlacementError
from graphrl.ir import DataEdge, JobGraph, WeightEdge
from graphrl.schemas.cluster import ClusterSpec
from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.capabilities import Target
from graphrl.schemas.job import JobSpec
from graphrl.schemas.mesh import LayoutError

from graphrl.compiler.state import Compilation

PassFn = Callable[["Compilation", "CompileContext"], "Compilation"]
SpecFn = Callable[["Compilation"], list[str]]


@dataclass(frozen=True)
class CompileContext:
    """Everything a pass may read besides the graph. Never mutated."""

    job: JobSpec
    cluster: ClusterSpec | None = None
    hardware: HardwareSpec | None = None
    options: dict[str, Any] = field(default_factory=dict)
    target: Target = "preview"
    """`run`: the plan will be run, so the search and the pin checks keep to what the executors run."""


@dataclass(frozen=True)
class Pass:
    name: str
    fn: PassFn
    requires: tuple[str, ...] = ()
    ensures: tuple[str, ...] = ()
    doc: str = ""
    spec: SpecFn | None = None
    """The stage's spec: the problems with what the pass produced (empty when it holds)."""


def compiler_pass(name: str, *, requires: Sequence[str] = (), ensures: Sequence[str] = (),
                  spec: SpecFn | None = None) -> Callable[[PassFn], Pass]:
    """Decorate a `(state, ctx) -> state` function as a pass with its contract and its stage's spec."""

    def wrap(fn: PassFn) -> Pass:
        return Pass(name, fn, tuple(requires), tuple(ensures), (fn.__doc__ or "").strip().split("\n")[0], spec)

    return wrap


class PassFailure(InternalError):
    """A pass crashed or broke its contract: a bug, reported with the pipeline position."""

    def __init__(self, pass_name: str, before: Sequence[str], reason: str) -> None:
        ran = ", ".join(before) if before else "none"
        super().__init__(f"pass '{pass_name}' failed (passes run before it: {ran}): {reason}")
        self.pass_name = pass_name
        self.before = tuple(before)


# --- graph invariants: a declarative list of (name, check) run between passes -----------------------

def _payloads_frozen(graph: JobGraph) -> str | None:
    for node in graph.nodes():
        if not node.spec.model_config.get("frozen"):
            return f"node {node.name} payload is not frozen"
    return None


def _edge_endpoints_exist(graph: JobGraph) -> str | None:
    names = {n.name for n in graph.nodes()}
    for edge in graph.edges():
        if edge.src not in names or edge.dst not in names:
            return f"edge {edge} has an endpoint outside the graph"
    return None


def _data_edges_acyclic(graph: JobGraph) -> str | None:
    if not nx.is_directed_acyclic_graph(graph.data_view()):
        return "data edges form a cycle"
    return None


def _weight_edges_from_train(graph: JobGraph) -> str | None:
    for edge in graph.weight_edges():
        if graph.node(edge.src).op != "train":
            return f"weight edge {edge.src} -> {edge.dst} does not start at a train op"
    return None


def _one_producer_per_port(graph: JobGraph) -> str | None:
    seen: set[tuple[str, str]] = set()
    for edge in graph.data_edges():
        key = (edge.dst, edge.dst_port)
        if key in seen:
            return f"input {edge.dst}.{edge.dst_port} has two producers"
        seen.add(key)
    return None


INVARIANTS: tuple[tuple[str, Callable[[JobGraph], str | None]], ...] = (
    ("payloads are frozen", _payloads_frozen),
    ("edges connect existing nodes", _edge_endpoints_exist),
    ("data edges are acyclic", _data_edges_acyclic),
    ("weight edges start at train ops", _weight_edges_from_train),
    ("one producer per input port", _one_producer_per_port),
)


def check_invariants(graph: JobGraph) -> list[str]:
    """Names and reasons of every violated invariant (empty when the graph is well formed)."""
    problems = []
    for name, check in INVARIANTS:
        reason = check(graph)
        if reason is not None:
            problems.append(f"{name}: {reason}")
    return problems


def run_passes(
    state: Compilation,
    ctx: CompileContext,
    passes: Sequence[Pass],
    *,
    check: bool = False,
    on_pass: Callable[[Pass, Compilation], None] | None = None,
    on_start: Callable[[Pass], None] | None = None,
) -> Compilation:
    """Run `passes` in order, enforcing each contract; `check` runs the graph invariants between passes
    and each pass's stage spec after it. `on_start` hears of each pass before it runs (a progress
    line), `on_pass` after."""
    done: list[str] = []
    for p in passes:
        if on_start is not None:
            on_start(p)
        missing = [fact for fact in p.requires if not state.has(fact)]
        if missing:
            raise PassFailure(p.name, done, f"requires {', '.join(missing)}, which no earlier pass ensured")
        try:
            result = p.fn(state, ctx)
        except GraphRLError:
            raise
        except InternalError:
            raise
        except LayoutError as exc:
            raise PlacementError(exc.message, fix=exc.fix) from None
        except Exception as exc:  # a bug in the pass: keep the pipeline position in the report
            raise PassFailure(p.name, done, f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(result, Compilation):
            raise PassFailure(p.name, done, f"returned {type(result).__name__}, not a Compilation")
        absent = [fact for fact in p.ensures if not result.has(fact)]
        if absent:
            raise PassFailure(p.name, done, f"did not ensure {', '.join(absent)}")
        if check:
            problems = check_invariants(result.graph) + (p.spec(result) if p.spec is not None else [])
            if problems:
                raise PassFailure(p.name, done, "; ".join(problems))
        state = result
        done.append(p.name)
        if on_pass is not None:
            on_pass(p, state)
    return state


__all__ = [
    "CompileContext", "DataEdge", "INVARIANTS", "Pass", "PassFailure", "SpecFn", "WeightEdge",
    "check_invariants", "compiler_pass", "run_passes",
]
