"""Periodic programs: a prologue, a one-step body and an epilogue per rank, equal to the unrolled run.

The periodic form is what the plan stores and what the executors, the simulator and `verify` walk; the
unrolled transcript is the schedule's definition. These tests hold the two together for every schedule
kind of the CPU examples, and check that the plan's size does not depend on the number of steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import pytest
from click.testing import CliRunner

from graphrl.cli import main
from graphrl.compiler.compile import compile_graph, compile_job
from graphrl.compiler.pipeline import placed_programs
from graphrl.compiler.schedule import ProgramSettings
from graphrl.compiler.schedule import fold_length
from graphrl.compiler.simulate import run_programs
from graphrl.compiler.verify import check_body_memory_balance, runnable_plan
from graphrl.errors import PlanFileError, VerifyError
from graphrl.loader import job_cluster, load_job, load_job_text
from graphrl.plan_io import load_plan, plan_from_bytes, plan_to_bytes
from graphrl.schemas.program import Checkpoint, Offload, RankProgram, Send, TrainStep

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def job_with(name: str, **replace: str):
    text = (EXAMPLES / name).read_text()
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    return load_job_text(text, name)


def graph_for(job, steps: int):
    return compile_graph(job, job_cluster(job, None), steps=steps)


CASES = [
    ("grpo_tiny.yaml", {}),                                            # colocated, sync
    ("ppo_tiny.yaml", {}),                                             # critic, reference, value
    ("aipo_async_tiny.yaml", {"max_staleness: 1": "max_staleness: 0"}),  # disaggregated, sync-like
    ("aipo_async_tiny.yaml", {}),                                      # async, staleness 1
    ("aipo_async_tiny.yaml", {"max_staleness: 1": "max_staleness: 3"}),  # async, staleness 3
]


@pytest.mark.parametrize("name, edits", CASES)
@pytest.mark.parametrize("checkpoint_every", [0, 3])
def test_periodic_programs_expand_to_the_unrolled_run(name, edits, checkpoint_every):
    """For run lengths around the fold length and well past it, every rank's periodic program expands to
    exactly the instructions of the unrolled schedule (checkpoints every `checkpoint_every` and at the end)."""
    job = job_with(name, **edits)
    job = dataclasses.replace(job, spec=job.spec.model_copy(update={
        "schedule": job.spec.schedule.model_copy(update={"checkpoint_every": checkpoint_every})}))
    graph = graph_for(job, steps=2)
    pl = graph.placement
    mode = job.spec.schedule.mode if pl.chosen.strategy == "disaggregated" else "sync"
    warm = fold_length(job.spec.schedule.max_staleness if mode == "async" else 0)
    for steps in (1, 2, warm - 1, warm, warm + 1, warm + 5, 37):
        periodic = placed_programs(graph, ProgramSettings(steps))
        unrolled = placed_programs(graph, ProgramSettings(steps, periodic=False))
        assert periodic.streams == unrolled.streams, f"{steps} steps"
        checkpoints = [i.step for i in periodic.streams[-1] if isinstance(i, Checkpoint)]
        assert checkpoints == [s for s in range(steps) if s == steps - 1 or (checkpoint_every and (s + 1) % 3 == 0)]


@pytest.mark.parametrize("name", ["grpo_tiny.yaml", "aipo_async_tiny.yaml", "ppo_tiny.yaml"])
def test_plan_size_does_not_grow_with_steps(name):
    job = load_job(EXAMPLES / name)
    sizes = {}
    for steps in (100, 100_000):
        plan = compile_job(job, job_cluster(job, None), steps=steps)
        assert plan.programs.steps == steps
        sizes[steps] = (plan.programs.num_instructions, len(plan_to_bytes(plan)))
    assert sizes[100][0] == sizes[100_000][0]
    assert abs(sizes[100][1] - sizes[100_000][1]) < 64  # only the step count's digits differ


def test_long_run_is_a_loop_not_a_transcript():
    """A million-step plan holds a one-step body per rank whose instructions carry offsets; step k of
    the run is the body shifted by k."""
    plan = compile_job(load_job(EXAMPLES / "aipo_async_tiny.yaml"), job_cluster(load_job(EXAMPLES / "aipo_async_tiny.yaml"), None),
                       steps=1_000_000)
    trainer = plan.programs.ranks[1]
    assert len(trainer) < 40 and trainer.iterations(1_000_000).stop > 999_990
    view = trainer.step_view(1_000_000, 500_000)
    trains = [ins for _, ins in view if isinstance(ins, TrainStep)]
    assert trains == [TrainStep(500_000, "update", "policy", 0, 256, 500_001, "trainer")]


def test_body_that_leaves_state_offloaded_is_refused():
    """A body that offloads a role's optimizer and never brings it back would shrink (or, the other way,
    grow) device memory every step; one iteration in a window would not show it, so verify refuses it."""
    body = [Offload("policy", ("optimizer",), 10), TrainStep(0, "update", "policy", 0, 8, 1, "trainer")]
    programs = placed_programs(_tiny_compiled(), ProgramSettings(20))
    broken = dataclasses.replace(programs, ranks=[RankProgram([], body, [])] * programs.num_ranks)
    with pytest.raises(VerifyError) as info:
        check_body_memory_balance(broken)
    assert "policy.optimizer" in str(info.value)


def _tiny_compiled():
    job = load_job(EXAMPLES / "grpo_tiny.yaml")
    return graph_for(job, steps=2)


def test_periodic_and_unrolled_simulate_the_same_step_time():
    """The simulator over the periodic plan's window gives the unrolled run's steady-state step time."""
    compiled = _tiny_compiled()
    shape = compiled.placement.shape
    periodic = placed_programs(compiled, ProgramSettings(400))
    unrolled = placed_programs(compiled, ProgramSettings(400, periodic=False))
    window = periodic.with_steps(periodic.window_steps(16))
    hw, per_node = shape.hardware, shape.devices_per_node
    a = run_programs(window, hw=hw, devices_per_node=per_node, timed=True).step_time_s
    b = run_programs(unrolled, hw=hw, devices_per_node=per_node, timed=True).step_time_s
    assert a == pytest.approx(b, rel=5e-3)


def _edited(tmp_path, edit) -> Path:
    job = load_job(EXAMPLES / "aipo_async_tiny.yaml")
    plan = compile_job(job, job_cluster(job, None), steps=50)
    raw = msgpack.unpackb(plan_to_bytes(plan), raw=False)
    edit(raw)
    path = tmp_path / "edited.msgpack"
    path.write_bytes(msgpack.packb(raw, use_bin_type=True))
    return path


def test_plan_with_a_send_removed_is_refused_at_load(tmp_path):
    """A hand-edited plan whose generator body lost its Send would hang the trainer's Recv at run time;
    loading it names the file and the deadlock instead."""
    def drop_send(raw):
        body = raw["programs"]["ranks"][0]["body"]
        raw["programs"]["ranks"][0]["body"] = [i for i in body if i[0] != "Send"]
    path = _edited(tmp_path, drop_send)
    with pytest.raises(PlanFileError) as info:
        runnable_plan(load_plan(path), str(path))
    assert "edited.msgpack" in str(info.value) and "deadlock" in str(info.value)
    out = CliRunner().invoke(main, ["simulate", str(path)])
    assert out.exit_code == 2 and "cannot run" in out.output and "Traceback" not in out.output


def test_truncated_plan_file_is_refused(tmp_path):
    job = load_job(EXAMPLES / "grpo_tiny.yaml")
    data = plan_to_bytes(compile_job(job, job_cluster(job, None), steps=10))
    with pytest.raises(PlanFileError) as info:
        plan_from_bytes(data[: len(data) // 2], "half.msgpack")
    assert "half.msgpack" in str(info.value)


def test_bad_loop_bounds_are_refused(tmp_path):
    def negative_first(raw):
        raw["programs"]["ranks"][0]["first"] = -3
    path = _edited(tmp_path, negative_first)
    with pytest.raises(PlanFileError) as info:
        runnable_plan(load_plan(path), str(path))
    assert "first=-3" in str(info.value)


def test_simulate_plan_file_does_not_recompile(tmp_path, monkeypatch):
    """`graphrl simulate PLAN` simulates the programs in the file: compiling is made to fail, and the
    figures are those of the plan's own programs."""
    runner = CliRunner()
    path = tmp_path / "p.msgpack"
    assert runner.invoke(main, ["compile", str(EXAMPLES / "aipo_async_tiny.yaml"), "--steps", "30", "-o", str(path)]).exit_code == 0
    import graphrl.compiler.compile as compile_module

    def refuse(*args, **kwargs):
        raise AssertionError("simulate recompiled the job")
    monkeypatch.setattr(compile_module, "compile_graph", refuse)
    monkeypatch.setattr(compile_module, "compile_job", refuse)
    out = runner.invoke(main, ["simulate", str(path), "--format", "json"])
    assert out.exit_code == 0, out.output
    import json

    data = json.loads(out.output)
    plan = load_plan(path)
    # the plan's own figure: its programs' steady state over the one window, which its estimate holds
    assert data["step_time_s"] == plan.chosen.estimate.step_time_s and data["steps"] == 30


def test_inspect_step_shows_absolute_operands(tmp_path):
    path = tmp_path / "p.msgpack"
    runner = CliRunner()
    assert runner.invoke(main, ["compile", str(EXAMPLES / "aipo_async_tiny.yaml"), "--steps", "5000", "-o", str(path)]).exit_code == 0
    out = runner.invoke(main, ["inspect", str(path), "--rank", "0", "--step", "1234"])
    assert out.exit_code == 0, out.output
    assert "Generate step=1234 role=policy/generate v=1233" in out.output
    out = runner.invoke(main, ["inspect", str(path), "--step", "5000"])
    assert out.exit_code == 2 and "does not exist" in out.output
    out = runner.invoke(main, ["inspect", str(path), "--rank", "1"])
    assert "body:" in out.output and "prologue:" in out.output and "epilogue:" in out.output


def test_sends_of_every_iteration_have_distinct_tags():
    job = load_job(EXAMPLES / "aipo_async_tiny.yaml")
    programs = compile_job(job, job_cluster(job, None), steps=40).programs
    tags = [i.tag for s in programs.streams for i in s if isinstance(i, Send)]
    assert len(tags) == len(set(tags)) == 40
