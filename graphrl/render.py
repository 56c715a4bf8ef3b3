"""Renderings of the job graph: plain text, Graphviz DOT and JSON."""

from __future__ import annotations

import json
from typing import Any

from graphrl.ir import JobGraph


def _node_detail(node) -> str:  # noqa: ANN001
    spec = node.spec
    bits = []
    for key in ("model", "task", "fn", "estimator", "loss"):
        value = getattr(spec, key, None)
        if value is not None:
            bits.append(f"{key}={value}")
    return " ".join(bits)


def _env_detail(spec) -> str | None:  # noqa: ANN001
    """A generate node's environment loop in words, or None."""
    env = getattr(spec, "env", None)
    if env is None:
        return None
    return f"env {env.cls}: up to {env.max_turns} turns, {env.max_total_tokens} tokens, {env.timeout_s:g} s per call"


def graph_json(graph: JobGraph) -> dict[str, Any]:
    types = graph.sizes or {}
    return {
        "job": graph.job.name,
        "nodes": [
            {"name": n.name, "op": n.op, "model": n.model, "spec": n.spec.model_dump(mode="json", by_alias=True),
             "sizes": dict(types.get(n.name, {}))}
            for n in graph.nodes()
        ],
        "edges": [
            {"kind": "data", "src": e.src, "src_port": e.src_port, "dst": e.dst, "dst_port": e.dst_port,
             "schema": {k: str(v) for k, v in e.schema.fields.items()}}
            for e in graph.data_edges()
        ] + [{"kind": "weight", "src": e.src, "dst": e.dst, "model": e.model} for e in graph.weight_edges()],
        "warnings": list(graph.warnings),
    }


def graph_text(graph: JobGraph) -> str:
    lines = [f"job {graph.job.name}: {sum(1 for _ in graph.nodes())} nodes, "
             f"{len(graph.data_edges())} data edges, {len(graph.weight_edges())} weight edges"]
    types = graph.sizes or {}
    for name in graph.topo_order():
        node = graph.node(name)
        sizes = ", ".join(f"{k}={v}" for k, v in types.get(name, {}).items())
        lines.append(f"  {name:<12} {node.op:<9} {_node_detail(node)}" + (f"  [{sizes}]" if sizes else ""))
        for e in sorted(graph.in_edges(name), key=lambda e: e.dst_port):
            lines.append(f"      {e.dst_port:<12} <- {e.src}.{e.src_port}")
        if (env := _env_detail(node.spec)) is not None:
            lines.append(f"      {'loop':<12} <-> {env} (turn text out; reply, reward, done back)")
    for e in graph.weight_edges():
        lines.append(f"  weights {e.model}: {e.src} -> {e.dst}")
    return "\n".join(lines)


def _dot_id(name: str) -> str:
    return '"' + name.replace('"', r"\"") + '"'


_SHAPES = {"dataset": "cylinder", "train": "box3d", "generate": "box", "reward": "diamond",
           "advantage": "ellipse", "logprob": "box", "value": "box"}


def graph_dot(graph: JobGraph) -> str:
    out = [f"digraph {_dot_id(graph.job.name)} {{", "  rankdir=LR;", '  node [fontname="Helvetica"];',
           '  edge [fontname="Helvetica", fontsize=10];']
    for node in graph.nodes():
        label = f"{node.name}\\n{node.op}" + (f"\\n{_node_detail(node)}" if _node_detail(node) else "")
        out.append(f"  {_dot_id(node.name)} [label=\"{label}\", shape={_SHAPES.get(node.op, 'box')}];")
        if (env := _env_detail(node.spec)) is not None:  # the episode loop: a turn out, a reply back
            env_id = _dot_id(f"{node.name}/env")
            label = env.replace(": ", "\\n")
            out.append(f"  {env_id} [label=\"{label}\", shape=component, color=steelblue];")
            out.append(f"  {_dot_id(node.name)} -> {env_id} [label=\"turn\", color=steelblue];")
            out.append(f"  {env_id} -> {_dot_id(node.name)} [label=\"reply, reward, done\", color=steelblue];")
    for e in graph.data_edges():
        out.append(f"  {_dot_id(e.src)} -> {_dot_id(e.dst)} [label=\"{e.src_port}\"];")
    for e in graph.weight_edges():
        out.append(f"  {_dot_id(e.src)} -> {_dot_id(e.dst)} [style=dashed, color=firebrick, "
                   f"label=\"weights {e.model}\", constraint=false];")
    out.append("}")
    return "\n".join(out)


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=False)
