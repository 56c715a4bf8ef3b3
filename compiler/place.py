"""The cost-annotation and placement passes."""

from __future__ import annotations

from types import MappingProxyType

from graphrl.ir import JobGraph

from graphrl.compiler import cost
from graphrl.compiler.passes import CompileContext, compiler_pass
from graphrl.compiler.placement import make_problem, search, summaries, to_layout
from graphrl.compiler.roles import derive_roles, derive_workload


@compiler_pass("annotate_costs", requires=("types",), ensures=("costs",))
def annotate_costs(graph: JobGraph, ctx: CompileContext) -> JobGraph:
    """Per role: parameter count and FLOPs of one step's work (the inputs of placement)."""
    work = derive_workload(graph)
    costs = {}
    for role in derive_roles(graph):
        params = cost.param_count(role.dims)
        if role.kind == "train":
            flops = cost.train_flops(role.dims, work.tokens, work.seq_len, recompute=False) * work.updates_per_step
        elif role.kind == "generate":
            flops = cost.forward_flops_per_token(role.dims, cost.causal_mean_context(work.seq_len)) * work.tokens
        else:
            flops = cost.forward_flops_per_token(role.dims, cost.causal_mean_context(work.seq_len)) * work.tokens
        costs[role.name] = MappingProxyType({"params": params, "flops_per_step": flops})
    return graph.with_attr("costs", MappingProxyType(costs))


@compiler_pass("placement", requires=("types", "costs"), ensures=("placement",))
def place(graph: JobGraph, ctx: CompileContext) -> JobGraph:
    """Search layouts; keep the best, the colocated-synchronous baseline and the candidate summaries."""
    assert ctx.cluster is not None and ctx.hardware is not None
    problem = make_problem(graph, ctx.cluster, ctx.hardware)
    result = search(problem, exhaustive=bool(ctx.options.get("exhaustive", False)))
    placement = MappingProxyType({
        "chosen": to_layout(problem, result.best),
        "baseline": to_layout(problem, result.baseline) if result.baseline else None,
        "considered": result.considered,
        "candidates": summaries(result),
    })
    return graph.with_attr("placement", placement)
