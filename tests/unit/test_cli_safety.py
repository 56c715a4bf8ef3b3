"""Commands never write over what they read, and an interrupted command says one line and leaves nothing
behind. In process, through click's runner: no ranks start."""

from __future__ import annotations

import json
import os
import signal
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "grpo_tiny.yaml"
    shutil.copy(EXAMPLES / "grpo_tiny.yaml", path)
    return path


@pytest.mark.parametrize("args", [
    ["compile", "{job}", "-o", "{job}"],
    ["compile", "{job}", "--format", "html", "-o", "{job}"],
    ["compile", "{job}", "--format", "json", "-o", "{job}"],
    ["simulate", "{job}", "--trace", "{job}"],
    ["calibrate", "-o", "{job}", "{job}"],
])
def test_an_output_aimed_at_the_input_is_refused_and_the_input_kept(job: Path, args: list[str]) -> None:
    """`graphrl compile JOB -o JOB` (also as html) and `graphrl simulate JOB --trace JOB` replaced the
    user's job file with a plan, a page or a trace, exit 0."""
    before = job.read_bytes()
    result = CliRunner().invoke(main, [a.format(job=job) for a in args])
    assert result.exit_code == 2, result.output
    assert "would write over its input" in result.output and "fix:" in result.output
    assert job.read_bytes() == before


def test_a_plan_file_is_not_written_over_by_its_own_trace(job: Path, tmp_path: Path) -> None:
    plan = tmp_path / "plan.msgpack"
    assert CliRunner().invoke(main, ["compile", str(job), "-o", str(plan)]).exit_code == 0
    before = plan.read_bytes()
    result = CliRunner().invoke(main, ["simulate", str(plan), "--trace", str(plan)])
    assert result.exit_code == 2 and "would write over its input" in result.output
    assert plan.read_bytes() == before


def test_a_report_never_writes_over_the_run_it_reads(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    for target in (run / "metrics.jsonl", run / "checkpoints" / "page.html"):
        result = CliRunner().invoke(main, ["report", str(run), "-o", str(target)])
        assert result.exit_code == 2 and "would write over" in result.output, result.output
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'


@pytest.mark.parametrize("signum, code, said", [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_an_interrupted_compile_says_one_line_and_leaves_no_run_folder(job: Path, tmp_path: Path, monkeypatch,
                                                                       signum: int, code: int, said: str) -> None:  # noqa: ANN001
    """Ctrl-C while `graphrl run` compiled printed a KeyboardInterrupt traceback (exit 1) and left the run
    folder it had made. Now: one line, exit 130 (SIGTERM: 143), the folder it made is gone and no lock is
    left, so the next run there starts as if nothing happened."""
    from graphrl.compiler import compile as compiling

    def interrupted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        os.kill(os.getpid(), signum)  # the signal arrives while the compiler works
        raise AssertionError("the signal should have ended the command")

    monkeypatch.setattr(compiling, "compile_graph", interrupted)
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["run", str(job), "--out", str(out)])
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"stopped: {said} ended `graphrl run` before it finished; it left nothing half-written"]
    assert not out.exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the command gave its handlers back


def test_report_page_in_the_run_folder_is_recorded_as_graphrls(tmp_path: Path) -> None:
    """`graphrl report` writes RUN/report.html; run.json lists it so that --overwrite deletes it, while a
    user's own report.html (not listed) is kept."""
    from graphrl.executors.runfolder import read_record, record_run
    from graphrl.loader import load_job

    run = tmp_path / "run"
    run.mkdir()
    record_run(run, load_job(EXAMPLES / "grpo_tiny.yaml").spec, steps=2, start_step=0, resumed_from=None)
    rows = [{"step": s, "reward_mean": 0.1 * s, "loss": 1.0, "kl": 0.0, "step_time_s": 0.1, "tokens_per_s": 1.0,
             "weight_version": s} for s in range(2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert read_record(run)["also_written"] == ["report.html"]


def test_launch_checks_the_run_folder_as_run_does(job: Path, tmp_path: Path) -> None:
    """`graphrl launch` wrote its script whatever the run folder held; the ranks then wrote into another
    job's run or over a user's files. It checks now, before anything is queued: another job's run is
    refused, this job's run is continued (its script resumes), --overwrite deletes what that run wrote."""
    from graphrl.executors.runfolder import record_run
    from graphrl.loader import load_job

    run = tmp_path / "run"
    run.mkdir()
    record_run(run, load_job(job).spec, steps=4, start_step=0, resumed_from=None)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    args = ["launch", str(job), "--emit", "torchrun", "-o", str(tmp_path / "launch"), "--out", str(run)]
    result = CliRunner().invoke(main, [*args, "--set", "algorithm.lr=0.5"])
    assert result.exit_code == 2 and "holds another job (algorithm.lr" in result.output, result.output
    assert not (tmp_path / "launch").exists()
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and f"it continues the run in {run}" in result.output, result.output
    result = CliRunner().invoke(main, [*args, "--overwrite"])
    assert result.exit_code == 0 and "continues" not in result.output, result.output
    assert not (run / "metrics.jsonl").exists()


def test_launch_warns_when_a_step_outlasts_the_grace_period(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["launch", str(EXAMPLES / "llama3_70b.yaml"), "--emit", "slurm", "-o",
                                       str(tmp_path), "--grace-period", "10"])
    assert result.exit_code == 0, result.output
    assert "a SIGTERM may leave too little of the 10 s grace period" in result.output
    assert "#SBATCH --signal=TERM@10" in (tmp_path / "launch.sbatch").read_text()
