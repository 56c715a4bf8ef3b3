"""The compiler pipeline: one flat, ordered list of passes. Read it top to bottom.

Each pass is a small function over the compiler's typed state (`Compilation`): it reads the results it
requires, calls its stage (the modules beside this one plan, they never call each other's passes) and
returns the state with its own result. `run_passes` enforces the contracts, checks each stage's spec
between passes when asked (tests, `graphrl --debug`), and reports a failure with the pass's name and
the passes before it. This file is the only place passes are composed: the placement refinement runs
the pipeline's own program passes (`PROGRAM_PASSES`) on its best candidates.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from graphrl.ops import rollout_bytes_per_response
from graphrl.schemas.plan import Layout
from graphrl.schemas.program import CostKey, Programs

from graphrl.compiler.lower import check_lowered, lower_schedule
from graphrl.compiler.offload import check_offload, plan_offload
from graphrl.compiler.passes import CompileContext, Pass, compiler_pass, run_passes
from graphrl.compiler.place import check_placement, place_job
from graphrl.compiler.reshard import check_reshard, plan_reshard
from graphrl.compiler.roles import effective_mode
from graphrl.compiler.schedule import ProgramSettings, build_schedule, check_schedule
from graphrl.compiler.simulate import STEADY_WINDOW_STEPS, phase_breakdown, predicted_step, run_programs
from graphrl.compiler.state import Compilation, Verified, need
from graphrl.compiler.typecheck import typecheck
from graphrl.compiler.verify import verify_programs
from graphrl.compiler.weight_sync import check_weight_sync, plan_policy_sync, with_sync_timed

# Steps of the programs the placement refinement simulates per candidate (enough for an asynchronous
# pipeline to reach its steady state).
SIMULATE_RANKING_STEPS = 6
# The programs those simulations run: written out whole, as the simulator expands them anyway (a loop
# folded from longer transcripts and checked would give the same instructions, at twice the work).
RANKING_SETTINGS = ProgramSettings(steps=SIMULATE_RANKING_STEPS, checkpoint_every=0, periodic=False, stored=False)


@compiler_pass("typecheck", ensures=("types",))
def typecheck_pass(s: Compilation, ctx: CompileContext) -> Compilation:
    """Ports, schemas, symbolic shapes, producers and references of the job graph."""
    return replace(s, graph=typecheck(s.graph, ctx.cluster, ctx.target))


@compiler_pass("placement", requires=("types",), ensures=("placement",),
               spec=lambda s: check_placement(need(s.placement, "placement")))
def placement_pass(s: Compilation, ctx: CompileContext) -> Compilation:
    """Meshes and layouts per role; drops what does not fit; ranks by the analytical step time."""
    assert ctx.cluster is not None and ctx.hardware is not None
    placed = place_job(s.graph, ctx.cluster, ctx.hardware, ctx.target, exhaustive=bool(ctx.options.get("exhaustive")),
                       refine=not ctx.options.get("analytical_only"))
    return replace(s, placement=placed)


@compiler_pass("offload", requires=("placement",), ensures=("offload",),
               spec=lambda s: check_offload(need(s.offload, "offload"), need(s.placement, "placement").chosen))
def offload_pass(s: Compilation, ctx: CompileContext) -> Compilation:
    """What each role moves off its devices between uses (weights, gradients, optimizer state)."""
    return replace(s, offload=plan_offload(need(s.placement, "placement").chosen))


def _check_reshard(s: Compilation) -> list[str]:
    train, gen = need(s.placement, "placement").meshes()
    return check_reshard(need(s.reshard, "reshard"), gen, train)


@compiler_pass("reshard", requires=("placement",), ensures=("reshard",), spec=_check_reshard)
def reshard_pass(s: Compilation, ctx: CompileContext) -> Compilation:
    """Each step's responses, repartitioned from the generator replicas to the trainer's ranks."""
    placed = need(s.placement, "placement")
    train, gen = placed.meshes()
    w = placed.shape.workload
    # A piece crosses with the columns up to its longest response: at most a generator replica's longest.
    replicas = next((p.dp for p in placed.chosen.placements if p.kind == "generate"), 1)
    per_response = rollout_bytes_per_response(w.prompt_len, w.sent_response_len(w.responses / replicas), w.routes,
                                                 w.episode.columns if w.episode else 0)
    return replace(s, reshard=plan_reshard(gen, train, w.responses, w.samples_per_prompt, per_response))


def _check_weight_sync(s: Compilation) -> list[str]:
    placed = need(s.placement, "placement")
    return check_weight_sync(need(s.weight_sync, "weight_sync"), placed.shape, placed.chosen, s.settings.stored)


@compiler_pass("weight_sync", requires=("placement",), ensures=("weight_sync",), spec=_check_weight_sync)
def weight_sync_pass(s: Compilation, ctx: CompileContext) -> Compilation:
    """How each new policy version reaches the generator: DDMA copy or in-place reshard. A large DDMA plan is
    made on a second core while the passes up to lowering run (`WeightSyncPlan.planned`)."""
    placed = need(s.placement, "placement")
    return replace(s, weight_sync=plan_policy_sync(placed.shape, placed.chosen, placed.durations,
                                                   stored=s.settings.stored))


@compiler_pass("schedule", requires=("placement", "offload", "reshard", "weight_sync"), ensures=("schedule",),
               spec=lambda s: check_schedule(need(s.schedule, "schedule")))
def schedule_pass(s: Compilation, ctx: CompileContext) -> Compilation:
    """The order of every rank's instructions: versions per step, syncs, reshards, offloads, checkpoints."""
    placed = need(s.placement, "placement")
    return replace(s, schedule=build_schedule(s.graph, placed.shape, placed.chosen, need(s.offload, "offload"),
                                              need(s.reshard, "reshard"), need(s.weight_sync, "weight_sync"),
                                              s.settings))


@compiler_pass("lower", requires=("placement", "weight_sync", "schedule"), ensures=("programs",),
               spec=lambda s: check_lowered(need(s.programs, "programs"), need(s.schedule, "schedule")))
def lower_pass(s: Compilation, ctx: CompileContext) -> Compilation:
    """Each rank's typed program: prologue, periodic body, epilogue, with predicted durations."""
    placed, sync = need(s.placement, "placement"), need(s.weight_sync, "weight_sync")
    programs = lower_schedule(need(s.schedule, "schedule"), sync, placed.durations)
    # The layout's weight-sync operation shows the planned sync's cost (the search timed it from the layout).
    return replace(s, programs=programs, placement=replace(placed, chosen=with_sync_timed(placed.chosen, sync)))


# The passes that turn a placed layout into its programs: the pipeline runs them on the chosen layout,
# and the placement refinement, the baseline and `graphrl simulate` on other layouts, lengths and modes.
PROGRAM_PASSES: tuple[Pass, ...] = (
    weight_sync_pass,  # each new policy version -> generator: DDMA rounds (a large plan on a second core), or in place
    offload_pass,     # what each role moves off its devices between uses, and how many bytes
    reshard_pass,     # each step's responses: generator replicas -> trainer ranks, by prompt group
    schedule_pass,    # every rank's instruction order: versions per step (sync/async), checkpoints
    lower_pass,       # per-rank programs: prologue, one-step periodic body, epilogue; durations and the sync's plan
)


def programs_on(s: Compilation, ctx: CompileContext, layout: Layout, durations: Mapping[CostKey, float],
                settings: ProgramSettings) -> Programs:
    """The job's programs on `layout` (with its predicted `durations`) for the run `settings` describes,
    through the pipeline's own program passes."""
    placed = replace(need(s.placement, "placement"), chosen=layout, durations=durations)
    fresh = Compilation(s.graph, settings, placement=placed)
    return need(run_passes(fresh, ctx, PROGRAM_PASSES).programs, "programs")


def placed_programs(s: Compilation, settings: ProgramSettings, *, baseline: bool = False) -> Programs:
    """The programs of the chosen layout (or of the baseline) for the run `settings` describes."""
    placed = need(s.placement, "placement")
    layout, durations = (placed.baseline, placed.baseline_durations) if baseline else (placed.chosen, placed.durations)
    assert layout is not None and durations is not None, "no baseline layout for this job"
    return programs_on(s, CompileContext(s.job), layout, durations, settings)


@compiler_pass("refine_placement", requires=("placement",), ensures=("placement",))
def refine_placement_pass(s: Compilation, ctx: CompileContext) -> Compilation:
    """On a small cluster, choose among the best candidates by simulating their programs (the simulator
    sees queueing and pipelining that the analytical estimate does not). Only the choice: the chosen
    layout's predicted step time is the estimate pass's."""
    placed = need(s.placement, "placement")
    if not placed.contenders:
        return s
    def step_time(layout: Layout, durations: Mapping[CostKey, float]) -> float:
        programs = programs_on(s, ctx, layout, durations, RANKING_SETTINGS)
        return run_programs(programs, hw=placed.hardware, devices_per_node=placed.devices_per_node,
                            timed=True).step_time_s

    _, _, best = min(((step_time(c.layout, c.durations), c.layout.label, c) for c in placed.contenders),
                     key=lambda x: (x[0], x[1]))
    return replace(s, placement=replace(placed, ranking="simulated", chosen=best.layout, durations=best.durations,
                                        lora=best.lora, contenders=()))


def _estimated(layout: Layout, programs: Programs, s: Compilation) -> Layout:
    """`layout` with its one predicted step time: the simulator's steady state of `programs` over the one
    window (`predicted_step`), and the phases of the busiest rank's step (`phase_breakdown`), which add
    up to it."""
    placed = need(s.placement, "placement")
    result = predicted_step(programs, hw=placed.hardware, devices_per_node=placed.devices_per_node,
                            trace_ranks=set(range(programs.num_ranks)))
    estimate = layout.estimate.model_copy(update={"step_time_s": result.step_time_s, "method": "simulated",
                                                  "phases": phase_breakdown(result)})
    return layout.model_copy(update={"estimate": estimate})


def baseline_programs(s: Compilation, ctx: CompileContext, steps: int) -> Programs | None:
    """The baseline layout's programs (colocated, synchronous) for the first `steps` steps of the run, written
    out whole; None without a baseline."""
    placed = need(s.placement, "placement")
    if placed.baseline is None or placed.baseline_durations is None:
        return None
    return programs_on(s, ctx, placed.baseline, placed.baseline_durations,
                       ProgramSettings(steps=steps, mode="sync", periodic=False, stored=False))


@compiler_pass("baseline", requires=("placement",), ensures=("placement",))
def baseline_pass(s: Compilation, ctx: CompileContext) -> Compilation:
    """The baseline beside the chosen layout (colocated, synchronous): its own programs' steady state over the
    one window, on every cluster. It needs nothing of the chosen layout's programs, so it runs while a large
    weight-sync plan is still being made."""
    placed = need(s.placement, "placement")
    steps = min(s.settings.steps, STEADY_WINDOW_STEPS)
    base_programs = baseline_programs(s, ctx, steps)
    if placed.baseline is None or base_programs is None:
        return s
    return replace(s, placement=replace(placed, baseline=_estimated(placed.baseline, base_programs, s)))


@compiler_pass("estimate", requires=("placement", "programs"), ensures=("placement",))
def estimate_pass(s: Compilation, ctx: CompileContext) -> Compilation:
    """The plan's one predicted step time: the simulator's steady state of the chosen layout's own programs
    (the ones the plan stores and the ranks run) over the one window, with the preview's phases from the
    same simulation."""
    placed = need(s.placement, "placement")
    return replace(s, placement=replace(placed, chosen=_estimated(placed.chosen, need(s.programs, "programs"), s)))


@compiler_pass("verify", requires=("programs", "placement"), ensures=("verified",))
def verify_pass(s: Compilation, ctx: CompileContext) -> Compilation:
    """No deadlock, memory fits at every instruction, the staleness bound holds."""
    placed = need(s.placement, "placement")
    layout = placed.chosen
    mode = s.settings.mode or effective_mode(s.job.schedule.mode, layout.strategy)
    peak = verify_programs(need(s.programs, "programs"), layout, placed.usable_bytes, mode,
                           s.job.schedule.max_staleness)
    return replace(s, verified=Verified(peak_bytes=peak))


# What `graphrl validate` runs: needs only the job.
FRONT: tuple[Pass, ...] = (
    typecheck_pass,   # ports, schemas, symbolic shapes, one producer per input, acyclic data edges
)

# What `graphrl compile` runs: needs the cluster and its hardware.
PIPELINE: tuple[Pass, ...] = FRONT + (
    placement_pass,   # meshes and layouts per role; drops what does not fit; ranks by step time
    refine_placement_pass,  # small clusters: re-rank the best candidates by simulating PROGRAM_PASSES' programs
    *PROGRAM_PASSES[:-1],  # weight_sync, offload, reshard, schedule (above)
    baseline_pass,    # the baseline's step time, from its own programs, while the weight-sync plan is made
    lower_pass,       # the chosen layout's programs, with the sync's plan (above)
    estimate_pass,    # the plan's one step time and its phases: the simulator's steady state of those programs
    verify_pass,      # no deadlock, memory fits at every instruction, staleness bound holds
)


__all__ = ["FRONT", "PIPELINE", "PROGRAM_PASSES", "SIMULATE_RANKING_STEPS", "placed_programs", "programs_on"]
