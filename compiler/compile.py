"""`compile_job`: job + cluster -> Plan, through the pipeline."""

from __future__ import annotations

from typing import Any, Callable

from graphrl.errors import GraphRLError
from graphrl.ir import JobGraph, build_graph
from graphrl.loader import LoadedJob
from graphrl.schemas.capabilities import Target
from graphrl.schemas.cluster import ClusterSpec
from graphrl.schemas.plan import Plan

from graphrl.compiler.hardware import resolve_hardware
from graphrl.compiler.placed import PlacedLayout
from graphrl.compiler.passes import CompileContext, run_passes
from graphrl.compiler.pipeline import PIPELINE


def compile_job(job: LoadedJob, cluster: ClusterSpec, *, check: bool = False, target: Target = "preview",
                **options: Any) -> Plan:
    """Run the whole pipeline; user errors are located in the job file. `target` 'run' keeps the search
    and the pin checks to what the executors run (`graphrl.schemas.capabilities`)."""
    graph = compile_graph(job, cluster, check=check, target=target, **options)
    return plan_of(graph, cluster)


def plan_of(graph: JobGraph, cluster: ClusterSpec) -> Plan:
    placed: PlacedLayout = graph["placement"]
    return Plan(
        job=graph.job, cluster=cluster, hardware=placed.hardware, chosen=placed.chosen,
        baseline=placed.baseline, candidates_considered=placed.candidates_considered,
        candidates=list(placed.candidates), programs=graph.attrs.get("programs"),
    )


def compile_graph(job: LoadedJob, cluster: ClusterSpec, *, check: bool = False,
                  progress: Callable[[str], None] | None = None, target: Target = "preview",
                  **options: Any) -> JobGraph:
    """The final graph of the pipeline, with every pass's attributes (placement, programs ...).
    `progress` hears the name of each pass as it starts."""
    hardware = resolve_hardware(cluster)
    ctx = CompileContext(job.spec, cluster, hardware, dict(options), target)
    on_start = (lambda p: progress(p.name)) if progress is not None else None
    try:
        graph = run_passes(build_graph(job.spec), ctx, PIPELINE, check=check, on_start=on_start)
    except GraphRLError as exc:
        if exc.path and exc.location is None:
            exc.location = job.source.locate(exc.path)
        raise
    return graph
