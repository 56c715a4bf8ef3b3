"""`compile_job`: job + cluster -> Plan, through the pipeline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from graphrl.errors import GraphRLError
from graphrl.ir import build_graph
from graphrl.schemas.capabilities import Target
from graphrl.schemas.cluster import ClusterSpec
from graphrl.schemas.job import JobSpec
from graphrl.schemas.plan import EpisodeSummary, Plan, WorkloadSummary

from graphrl.compiler.bind import run_bindings
from graphrl.compiler.hardware import resolve_hardware
from graphrl.compiler.passes import CompileContext, run_passes
from graphrl.compiler.pipeline import PIPELINE
from graphrl.compiler.roles import Workload
from graphrl.compiler.schedule import ProgramSettings
from graphrl.compiler.state import Compilation, need

if TYPE_CHECKING:  # the type only: the compiler takes a loaded job, it never loads one
    from graphrl.loader import LoadedJob


def compile_job(job: LoadedJob, cluster: ClusterSpec, *, check: bool = False, target: Target = "preview",
                **options: Any) -> Plan:
    """Run the whole pipeline; user errors are located in the job file. `target` 'run' keeps the search
    and the pin checks to what the executors run (`graphrl.schemas.capabilities`)."""
    return plan_of(compile_graph(job, cluster, check=check, target=target, **options), cluster)


def plan_of(state: Compilation, cluster: ClusterSpec) -> Plan:
    placed = need(state.placement, "placement")
    return Plan(
        job=state.job, cluster=cluster, hardware=placed.hardware, chosen=placed.chosen,
        baseline=placed.baseline, candidates_considered=placed.candidates_considered,
        candidates=list(placed.candidates), programs=state.programs,
        bindings=run_bindings(state.graph, placed.chosen), workload=summarize(placed.shape.workload),
        lora=placed.lora,
    )


def summarize(w: Workload) -> WorkloadSummary:
    """What the preview states of the step sizes its costs assumed."""
    lengths = w.response_lengths
    return WorkloadSummary(
        responses=w.responses, prompt_len=w.prompt_len, max_new_tokens=w.response_len, lengths=lengths.source,
        mean_response_tokens=lengths.mean, p90_response_tokens=lengths.quantile(0.9),
        longest_response_tokens=lengths.longest(w.responses), optimizer_steps=w.optimizer_steps,
        passes=w.updates_per_step, packed=w.pack, episodes=_episodes(w))


def _episodes(w: Workload) -> EpisodeSummary | None:
    e = w.episode
    if e is None:
        return None
    model, env = e.tokens(w.response_len)
    return EpisodeSummary(turns=e.turns, turn_tokens=e.turn_tokens, max_total_tokens=w.seq_len, model_tokens=model,
                          env_tokens=env, call_seconds=e.call_seconds, seconds_source=e.seconds_source)


def start(job: JobSpec) -> Compilation:
    """The state the pipeline starts from: the job's graph, programs for the job's own schedule."""
    return Compilation(build_graph(job), ProgramSettings.of(job))


def with_steps(job: JobSpec, steps: int | None) -> JobSpec:
    """`job` with `schedule.steps` set (the one route of a step count: the plan records it)."""
    if steps is None:
        return job
    return JobSpec.model_validate({**job.model_dump(), "schedule": {**job.schedule.model_dump(), "steps": steps}})


def compile_graph(job: LoadedJob, cluster: ClusterSpec, *, check: bool = False, steps: int | None = None,
                  progress: Callable[[str], None] | None = None, target: Target = "preview",
                  **options: Any) -> Compilation:
    """The pipeline's final state, with every pass's result (placement, programs ...). `steps` sets
    `schedule.steps`; `target` 'run' keeps the search and the pin checks to what the executors run;
    `progress` hears the name of each pass as it starts."""
    spec = with_steps(job.spec, steps)
    hardware = resolve_hardware(cluster)
    ctx = CompileContext(spec, cluster, hardware, dict(options), target)
    on_start = (lambda p: progress(p.name)) if progress is not None else None
    try:
        return run_passes(start(spec), ctx, PIPELINE, check=check, on_start=on_start)
    except GraphRLError as exc:
        if exc.path and exc.location is None:
            exc.location = job.source.locate(exc.path)
        raise


__all__ = ["compile_graph", "compile_job", "plan_of", "start", "with_steps"]
