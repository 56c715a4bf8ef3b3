"""Errors where the user can act on them: a Python job file cannot end or hijack the CLI, an out-of-range
option is refused, and an exception in the user's own code during a run names the node, the function and
the step (the companions of tests/bad_jobs/, whose files `validate` now refuses instead of a rank).

No process is started: the CLI runs in click's CliRunner, and the executor's reward step and the task
prompts are called directly on the rows they read.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from graphrl.cli import main
from graphrl.errors import RunError

REPO = Path(__file__).resolve().parents[2]
FIX = "fix: a job file is read, not run: build the job in build_job() without sys.exit or argument parsing"


def _validate(script: Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["validate", str(script)])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.stderr


def _two_lines(stderr: str) -> list[str]:
    lines = stderr.rstrip("\n").split("\n")
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("  fix: "), stderr
    return lines


def test_a_python_job_calling_sys_exit_is_an_error_at_its_line(tmp_path: Path) -> None:
    """`sys.exit(3)` in a job file ended `graphrl validate` with exit code 3 and no word; it must be a job
    error (exit 2) at the line that called it, with the fix."""
    script = tmp_path / "job.py"
    script.write_text("import sys\n\nsys.exit(3)\n")
    code, stderr = _validate(script)
    assert code == 2, stderr
    first, fix = _two_lines(stderr)
    assert first == f"error: {script}:3: the Python job called sys.exit(3) while graphrl read it", first
    assert fix.startswith("  " + FIX), fix


def test_a_python_job_exiting_inside_build_job_is_located_there(tmp_path: Path) -> None:
    """build_job() runs inside the same guard: its `sys.exit()` is located at its own line."""
    script = tmp_path / "job.py"
    script.write_text("import sys\n\n\ndef build_job():\n    sys.exit()\n")
    code, stderr = _validate(script)
    assert code == 2 and stderr.startswith(f"error: {script}:5: the Python job called sys.exit() "), stderr


def test_a_python_job_parsing_arguments_does_not_read_graphrls_command_line(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A job file that calls argparse read graphrl's own command line (`validate JOB`) and printed argparse's
    complaint about it ("unrecognized arguments: validate ..."), exit 2. Its sys.argv is its own path only,
    so optional arguments take their defaults and the job validates; graphrl's sys.argv is left as it was."""
    script = tmp_path / "job.py"
    example = (REPO / "examples" / "grpo_tiny.py").read_text()
    script.write_text("import argparse\n\nargs = argparse.ArgumentParser().parse_args()\n" + example)
    argv = ["graphrl", "validate", str(script)]
    monkeypatch.setattr(sys, "argv", argv)
    code, stderr = _validate(script)
    assert code == 0 and stderr == "", stderr
    assert sys.argv is argv and sys.argv == ["graphrl", "validate", str(script)]


def test_a_python_job_requiring_arguments_says_which_in_one_error(tmp_path: Path) -> None:
    """argparse's usage and complaint took stderr over; the complaint is folded into the job error (its
    last line), on the line of parse_args(), and argparse's usage lines are not shown."""
    script = tmp_path / "job.py"
    script.write_text("import argparse\n\nparser = argparse.ArgumentParser()\nparser.add_argument('--lr', required=True)\n"
                      "args = parser.parse_args()\n")
    code, stderr = _validate(script)
    assert code == 2, stderr
    first, fix = _two_lines(stderr)
    assert first.startswith(f"error: {script}:5: the Python job called sys.exit(2) while graphrl read it: "), first
    assert first.endswith("error: the following arguments are required: --lr") and "validate" not in first, first
    assert fix.startswith("  " + FIX), fix


@pytest.mark.parametrize("port", ["99999", "0", "-1"])
def test_launch_refuses_a_port_out_of_range(tmp_path: Path, port: str) -> None:
    """`graphrl launch --port 99999` wrote a launch script with MASTER_PORT=99999, which torchrun cannot bind."""
    out = tmp_path / "launch"
    result = CliRunner().invoke(main, ["launch", str(REPO / "examples" / "grpo_tiny.yaml"), "--emit", "torchrun",
                                       "--port", port, "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '--port': {port} is not in the range 1<=x<=65535" in result.stderr, result.stderr
    assert not out.exists()


def _reward_step(fn: str, step: int, start: int, stop: int) -> RunError:
    """What the executor's reward step raises for reward function `fn` on rows [start, stop) of `step`."""
    import torch

    from graphrl.executors.executor import RankExecutor
    from graphrl.schemas.job import RewardNode
    from graphrl.schemas.program import Reward

    n = stop - start
    rows = {"prompt_ids": torch.zeros(n, 3, dtype=torch.int64), "prompt_mask": torch.ones(n, 3, dtype=torch.bool),
            "response_ids": torch.zeros(n, 2, dtype=torch.int64), "response_mask": torch.ones(n, 2, dtype=torch.bool)}
    node = SimpleNamespace(spec=RewardNode(fn=fn, inputs={"rollouts": "rollout.rollouts"}))
    rank = SimpleNamespace(read=lambda ins, port: rows, nodes={"score": node}, group_size=2,
                           source=SimpleNamespace(examples=lambda step: None))
    rank._answers = lambda ins: RankExecutor._answers(rank, ins)  # type: ignore[arg-type]
    with pytest.raises(RunError) as raised:
        RankExecutor.reward(rank, Reward(step=step, node="score", role="", start=start, stop=stop, group=""))  # type: ignore[arg-type]
    return raised.value


def test_an_exception_in_a_reward_function_names_node_function_and_step(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward `module:function` that raised ended the run with the bare exception ("rank 1 failed:
    ZeroDivisionError: ..."), naming neither the node, the function nor the step. The rank's error now names
    all three on its first line (the line the launcher shows), with the fix, and keeps the user's exception
    as its cause (the traceback in the run folder's errors/ still reaches the user's line)."""
    (tmp_path / "early_errors_rewards.py").write_text(
        "def broken(prompt_ids, prompt_mask, response_ids, response_mask):\n"
        "    raise ZeroDivisionError('no responses to divide by\\nmore detail')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    error = _reward_step("early_errors_rewards:broken", step=7, start=4, stop=8)
    assert error.message == ("step 7: reward node 'score': function 'early_errors_rewards:broken' raised "
                             "ZeroDivisionError: no responses to divide by"), error.message
    assert error.fix is not None and "early_errors_rewards:broken" in error.fix and "step 7" in error.fix
    assert isinstance(error.__cause__, ZeroDivisionError)


def test_an_exception_in_a_users_task_names_node_task_and_step(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A task `module:function` whose sample() raised ended the run with the bare exception; the rank's
    error names the dataset node, the task and the step."""
    from graphrl.datasets import prompt_source
    from graphrl.loader import load_job

    (tmp_path / "early_errors_tasks.py").write_text(
        "class Broken:\n"
        "    def sample(self, gen, batch_size, prompt_len):\n"
        "        raise KeyError('vocabulary')\n\n\n"
        "def make():\n"
        "    return Broken()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    job = load_job(REPO / "examples" / "grpo_tiny.yaml").spec
    prompts = job.nodes["prompts"].model_copy(update={"task": "early_errors_tasks:make", "options": {}})
    job = job.model_copy(update={"nodes": {**job.nodes, "prompts": prompts}})
    source = prompt_source(job, job.nodes["prompts"], job.nodes["rollout"])
    with pytest.raises(RunError) as raised:
        source.prompts(3)
    assert raised.value.message == ("dataset node 'prompts': task 'early_errors_tasks:make' raised KeyError drawing "
                                    "the prompts of step 3: 'vocabulary'"), raised.value.message
    assert isinstance(raised.value.__cause__, KeyError)
