"""The `graphrl` command line.

Every user error is printed as one or two lines (`place: message` and `fix: ...`) with exit code 2 and
no traceback; `--debug` shows the traceback. Commands:

  validate JOB          check a job (YAML or Python) and print a summary
  schema                JSON Schema of the job file (for editors)
  graph JOB             the job graph as text, Graphviz DOT or JSON
  import SRC OUT_DIR    convert a GGUF file or HF folder once into a safetensors folder with its tokenizer
  export RUN_DIR -o OUT a run's trained policy as a Hugging Face folder (or a PEFT adapter, --adapter)
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import signal
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import click
from pydantic import ValidationError

from graphrl import __version__
from graphrl.errors import (GraphRLError, GraphRLWarning, InternalError, Interrupted, JobError, Location, RunError,
                            format_path)
from graphrl.ir import JobGraph, build_graph
from graphrl.loader import LoadedJob, Override, SourceMap, apply_overrides, job_cluster, load_job, parse_override
from graphrl.schemas.cluster import ClusterSpec
from graphrl.schemas.job import SCHEDULE_MODES, JobSpec
from graphrl.writes import job_inputs, refuse_overwriting_inputs, write_atomically

EXIT_USER_ERROR = 2


class Terminated(BaseException):
    """SIGTERM while a command works (a run's launcher takes it itself while its ranks run): raised like
    Ctrl-C's KeyboardInterrupt, so that what the command holds is released on the way out."""


def _raise_terminated(signum: int, frame: Any) -> None:  # noqa: ARG001
    raise Terminated


# Commands that only read and print or write files they close: the `graphrl` program ends them without the
# interpreter's teardown (`command`), which at 405B frees a plan's millions of objects one by one (~0.3 s).
PREVIEW_COMMANDS = frozenset({"validate", "graph", "compile", "simulate", "inspect"})
_invoked: list[str] = []  # the subcommand this process ran


class GraphRLGroup(click.Group):
    """A click group that turns our errors into two-line messages with exit code 2 (an interrupted command:
    128 + the signal's number), and Ctrl-C or SIGTERM into one line without a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        _invoked.append(ctx.invoked_subcommand or "")
        debug = bool(ctx.params.get("debug")) or "--debug" in sys.argv
        main_thread = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
        if main_thread:
            signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            with warnings.catch_warnings():
                show_graphrl_warnings()
                return super().invoke(ctx)
        except (KeyboardInterrupt, Terminated) as exc:
            if main_thread:  # a second Ctrl-C while this is said changes nothing
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            signum = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
            what = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
            click.echo(f"stopped: {what} ended `graphrl {ctx.invoked_subcommand or ''}` before it finished"
                       "; it left nothing half-written", err=True)
            ctx.exit(128 + signum)
        except GraphRLError as exc:
            if debug:
                traceback.print_exc()
            click.echo(f"{exc.kind}: {exc.render()}", err=True)
            ctx.exit(getattr(exc, "exit_code", EXIT_USER_ERROR))
        except InternalError as exc:
            if debug:
                traceback.print_exc()
            click.echo(f"internal error (a bug in graphrl; please report it): {exc}", err=True)
            ctx.exit(1)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def show_graphrl_warnings() -> None:
    """Print each of our warnings (`GraphRLWarning`) once, on one line of stderr as `warning: message`,
    however often the command meets it (a job compiled twice reads its calibration file twice); other
    warnings keep Python's display. Call inside `warnings.catch_warnings()`, which undoes it."""
    shown: set[str] = set()
    python_show = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if not issubclass(category, GraphRLWarning):
            python_show(message, category, filename, lineno, file, line)
        elif str(message) not in shown:
            shown.add(str(message))
            click.echo(f"warning: {message}", err=True)

    warnings.simplefilter("always", GraphRLWarning)  # the once-only rule is ours, by message, above
    warnings.showwarning = show


def _script_location(script: Path, exc: BaseException) -> Location:
    """The line of `script` that the exception passed through last (the user's call that failed)."""
    target = script.resolve()
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == target]
    return Location(str(script), lines[-1] if lines else None)


def _run_script(p: Path) -> Any:
    """The JobSpec a Python job file builds: it runs with sys.argv of its own path only (graphrl's command
    line is not its arguments), and a `sys.exit` in it (argparse's, for one) is an error of the job's,
    located at its line, never the end of graphrl. What it writes on stderr is shown after it ran, or
    (its last line: argparse's complaint) in that error."""
    import contextlib
    import io

    from graphrl.loader import importable

    argv, captured = sys.argv, io.StringIO()
    sys.argv = [str(p)]
    importable(p.parent)
    try:  # build_job() runs inside the try too: its mistakes are the script's, located in it
        with contextlib.redirect_stderr(captured):
            namespace = runpy.run_path(str(p))
            factory: Callable[[], Any] | None = namespace.get("build_job")
            spec = factory() if callable(factory) else namespace.get("job")
    except SystemExit as exc:
        said = [line for line in captured.getvalue().splitlines() if line.strip()]
        call = "sys.exit()" if exc.code is None else f"sys.exit({exc.code!r})"
        raise JobError(f"the Python job called {call} while graphrl read it" + (f": {said[-1].strip()}" if said else ""),
                       location=_script_location(p, exc),
                       fix="a job file is read, not run: build the job in build_job() without sys.exit or argument "
                           "parsing, and keep those under `if __name__ == \"__main__\":` (it gets no arguments)") from None
    except Exception:
        sys.stderr.write(captured.getvalue())
        raise
    finally:
        sys.argv = argv
    sys.stderr.write(captured.getvalue())
    return spec


def load_any(path: str, overrides: Sequence[Override] = ()) -> LoadedJob:
    """A job from YAML, or from a Python file defining `build_job()` (or a `job` JobSpec), with `overrides`
    applied before the files it names are checked."""
    p = Path(path)
    if p.suffix != ".py":
        return load_job(p, overrides)
    if not p.exists():
        raise JobError(f"file not found: {p}", fix="check the path")
    try:
        spec = _run_script(p)
    except GraphRLError as exc:
        raise exc.located(_script_location(p, exc))
    except Exception as exc:
        first_line = (str(exc).splitlines() or [""])[0]  # pydantic's messages span many lines
        if isinstance(exc, ValidationError):
            err = exc.errors()[0]
            first_line = f"{exc.title}: {format_path(err['loc'])}: {err['msg']}"
        raise JobError(f"running the Python job raised {type(exc).__name__}: {first_line}",
                       location=_script_location(p, exc),
                       fix="fix the script (rerun with --debug for the traceback)") from exc
    if not isinstance(spec, JobSpec):
        raise JobError("a Python job file must define build_job() returning a JobSpec (or a `job` variable)",
                       location=Location(str(p)), fix="see examples/grpo_tiny.py")
    from graphrl.loader import with_files_resolved

    loaded = LoadedJob(spec, SourceMap(str(p)), p)
    return apply_overrides(loaded, overrides) if overrides else with_files_resolved(loaded)


def set_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--set KEY=VALUE` (repeatable): change any job field by its dotted path, validated like the file."""
    return click.option(
        "--set", "sets", multiple=True, metavar="KEY=VALUE",
        help="Override a job field by dotted path, e.g. --set schedule.checkpoint_every=20 "
             "--set placement.roles.policy/generate.tp=2 (repeatable; VALUE is read as YAML).")(fn)


def load_with_sets(path: str, sets: tuple[str, ...] = ()) -> LoadedJob:
    """A job (YAML or Python) with the `--set` overrides applied in the order given."""
    return load_any(path, [parse_override(text) for text in sets])


def checked_graph(job: LoadedJob, cluster: ClusterSpec | None = None, target: str = "preview") -> JobGraph:
    """Build and typecheck the graph (pins against `cluster` when given, and against what the executors
    run when `target` is 'run'); errors are located in the job file."""
    from graphrl.compiler.typecheck import typecheck

    try:
        return typecheck(build_graph(job.spec), cluster, target)  # type: ignore[arg-type]
    except GraphRLError as exc:
        if exc.path and exc.location is None:
            exc.location = job.source.locate(exc.path)
        raise


def warn(graph: JobGraph) -> None:
    for warning in graph.warnings:
        click.echo(f"warning: {warning}", err=True)


@click.group(cls=GraphRLGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="graphrl")
@click.option("--debug", is_flag=True, help="Show tracebacks of errors; check every compiler stage's spec between passes.")
def main(debug: bool) -> None:
    """graphrl: compile RL jobs for LLMs, written as typed dataflow graphs, into placed per-rank programs."""


@main.command()
@click.argument("job", type=click.Path(dir_okay=True, path_type=str))
@click.option("--target", type=click.Choice(["run", "preview"]), default="run", show_default=True,
              help="run: the pins must be ones the executors run; preview: `graphrl compile` may also lay out "
                   "preview-only pins (pp > 1).")
@set_option
def validate(job: str, target: str, sets: tuple[str, ...]) -> None:
    """Check JOB (a YAML file, or a Python file with build_job()) and print a one-line summary."""
    loaded = load_with_sets(job, sets)
    # The job's default cluster must resolve too, and its pins must fit that cluster's devices.
    cluster = job_cluster(loaded, None) if loaded.spec.cluster is not None else None
    graph = checked_graph(loaded, cluster, target)
    warn(graph)
    n_nodes = sum(1 for _ in graph.nodes())
    click.echo(
        f"ok: {job}: job {loaded.spec.name!r}, {len(loaded.spec.models)} models, {n_nodes} nodes, "
        f"{len(graph.data_edges())} data edges, {len(graph.weight_edges())} weight edges"
    )


@main.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write to a file.")
@click.option("--plan", "of_plan", is_flag=True,
              help="The schema of a plan file's content instead (every record and instruction field described).")
def schema(output: Path | None, of_plan: bool) -> None:
    """Print the JSON Schema of the job file (for editors: yaml-language-server), or with --plan of a plan file."""
    if of_plan:
        from graphrl.schemas.plan import plan_json_schema

        text = json.dumps(plan_json_schema(), indent=2)
    else:
        text = json.dumps(JobSpec.model_json_schema(), indent=2)
    if output is None:
        click.echo(text)
    else:
        output.write_text(text + "\n")
        click.echo(f"wrote {output}")


@main.command()
@click.argument("job", type=click.Path(path_type=str))
@click.option("--format", "fmt", type=click.Choice(["text", "dot", "json"]), default="text", show_default=True)
@set_option
def graph(job: str, fmt: str, sets: tuple[str, ...]) -> None:
    """Print the typed job graph of JOB."""
    from graphrl.render import dumps, graph_dot, graph_json, graph_text

    g = checked_graph(load_with_sets(job, sets))
    warn(g)
    click.echo({"text": graph_text, "dot": graph_dot, "json": lambda g: dumps(graph_json(g))}[fmt](g))



def compile_loaded_graph(loaded: LoadedJob, cluster: str | None, **options):  # noqa: ANN201
    """(compiled graph, its plan) of a loaded job, with a progress line on a terminal; the compiler's
    warnings (pins a layout ignores, ...) go to stderr."""
    from graphrl.compiler.compile import compile_graph, plan_of
    from graphrl.progress import progress

    resolved = job_cluster(loaded, cluster)
    root = click.get_current_context(silent=True)
    check = bool(root is not None and root.find_root().params.get("debug"))
    with progress(f"compiling {loaded.spec.name}") as report:
        state = compile_graph(loaded, resolved, progress=report, check=check, **options)
    warn(state.graph)
    return state, plan_of(state, resolved)


def compile_loaded(loaded: LoadedJob, cluster: str | None, **options):  # noqa: ANN201
    """The plan of a loaded job (see `compile_loaded_graph`)."""
    return compile_loaded_graph(loaded, cluster, **options)[1]


def _compile(job: str, cluster: str | None, sets: tuple[str, ...] = (), *, steps: int | None = None,
             **options):  # noqa: ANN201
    return compile_loaded(_override(load_with_sets(job, sets), steps=steps), cluster, **options)


@main.command(name="compile")
@click.argument("job", type=click.Path(path_type=str))
@click.option("--cluster", "-c", help="Cluster preset (local-cpu-2 ...) or cluster YAML file; overrides the job's.")
@click.option("--plan", "show_plan", is_flag=True, help="Print the plan preview (the default when -o is not given).")
@click.option("--explain", is_flag=True, help="Also list the candidates considered and why each was rejected.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "html"]), default="text", show_default=True,
              help="Preview format.")
@click.option("--exhaustive", is_flag=True, help="Combine every generator and trainer layout (slower; small clusters).")
@click.option("--steps", type=int, help="Steps to unroll into the programs (default: the job's).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the plan (msgpack) to this file; with --format html/json, write the preview here instead.")
@set_option
def compile_cmd(job: str, cluster: str | None, show_plan: bool, explain: bool, fmt: str, exhaustive: bool,
                steps: int | None, output: Path | None, sets: tuple[str, ...]) -> None:
    """Compile JOB for a cluster: place every role, insert transfers, and preview the plan."""
    from graphrl.compiler.preview import render_html, render_text
    from graphrl.plan_io import save_plan

    loaded = _override(load_with_sets(job, sets), steps=steps)
    if output is not None:  # before compiling: a refusal costs nothing
        refuse_overwriting_inputs(output, _inputs(loaded, cluster), "-o", output.with_name(
            {"text": "plan.msgpack", "json": "plan.json", "html": "plan.html"}[fmt]))
    plan = compile_loaded(loaded, cluster, exhaustive=exhaustive)
    if output is not None and fmt == "text":
        save_plan(plan, output)
        click.echo(f"wrote {output} ({plan.chosen.label}, {plan.chosen.estimate.step_time_s:.4g} s/step predicted)",
                   err=True)
        if not show_plan:
            return
    if fmt == "json":
        out = json.dumps(plan.preview_dict(), indent=2)
    elif fmt == "html":
        out = render_html(plan)
    else:
        out = render_text(plan, explain=explain)
    if output is not None and fmt != "text":
        write_atomically(output, out)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(out)


@main.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Hardware file to write (default: $GRAPHRL_CALIBRATION or ~/.cache/graphrl/cpu-local.json).")
@click.option("--no-p2p", is_flag=True, help="Skip the multi-process gloo measurements (point-to-point, collectives).")
@click.option("--max-ranks", type=click.IntRange(2, 16), default=4, show_default=True,
              help="Measure collectives on 2 to this many local processes.")
@click.argument("jobs", nargs=-1, type=click.Path(exists=True, dir_okay=False))
def calibrate(output: Path | None, no_p2p: bool, max_ranks: int, jobs: tuple[str, ...]) -> None:
    """Measure this machine (matmul, memory, the executor's model code, gloo point-to-point and collectives)
    for the cpu-local hardware preset. With JOB files, also every matmul shape of their models (in their
    dtype, with their threads per rank) and their models' own code at reduced depth."""
    from graphrl.calibration import calibrate as run_calibration, write_calibration
    from graphrl.compiler.hardware import calibration_path

    target = output or calibration_path()
    if target is None:
        raise click.UsageError("GRAPHRL_CALIBRATION=none disables calibration files; pass -o FILE")
    refuse_overwriting_inputs(target, [Path(job) for job in jobs], "-o", target.with_name("cpu-local.json"))
    spec = run_calibration(report=lambda s: click.echo(s, err=True), with_p2p=not no_p2p, max_ranks=max_ranks,
                           jobs=jobs)
    write_calibration(spec, target)
    click.echo(f"wrote {target}: peak {spec.peak_bf16_flops / 1e9:.1f} GFLOP/s, {len(spec.matmuls)} matmul shapes, "
               f"memory {spec.memory_bandwidth / 1e9:.1f} GB/s (elementwise {spec.elementwise_rate / 1e9:.1f}), "
               f"p2p {spec.intra_node_bandwidth / 1e9:.2f} GB/s, {len(spec.collectives)} collective fits")


def _is_plan_file(target: str) -> bool:
    from graphrl.plan_io import MAGIC

    path = Path(target)
    return path.suffix in (".msgpack", ".plan") or (path.is_file() and path.read_bytes()[:64].find(MAGIC.encode()) >= 0)


def _load_plan_or_compile(target: str, cluster: str | None, **options):  # noqa: ANN201
    """A plan file (msgpack) as it is, once its programs are proven to run, or a job compiled now."""
    from graphrl.compiler.verify import runnable_plan
    from graphrl.plan_io import load_plan

    if _is_plan_file(target):
        if options.get("steps") or cluster:
            click.echo("warning: --steps and --cluster are ignored for a compiled plan file", err=True)
        return runnable_plan(load_plan(Path(target)), target)
    return _compile(target, cluster, **options)


def _rank_section(title: str, instructions: list, limit: int, note: str = "") -> None:
    from graphrl.schemas.program import describe

    click.echo(f"  {title}: {len(instructions)} instructions{note}")
    for i, ins in enumerate(instructions if limit == 0 else instructions[:limit]):
        click.echo(f"    {i:>5}  {describe(ins)}")
    if limit and len(instructions) > limit:
        click.echo(f"    ... {len(instructions) - limit} more (--limit 0 shows all)")


@main.command()
@click.argument("plan", type=click.Path(path_type=str))
@click.option("--rank", "-r", type=int, multiple=True, help="Only these ranks (repeatable). Default: one per mesh.")
@click.option("--all-ranks", is_flag=True, help="Every rank.")
@click.option("--step", "step", type=click.IntRange(min=0), help="Show the instructions of this step as they will execute.")
@click.option("--limit", type=int, default=60, show_default=True, help="Instructions shown per section (0 = all).")
def inspect(plan: str, rank: tuple[int, ...], all_ranks: bool, step: int | None, limit: int) -> None:
    """Print the per-rank programs of PLAN (a plan file, or a job compiled on the fly): each rank's
    prologue, loop body (steps and versions relative to the loop counter k) and epilogue (relative to
    the step count); with --step K, the instructions of step K with absolute operands."""
    from graphrl.errors import GraphRLError

    p = _load_plan_or_compile(plan, None)
    if p.programs is None:
        raise GraphRLError("this plan has no programs", fix="compile it with `graphrl compile JOB -o plan.msgpack`")
    progs = p.programs
    if step is not None and step >= progs.steps:
        raise GraphRLError(f"step {step} does not exist; the plan runs steps 0-{progs.steps - 1}",
                           fix="pick a step in range")
    if all_ranks:
        ranks = list(range(progs.num_ranks))
    elif rank:
        bad = [r for r in rank if not 0 <= r < progs.num_ranks]
        if bad:
            raise GraphRLError(f"rank {bad[0]} does not exist; the plan has ranks 0-{progs.num_ranks - 1}",
                               fix="pick a rank in range")
        ranks = list(rank)
    else:
        ranks = sorted({m.first_device for m in p.chosen.meshes})
    click.echo(f"plan {p.job.name}: {progs.num_ranks} ranks, {progs.steps} steps, {progs.num_instructions} "
               f"instructions stored, {p.chosen.label}")
    for g, members in progs.groups.items():
        shown = f"{members[0]}-{members[-1]}" if len(members) > 1 and list(members) == list(range(members[0], members[-1] + 1)) else ",".join(map(str, members))
        click.echo(f"  group {g}: {shown}")
    for r in ranks:
        program = progs.ranks[r]
        click.echo(f"\nrank {r}:")
        if step is not None:
            from graphrl.schemas.program import describe

            executed = program.step_view(progs.steps, step, progs.checkpoint_every)
            click.echo(f"  step {step}: {len(executed)} instructions")
            for where, ins in executed if limit == 0 else executed[:limit]:
                click.echo(f"    {where:<16}  {describe(ins)}")
            continue
        loop = program.iterations(progs.steps)
        _rank_section("prologue", program.prologue, limit)
        _rank_section("body", program.body, limit, f", run for k = {loop.start}..{loop.stop - 1}"
                      if len(loop) and program.body else "")
        _rank_section("epilogue", program.epilogue, limit, " (steps relative to the step count)" if program.epilogue else "")


@main.command()
@click.argument("target", type=click.Path(path_type=str))
@click.option("--cluster", "-c", help="Cluster preset or file (for a JOB).")
@click.option("--steps", type=int, help="Steps of the run (default: the job's; for a JOB only).")
@click.option("--trace", type=click.Path(dir_okay=False, path_type=Path), help="Write a Chrome trace JSON (Perfetto).")
@click.option("--gantt/--no-gantt", default=True, show_default=True, help="Print a text Gantt chart.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@set_option
def simulate(target: str, cluster: str | None, steps: int | None, trace: Path | None, gantt: bool, fmt: str,
             sets: tuple[str, ...]) -> None:
    """Simulate TARGET: a plan file exactly as it is, or a job compiled once (then also its sync and async
    schedules and the baseline layout). Seconds per step, busy fractions, timeline."""
    from graphrl.compiler.simreport import simulate_report
    from graphrl.progress import progress

    if _is_plan_file(target):
        if sets:
            click.echo("warning: --set changes a job; it is ignored for a compiled plan file", err=True)
        if trace is not None:
            refuse_overwriting_inputs(trace, [Path(target)], "--trace", trace.with_name("trace.json"))
        plan, graph = _load_plan_or_compile(target, cluster, steps=steps), None
    else:
        loaded = _override(load_with_sets(target, sets), steps=steps)
        if trace is not None:
            refuse_overwriting_inputs(trace, _inputs(loaded, cluster), "--trace", trace.with_name("trace.json"))
        graph, plan = compile_loaded_graph(loaded, cluster)
    with progress(f"simulating {plan.job.name} on {plan.programs.num_ranks if plan.programs else 0} ranks") as stage:
        report = simulate_report(plan, compiled=graph, trace_path=trace, gantt=gantt and fmt == "text", progress=stage)
    click.echo(json.dumps(report.data, indent=2) if fmt == "json" else report.text)


def _inputs(loaded: LoadedJob, cluster: str | None) -> list[Path]:
    """What a command on `loaded` reads: the job's files and a --cluster file."""
    extra = [Path(cluster)] if cluster is not None and Path(cluster).is_file() else []
    return [*job_inputs(loaded), *extra]


def _override(loaded: LoadedJob, *, steps: int | None = None, seed: int | None = None, schedule: str | None = None,
              strategy: str | None = None) -> LoadedJob:
    """The run options that are shorthands for job fields (`--steps 5` is `--set schedule.steps=5`)."""
    flags = [(("schedule", "steps"), steps, f"--steps {steps}"), (("run", "seed"), seed, f"--seed {seed}"),
             (("schedule", "mode"), schedule, f"--schedule {schedule}"),
             (("placement", "strategy"), strategy, f"--strategy {strategy}")]
    overrides = [Override(path, value, origin) for path, value, origin in flags if value is not None]
    if strategy == "colocated":  # every role shares every device: device ranges no longer apply
        overrides += [Override(("placement", "roles", role, "devices"), None, "--strategy colocated")
                      for role, hint in loaded.spec.placement.roles.items() if hint.devices is not None]
    return apply_overrides(loaded, overrides)


def refuse_unrunnable(plan, loaded: LoadedJob) -> None:  # noqa: ANN001
    """Stop before starting ranks when the plan holds a choice the executors do not run
    (`graphrl.schemas.capabilities`), naming the pin that asked for it where there is one."""
    from graphrl.errors import RunError
    from graphrl.schemas.capabilities import plan_refusals

    refusals = plan_refusals(plan)
    if not refusals:
        return
    first = refusals[0]
    hint = loaded.spec.placement.roles.get(first.role)
    pinned = hint is not None and getattr(hint, first.refusal.field, None) is not None
    path = ("placement", "roles", first.role, first.refusal.field) if pinned else ("placement", "roles", first.role)
    raise RunError(f"{first.refusal.why}; this plan can be compiled and simulated, not run", path=path,
                   location=loaded.source.locate(path), fix=first.refusal.fix)


@main.command()
@click.argument("job", type=click.Path(path_type=str))
@click.option("--cluster", "-c", help="Cluster preset or file; overrides the job's.")
@click.option("--steps", type=int, help="Number of RL steps (overrides schedule.steps).")
@click.option("--seed", type=int, help="Seed (overrides run.seed).")
@click.option("--schedule", type=click.Choice(SCHEDULE_MODES), help="Override schedule.mode.")
@click.option("--strategy", type=click.Choice(["auto", "colocated", "disaggregated"]), help="Override placement.strategy.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Run folder (default runs/<job>).")
@click.option("--resume", is_flag=True, help="Continue the run in the run folder from its newest intact checkpoint "
              "(to a larger --steps, for a finished run).")
@click.option("--overwrite", is_flag=True, help="Replace the run in the run folder: delete what it wrote there "
              "(metrics, samples, checkpoints, ...) and start from step 0.")
@click.option("--profile", type=click.Path(file_okay=False, path_type=Path), help="Write torch.profiler traces here.")
@click.option("--profile-memory", is_flag=True, help="With --profile: also record memory.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@set_option
def run(job: str, cluster: str | None, steps: int | None, seed: int | None, schedule: str | None,
        strategy: str | None, out: Path | None, resume: bool, overwrite: bool, profile: Path | None,
        profile_memory: bool, quiet: bool, sets: tuple[str, ...]) -> None:
    """Compile JOB and run it: one process per rank on this machine. The first Ctrl-C (or SIGTERM) stops
    every rank after the step it is in and checkpoints that step; a second ends them at once."""
    from graphrl.executors.rank_server import start_rank_server

    start_rank_server()  # it imports torch for the ranks while this process compiles
    from graphrl.executors.launcher import launch_local
    from graphrl.executors.outputs import checkpoint_layout, read_meta
    from graphrl.executors.runfolder import claim_run_folder, record_outcome

    loaded = _override(load_with_sets(job, sets), steps=steps, seed=seed, schedule=schedule, strategy=strategy)
    out_dir = out or Path(loaded.spec.run.out_dir or f"runs/{loaded.spec.name}")
    # Checked and locked before minutes of compiling; a folder made here and left empty goes again.
    with claim_run_folder(out_dir, loaded.spec, resume=resume, overwrite=overwrite, command=f"graphrl run {job}") as folder:
        plan = compile_loaded(loaded, cluster, target="run")
        refuse_unrunnable(plan, loaded)
        total = plan.programs.steps if plan.programs else 0
        start = folder.begin(loaded.spec, total, say=lambda line: click.echo(line, err=True))
        if start is None:
            return
        for note in start.notes:
            click.echo(note, err=True)
        if start.checkpoint is not None:
            old, new = read_meta(start.checkpoint).get("layout"), checkpoint_layout(plan)
            if old is not None and old != new:
                click.echo(f"  on another layout: {old['label']} on {old['ranks']} ranks -> {new['label']} on "
                           f"{new['ranks']} ranks (the trained state is resharded as it loads)", err=True)
        from graphrl.report import MACHINE_SPEED_FILE

        (out_dir / MACHINE_SPEED_FILE).unlink(missing_ok=True)  # it describes the end of the run that wrote it
        settings = None
        if profile is not None:
            from graphrl.executors.profiling import ProfileSettings

            profile.mkdir(parents=True, exist_ok=True)
            settings = ProfileSettings(profile, memory=profile_memory)
        click.echo(f"running {loaded.spec.name}: {plan.chosen.label} [{plan.chosen.estimate.mode}] on "
                   f"{plan.cluster.num_devices} ranks, {total} steps -> {out_dir}", err=True)
        click.echo(_predicted_line(plan), err=True)
        if (note := _uncalibrated_note(plan, job)) is not None:
            click.echo(note, err=True)
        last: dict[str, Any] = {}
        launch = functools.partial(launch_local, plan, out_dir, start_step=start.step, resume_from=start.checkpoint,
                                   profile=settings, resume_hint=_resume_hint(job, out_dir, click.get_current_context().params),
                                   on_stopping=lambda line: click.echo(f"\n{line}", err=True))
        try:
            if quiet:
                outcome = launch(on_metrics=last.update)
            else:
                from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

                with Progress(TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                              TextColumn("reward {task.fields[reward]:.3f}  {task.fields[step_s]:.2f} s/step  "
                                         "{task.fields[tok_s]:.0f} tok/s"),
                              TimeElapsedColumn(), transient=False) as bar:
                    task = bar.add_task("run", total=total, completed=start.step, reward=0.0, step_s=0.0, tok_s=0.0)

                    def update(row: dict[str, Any]) -> None:
                        last.update(row)
                        bar.update(task, completed=row["step"] + 1, reward=row["reward_mean"],
                                   step_s=row["step_time_s"], tok_s=row.get("tokens_per_s", 0.0))

                    outcome = launch(on_metrics=update)
        except GraphRLError as exc:
            record_outcome(out_dir, "stopped" if isinstance(exc, Interrupted) else "failed", last_step=last.get("step"))
            raise
        record_outcome(out_dir, "finished", last_step=last.get("step"))
    summary = ", ".join(f"{k} {last[k]:.4g}" for k in ("reward_mean", "loss") if k in last)
    click.echo(f"done: {outcome.steps_done} steps in {outcome.wall_s:.1f} s ({summary}); metrics in {out_dir / 'metrics.jsonl'}, "
               f"timeline in {out_dir / 'timeline.json'}")
    measured = _measured_line(plan, out_dir / "metrics.jsonl", start.step) if outcome.steps_done else None
    if measured is not None:
        click.echo(measured)
        speed = _machine_speed_line(plan, out_dir)
        if speed is not None:
            click.echo(speed)
    if profile is not None:
        click.echo(f"profiles in {profile}: tensorboard --logdir {profile}")


RUN_WARMUP_STEPS = 1  # as `graphrl report`'s default: the first step of a run also builds models and warms up


def _predicted_line(plan) -> str:  # noqa: ANN001
    """What the plan says one step costs, said before the run so the measurement can be held against it."""
    estimate = plan.chosen.estimate
    how = "simulated steady state" if estimate.method == "simulated" else "analytical estimate"
    return f"predicted {estimate.step_time_s:.3g} s/step ({how}, hardware {plan.hardware.name})"


def _uncalibrated_note(plan, job: str) -> str | None:  # noqa: ANN001
    """Where the prediction comes from a CPU preset's defaults rather than this machine's own figures: how
    far off that can be, and the one command that fixes it."""
    if plan.hardware.name != "cpu-local" or plan.hardware.machine is not None:
        return None
    return ("note: this machine is not calibrated, so the prediction uses the cpu-local preset's figures, which "
            f"can be off several-fold here (5x has been seen); `graphrl calibrate {job}` measures this machine at "
            "this job's sizes in a few minutes, and every later prediction uses it")


def _measured_line(plan, metrics_path: Path, start_step: int) -> str | None:  # noqa: ANN001
    """The median seconds per step this run measured (its own steps, after warm-up) with the prediction's
    error; None, with a warning, where its metrics cannot be read."""
    from graphrl.report import error_pct, median_step_time, read_metrics

    try:
        rows, _ = read_metrics(metrics_path)
    except RunError as exc:
        click.echo(f"warning: no measured step time: {exc.render()}", err=True)
        return None
    seconds, steps = median_step_time([r for r in rows if r["step"] >= start_step], RUN_WARMUP_STEPS)
    if seconds is None:
        return None
    over = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    error = error_pct(plan.chosen.estimate.step_time_s, seconds)
    return f"measured {seconds:.3g} s/step over {over}" + (f" (prediction {error:+.0f}%)" if error is not None else "")


def _machine_speed_line(plan, out_dir: Path) -> str | None:  # noqa: ANN001
    """On a calibrated machine: one of the calibration's matmuls timed again now, written to the run folder
    (`graphrl report` shows it) and said, so that the prediction's error can be read beside how far the
    machine's own speed moved since it was calibrated. None on a preset (nothing measured to compare)."""
    from graphrl.calibration import machine_speed
    from graphrl.report import MACHINE_SPEED_FILE

    speed = machine_speed(plan.hardware)
    if speed is None:
        return None
    (out_dir / MACHINE_SPEED_FILE).write_text(json.dumps(speed))
    return (f"machine speed {speed['ratio']:.2f}x its calibration's (a {speed['rows']} x {speed['k']} by {speed['k']} x "
            f"{speed['n']} matmul, {speed['threads']} thread(s): {speed['measured_s'] * 1e3:.2f} ms now, "
            f"{speed['calibrated_s'] * 1e3:.2f} ms calibrated)")


def _resume_hint(job: str, out_dir: Path, options: dict[str, Any]) -> str:
    """The command that continues a run: the job with the options it ran with (`run`'s parameters), its
    folder, --resume."""
    import shlex

    words = ["graphrl", "run", job]
    for name in ("cluster", "steps", "seed", "schedule", "strategy"):
        if options.get(name) is not None:
            words += [f"--{name}", str(options[name])]
    for text in options.get("sets", ()):
        words += ["--set", text]
    return shlex.join([*words, "--out", str(out_dir), "--resume"])


@main.command()
@click.argument("job", type=click.Path(path_type=str))
@click.option("--emit", type=click.Choice(["torchrun", "slurm"]), required=True, help="Kind of launch script.")
@click.option("--cluster", "-c", help="Cluster preset or file; overrides the job's.")
@click.option("--steps", type=int, help="Number of RL steps.")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), default=Path("launch"),
              show_default=True, help="Folder for the plan and the script.")
@click.option("--out", "run_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Run folder the script writes (default: OUTPUT/run). Checked now as `graphrl run` checks it; "
                   "a run of this job there is continued from its newest checkpoint.")
@click.option("--overwrite", is_flag=True, help="Delete what an earlier run wrote in the run folder now (nothing else).")
@click.option("--port", type=click.IntRange(1, 65535), default=29512, show_default=True, help="Rendezvous port.")
@click.option("--grace-period", "grace_s", type=click.IntRange(1, 86400), default=120, show_default=True,
              help="Seconds the ranks get after SIGTERM to finish their step and checkpoint it before they are "
                   "killed (torchrun's shutdown timeout; SLURM sends SIGTERM this long before the time limit).")
@set_option
def launch(job: str, emit: str, cluster: str | None, steps: int | None, output: Path, run_dir: Path | None,
           overwrite: bool, port: int, grace_s: int, sets: tuple[str, ...]) -> None:
    """Compile JOB and write a torchrun or SLURM script that runs `python -m graphrl.executors PLAN`. Running
    the script again continues the run from its newest checkpoint."""
    from graphrl.executors.runfolder import claim_run_folder, read_record, remove_run_outputs, work_done
    from graphrl.executors.scripts import write_launch

    loaded = _override(load_with_sets(job, sets), steps=steps)
    run_dir = run_dir or output / "run"
    for written in ("plan.msgpack", "launch.sh" if emit == "torchrun" else "launch.sbatch"):
        refuse_overwriting_inputs(output / written, _inputs(loaded, cluster), "-o",
                                  output.with_name(output.name + "-launch"))
    # The folder as the run will find it: a folder in use, someone else's files where a run writes, or (to be
    # continued) another job's run are refused now, before the scheduler's queue.
    record = read_record(run_dir)
    continuing = record is not None and work_done(run_dir) and not overwrite
    claim_run_folder(run_dir, loaded.spec, resume=continuing, overwrite=not continuing,
                     command=f"graphrl launch {job}").release()
    if overwrite and record is not None:
        remove_run_outputs(run_dir, record)
    plan = compile_loaded(loaded, cluster, target="run")
    refuse_unrunnable(plan, loaded)
    if plan.programs is not None and plan.programs.steps:
        step_s = plan.chosen.estimate.step_time_s
        if step_s > grace_s / 2:
            click.echo(f"warning: a step is predicted to take {step_s:.3g} s, so a SIGTERM may leave too little of "
                       f"the {grace_s} s grace period to finish it and write its checkpoint; pass a larger "
                       "--grace-period", err=True)
    run_dir.mkdir(parents=True, exist_ok=True)  # SLURM writes its log there from the start
    plan_path, script = write_launch(plan, emit, output, run_dir=run_dir, port=port, grace_s=grace_s)
    click.echo(f"wrote {plan_path} and {script}" + (f"; it continues the run in {run_dir}" if continuing else ""))


@main.command()
@click.argument("run_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["text", "html", "json"]), default="html", show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the report here (html default: RUN_DIR/report.html; text and json print).")
@click.option("--width", type=int, default=120, show_default=True, help="Text width (text format).")
@click.option("--warmup-steps", type=click.IntRange(min=0), default=1, show_default=True,
              help="Leading steps left out of the averages (start-up, allocator and kernel warm-up).")
def report(run_dir: Path, fmt: str, output: Path | None, width: int, warmup_steps: int) -> None:
    """Report on a run folder: reward, loss and KL curves, and measured time against the plan's prediction."""
    from graphrl.executors.runfolder import RUN_OUTPUTS, record_written
    from graphrl.report import build_report

    target = output or (run_dir / "report.html" if fmt == "html" else None)
    if target is not None:  # what a run wrote is what the report reads
        reads = {run_dir / pattern.split("/")[0] for pattern in RUN_OUTPUTS}
        suffix = {"html": "html", "json": "json", "text": "txt"}[fmt]
        refuse_overwriting_inputs(target, reads, "-o", run_dir.parent / f"{run_dir.name}-report.{suffix}")
    rep = build_report(run_dir, warmup_steps=warmup_steps)
    out = rep.render_html() if fmt == "html" else \
        (json.dumps(rep.data, indent=2) if fmt == "json" else rep.render_text(width=width)) + "\n"
    if target is None:
        click.echo(out, nl=False)
        return
    write_atomically(target, out)
    record_written(run_dir, target)  # graphrl's, for a later --overwrite of the run folder
    click.echo(f"wrote {target}", err=True)


@main.command(name="import")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--force", is_flag=True, help="Replace OUT_DIR if an earlier `graphrl import` wrote it (never another folder).")
def import_cmd(source: Path, out_dir: Path, dtype: str, force: bool) -> None:
    """Convert a GGUF file or Hugging Face folder once into a safetensors folder with its tokenizer.
    OUT_DIR must be new or empty (with --force: an earlier import's folder)."""
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from graphrl.models import check_import_target, import_checkpoint

    check_import_target(source, out_dir, force)  # before the progress bar: a refusal is one clean line
    stages = ["reading weights", "building model", "reading tokenizer", "writing safetensors"]
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("import", total=len(stages))

        def progress(stage: str) -> None:
            bar.update(task, description=stage, completed=stages.index(stage))

        folder = import_checkpoint(source, out_dir, getattr(torch, dtype), progress=progress, force=force)
        bar.update(task, description="done", completed=len(stages))
    click.echo(f"wrote {folder}: point a model's `checkpoint:` at it")


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="The folder to write; it must be new or empty (with --force: an earlier export's folder).")
@click.option("--step", type=click.IntRange(min=0), help="The checkpoint after this step (default: the newest intact one).")
@click.option("--merge/--adapter", default=True, show_default=True,
              help="--merge: a Hugging Face model, LoRA adapters folded in; --adapter: a LoRA policy's PEFT adapter folder.")
@click.option("--force", is_flag=True, help="Replace OUT if an earlier `graphrl export` wrote it (never another folder).")
def export(run_dir: Path, out: Path, step: int | None, merge: bool, force: bool) -> None:
    """Write a run's trained policy as a folder transformers (or, with --adapter, PEFT) loads."""
    from graphrl.models.adapters import export_run

    click.echo(f"wrote {out}: {export_run(run_dir, out, step=step, merge=merge, force=force)}")


def command() -> None:
    """The `graphrl` program: `main` with this process's arguments. After a preview command its output is
    flushed and the process ends at once, skipping the teardown that frees every object one by one; other
    commands (runs, calibration) end as Python ends them."""
    try:
        main()
    except SystemExit as done:
        if not (_invoked and _invoked[-1] in PREVIEW_COMMANDS):
            raise
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        if done.code is not None and not isinstance(done.code, int):
            print(done.code, file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe (`| head`) took what it wanted
                pass
        os._exit(code)


if __name__ == "__main__":
    command()
