"""The job as the executors run it: every node's settings and input producers, every role's head and
learning rate, resolved once here so that no rank rebuilds or searches the job graph."""

from __future__ import annotations

from graphrl.compiler.roles import lora_bases
from graphrl.ir import JobGraph
from graphrl.schemas.job import JobSpec
from graphrl.schemas.plan import Layout, NodeBinding, PortSource, RoleBinding, RunBindings


def run_bindings(graph: JobGraph, layout: Layout) -> RunBindings:
    """Bind `graph`'s nodes and `layout`'s roles for the executors."""
    job: JobSpec = graph.job
    nodes = {}
    for node in graph.nodes():
        inputs = {e.dst_port: PortSource(node=e.src, port=e.src_port, op=graph.node(e.src).op)
                  for e in graph.in_edges(node.name)}
        nodes[node.name] = NodeBinding(spec=node.spec, inputs=inputs)
    ops = [graph.node(n) for n in graph.topo_order()]
    generate = next(n for n in ops if n.op == "generate")
    dataset = next(n for n in ops if n.op == "dataset")
    # A model read by a value or reward op carries a scalar head (a critic, a reward model).
    scalar = {n.spec.model for n in ops if n.op in ("value", "reward") and getattr(n.spec, "model", None)}
    lr_of = {n.spec.model: n.spec.lr or job.algorithm.lr for n in ops if n.op == "train"}
    roles = {p.role: RoleBinding(model=p.model, head="value" if p.model in scalar else "lm",
                                 lr=lr_of[p.model] if p.kind == "train" else None)
             for p in layout.placements}
    return RunBindings(nodes=nodes, roles=roles, generate_node=generate.name, dataset_node=dataset.name,
                       policy_model=generate.spec.model, last_train_node=[n for n in ops if n.op == "train"][-1].name,
                       bases=lora_bases(job))


__all__ = ["run_bindings"]
