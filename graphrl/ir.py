"""The job graph IR: op nodes, typed data edges, derived weight edges, over networkx.

`JobGraph` is immutable. Node and edge payloads are frozen; deriving a graph returns a new one
(`with_sizes`, `with_edges`), so tests can compare graphs and nothing can corrupt a graph it was given.
Typecheck attaches the symbolic sizes it unified; the compiler's other results (placement, programs ...)
are fields of its own typed state (`compiler/state.py`), not of the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterator, Literal, Mapping

import networkx as nx

from graphrl.errors import JobError
from graphrl.ops import OPS, op_kind, node_model
from graphrl.schemas.data import DataSchema
from graphrl.schemas.job import JobSpec, parse_ref


@dataclass(frozen=True)
class OpNode:
    """A node of the graph: its name, op kind and the user's spec."""

    name: str
    op: str
    spec: Any  # one of the NodeSpec models; frozen pydantic

    @property
    def model(self) -> str | None:
        return node_model(self.spec)


@dataclass(frozen=True)
class DataEdge:
    """A batch flowing from `src.src_port` to `dst.dst_port`."""

    src: str
    src_port: str
    dst: str
    dst_port: str
    schema: DataSchema
    kind: Literal["data"] = "data"


@dataclass(frozen=True)
class WeightEdge:
    """Updated weights of `model` flowing from its train op to another op that reads them."""

    src: str
    dst: str
    model: str
    kind: Literal["weight"] = "weight"


Edge = DataEdge | WeightEdge


@dataclass(frozen=True)
class JobGraph:
    """An immutable dataflow graph of one RL step; once type-checked, with its symbolic sizes."""

    job: JobSpec
    _g: nx.MultiDiGraph = field(repr=False)
    sizes: Mapping[str, Mapping[str, int]] | None = None
    """Per node, the value of each symbolic size of its ports (B, N, P, R ...); None until typecheck."""
    warnings: tuple[str, ...] = ()

    # -- reading -------------------------------------------------------------------------------
    def nodes(self) -> Iterator[OpNode]:
        for name in self._g.nodes:
            yield self._g.nodes[name]["payload"]

    def node(self, name: str) -> OpNode:
        return self._g.nodes[name]["payload"]

    def edges(self) -> Iterator[Edge]:
        for _, _, data in self._g.edges(data=True):
            yield data["payload"]

    def data_edges(self) -> list[DataEdge]:
        return [e for e in self.edges() if isinstance(e, DataEdge)]

    def weight_edges(self) -> list[WeightEdge]:
        return [e for e in self.edges() if isinstance(e, WeightEdge)]

    def in_edges(self, name: str) -> list[DataEdge]:
        return [d["payload"] for _, _, d in self._g.in_edges(name, data=True) if d["payload"].kind == "data"]

    def out_edges(self, name: str) -> list[DataEdge]:
        return [d["payload"] for _, _, d in self._g.out_edges(name, data=True) if d["payload"].kind == "data"]

    def data_view(self) -> nx.DiGraph:
        """The data-edge subgraph (must be a DAG)."""
        view = nx.DiGraph()
        view.add_nodes_from(self._g.nodes)
        view.add_edges_from((e.src, e.dst) for e in self.data_edges())
        return view

    def topo_order(self) -> list[str]:
        """Nodes in data-dependency order, ties broken by declaration order (deterministic)."""
        order = {name: i for i, name in enumerate(self._g.nodes)}
        return list(nx.lexicographical_topological_sort(self.data_view(), key=order.__getitem__))

    def nodes_of_model(self, model: str) -> list[OpNode]:
        return [n for n in self.nodes() if n.model == model]

    def node_sizes(self, name: str) -> Mapping[str, int]:
        """The symbolic sizes of node `name`'s ports, as typecheck unified them."""
        if self.sizes is None:
            raise AssertionError("the graph is not type-checked yet: its symbolic sizes are unknown")
        return self.sizes[name]

    # -- deriving new graphs -------------------------------------------------------------------
    def with_sizes(self, sizes: Mapping[str, Mapping[str, int]]) -> "JobGraph":
        frozen = MappingProxyType({k: MappingProxyType(dict(v)) for k, v in sizes.items()})
        return JobGraph(self.job, self._g, frozen, self.warnings)

    def with_warnings(self, *warnings: str) -> "JobGraph":
        return JobGraph(self.job, self._g, self.sizes, self.warnings + tuple(warnings))

    def with_edges(self, edges: list[Edge]) -> "JobGraph":
        """A copy whose edges are replaced by `edges` (node payloads are shared: they are frozen)."""
        g = nx.MultiDiGraph()
        g.add_nodes_from(self._g.nodes(data=True))
        for edge in edges:
            g.add_edge(edge.src, edge.dst, payload=edge)
        return JobGraph(self.job, g, self.sizes, self.warnings)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, JobGraph):
            return NotImplemented
        return (
            self.job == other.job
            and list(self.nodes()) == list(other.nodes())
            and sorted(map(repr, self.edges())) == sorted(map(repr, other.edges()))
        )

    __hash__ = None  # type: ignore[assignment]


def build_graph(job: JobSpec) -> JobGraph:
    """Make the graph of `job`: one node per op, one data edge per input reference, weight edges derived.

    References must resolve (the node exists and has that output port); everything else about types is
    the typecheck pass's job, so this function only fails where no edge could be drawn at all.
    """
    g = nx.MultiDiGraph()
    for name, spec in job.nodes.items():
        g.add_node(name, payload=OpNode(name=name, op=spec.op, spec=spec))

    for name, spec in job.nodes.items():
        kind = op_kind(spec)
        ports = kind.ports(spec)
        for port, ref in spec.inputs.items():
            path = ("nodes", name, "inputs", port)
            if port not in ports.inputs:
                allowed = ", ".join(ports.inputs) or "none"
                raise JobError(
                    f"op '{spec.op}' has no input port {port!r}",
                    path=path, fix=f"use one of its input ports: {allowed}",
                )
            src, src_port = parse_ref(ref)
            if src not in job.nodes:
                raise JobError(
                    f"reference {ref!r} names node {src!r}, which does not exist",
                    path=path, fix=f"use one of the nodes: {', '.join(job.nodes)}",
                )
            src_spec = job.nodes[src]
            src_ports = op_kind(src_spec).ports(src_spec)
            if src_port not in src_ports.outputs:
                allowed = ", ".join(f"{src}.{p}" for p in src_ports.outputs) or "none (it produces nothing)"
                raise JobError(
                    f"node {src!r} ({src_spec.op}) has no output port {src_port!r}",
                    path=path, fix=f"use one of: {allowed}",
                )
            edge = DataEdge(src, src_port, name, port, src_ports.outputs[src_port].schema)
            g.add_edge(src, name, payload=edge)

    warnings: list[str] = []
    for name, spec in job.nodes.items():
        model = node_model(spec)
        if model is not None and model not in job.models:
            raise JobError(
                f"model {model!r} is not declared",
                path=("nodes", name, "model"), fix=f"declare it under 'models' or use one of: {', '.join(job.models)}",
            )

    trainers: dict[str, str] = {}
    for name, spec in job.nodes.items():
        if spec.op == "train":
            if spec.model in trainers:
                raise JobError(
                    f"model {spec.model!r} is trained by two nodes ({trainers[spec.model]!r} and {name!r})",
                    path=("nodes", name, "model"), fix="train each model in exactly one train node",
                )
            trainers[spec.model] = name
    for model, trainer in trainers.items():
        for name, spec in job.nodes.items():
            if name != trainer and node_model(spec) == model:
                g.add_edge(trainer, name, payload=WeightEdge(trainer, name, model))

    used = {node_model(s) for s in job.nodes.values()}
    for model, mspec in job.models.items():
        if mspec.lora is not None and model not in trainers:
            raise JobError(f"model {model!r} has LoRA adapters but no train node trains it: adapters are what a "
                           "trained model learns", path=("models", model, "lora"),
                           fix=f"remove lora from {model!r}, or train it (a train node with model: {model})")
        if mspec.lora is not None and job.nodes[trainers[model]].loss == "critic":
            raise JobError(f"model {model!r} is a critic: its value head is trained whole, which LoRA's frozen base "
                           "leaves out", path=("models", model, "lora"), fix="train the critic in full (remove lora)")
        if mspec.init_from is not None and mspec.init_from not in job.models:
            raise JobError(
                f"init_from names model {mspec.init_from!r}, which is not declared",
                path=("models", model, "init_from"), fix=f"use one of: {', '.join(job.models)}",
            )
        if model not in used:
            warnings.append(f"models.{model}: declared but no node uses it; it is ignored")
    return JobGraph(job, g, MappingProxyType({}), tuple(warnings))


__all__ = ["DataEdge", "Edge", "JobGraph", "OPS", "OpNode", "WeightEdge", "build_graph"]
