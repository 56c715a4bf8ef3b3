"""The command line's basics: version, help on every command, `--debug`, and errors at the right line.

Typecheck errors are found on the graph, long after parsing; these tests check that they still point
at the line of the YAML file that holds the mistake. The expected line is found by searching the
mutated text, so the tests survive edits to the example.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from graphrl import __version__
from graphrl.cli import main

REPO = Path(__file__).resolve().parents[2]
GRPO = (REPO / "examples" / "grpo_tiny.yaml").read_text()
PPO = (REPO / "examples" / "ppo_tiny.yaml").read_text()
BAD_JOB = REPO / "tests" / "bad_jobs" / "schema_mismatch.yaml"


def test_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"graphrl, version {__version__}"


def test_main_help_lists_every_command() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "--debug" in result.stdout
    for name in main.commands:
        assert f"  {name} " in result.stdout, name


@pytest.mark.parametrize("name", sorted(main.commands))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_of_every_command(name: str, flag: str) -> None:
    command = main.commands[name]
    result = CliRunner().invoke(main, [name, flag])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"Usage: main {name}") or result.stdout.startswith(f"Usage: graphrl {name}")
    assert command.get_short_help_str(limit=45)[:30] in " ".join(result.stdout.split())
    for param in command.params:
        if isinstance(param, click.Option):
            assert param.opts[-1] in result.stdout


def test_debug_shows_the_traceback_and_plain_mode_does_not() -> None:
    plain = CliRunner().invoke(main, ["validate", str(BAD_JOB)])
    debug = CliRunner().invoke(main, ["--debug", "validate", str(BAD_JOB)])
    assert plain.exit_code == debug.exit_code == 2
    assert "Traceback" not in plain.output
    assert "Traceback (most recent call last)" in debug.stderr
    assert "JobError" in debug.stderr
    # Both end with the same two-line message.
    assert debug.stderr.rstrip().endswith(plain.stderr.rstrip())


def test_missing_file_and_directory_are_user_errors(tmp_path: Path) -> None:
    for target, says in [(tmp_path / "nope.yaml", "file not found"), (tmp_path, "is a directory")]:
        result = CliRunner().invoke(main, ["validate", str(target)])
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("error: ") and says in result.stderr
        assert "Traceback" not in result.output


def _line_of(text: str, fragment: str) -> int:
    """1-based line of the only line holding `fragment`."""
    hits = [i for i, line in enumerate(text.splitlines(), 1) if fragment in line]
    assert len(hits) == 1, (fragment, hits)
    return hits[0]


# (example, old text, new text, the line fragment the error must point at, field path named)
TYPECHECK_CASES = {
    "unknown_node": (GRPO, "rewards: score.rewards", "rewards: scores.rewards", "scores.rewards",
                     "nodes.adv.inputs.rewards"),
    "unknown_port": (GRPO, "{prompts: prompts.prompts}", "{prompts: prompts.prompt}", "prompts.prompt}",
                     "nodes.rollout.inputs.prompts"),
    "schema_mismatch": (PPO, "advantages: gae.advantages, ref_logprobs", "advantages: score.rewards, ref_logprobs",
                        "advantages: score.rewards", "nodes.update_policy.inputs.advantages"),
    "unknown_reward_fn": (GRPO, "fn: digits_copy", "fn: digits_kopy", "digits_kopy", "nodes.score.fn"),
    "unknown_task": (GRPO, "task: digits-copy", "task: digits-paste", "digits-paste", "nodes.prompts.task"),
    "undeclared_model": (GRPO, "    op: train\n    model: policy", "    op: train\n    model: critic",
                         "model: critic", "nodes.update.model"),
    "kl_without_reference": (GRPO, "clip_eps: 0.2", "clip_eps: 0.2\n  kl_coef: 0.1", "kl_coef: 0.1",
                             "algorithm.kl_coef"),
    # The missing input, not the advantage output it leaves unconsumed, is the mistake to report.
    "unconnected_input": (GRPO, "{rollouts: rollout.rollouts, advantages: adv.advantages}",
                          "{rollouts: rollout.rollouts}  # no advantages", "# no advantages", "nodes.update.inputs"),
    "cycle": (GRPO, "{prompts: prompts.prompts}", "{prompts: adv.advantages}", "{prompts: adv.advantages}", "nodes.rollout.inputs"),
}


@pytest.mark.parametrize("case", sorted(TYPECHECK_CASES))
def test_errors_point_at_the_line_of_the_mistake(case: str, tmp_path: Path) -> None:
    example, old, new, fragment, field = TYPECHECK_CASES[case]
    assert example.count(old) == 1
    text = example.replace(old, new)
    job = tmp_path / f"{case}.yaml"
    job.write_text(text)
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 2, result.output
    line = _line_of(text, fragment)
    assert result.stderr.startswith(f"error: {job}:{line}:"), (line, result.stderr)
    assert f": {field}: " in result.stderr.splitlines()[0]


def test_cluster_default_is_checked_by_validate(tmp_path: Path) -> None:
    """`validate` used to accept a job whose default cluster did not exist; now it points at `cluster:`."""
    text = GRPO.replace("cluster: local-cpu-2", "cluster: local-cpu-3")
    job = tmp_path / "job.yaml"
    job.write_text(text)
    result = CliRunner().invoke(main, ["validate", str(job)])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {job}:{_line_of(text, 'local-cpu-3')}:")
    assert ": cluster: " in result.stderr and "local-cpu-2" in result.stderr  # the fix lists the presets


def test_compiling_and_simulating_never_import_torch() -> None:
    """torch's import takes about two seconds; the compiler, the simulator and plan files do not need it."""
    code = (
        "import sys\n"
        "from graphrl.compiler.compile import compile_job\n"
        "from graphrl.compiler.simreport import simulate_report\n"
        "from graphrl.loader import job_cluster, load_job\n"
        "from graphrl.plan_io import plan_from_bytes, plan_to_bytes\n"
        "job = load_job('examples/aipo_async_tiny.yaml')\n"
        "plan = plan_from_bytes(plan_to_bytes(compile_job(job, job_cluster(job, None))))\n"
        "simulate_report(plan)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
