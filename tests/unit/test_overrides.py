"""`--set KEY=VALUE`: any job field changed from the command line, validated exactly like the file.

An override must give the same job as the edited file (so it cannot drift from the schema), must look
roles and nodes up by name, and must refuse a wrong path or value with exit 2 naming the path, the
option that set it, and the keys that exist at that level.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import _override, load_any, main
from graphrl.errors import JobError
from graphrl.loader import apply_overrides, load_job, load_job_text, parse_override

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GRPO = EXAMPLES / "grpo_tiny.yaml"


def with_sets(job, *sets: str):  # noqa: ANN001, ANN201
    return apply_overrides(job, [parse_override(s) for s in sets]).spec


@pytest.mark.parametrize("source", ["grpo_tiny.yaml", "grpo_tiny.py"])
def test_overrides_equal_the_edited_file(source: str) -> None:
    """YAML and Python jobs alike: the overridden job is the job whose file says so."""
    edited = (GRPO.read_text()
              .replace("  steps: 400", "  steps: 400\n  checkpoint_every: 20")
              .replace("  lr: 1.0e-3", "  lr: 2.0e-4")
              .replace("    max_new_tokens: 5", "    max_new_tokens: 7")
              + "placement:\n  colocate: [[policy, policy/generate]]\n  roles:\n    policy/generate: {tp: 2}\n")
    got = with_sets(load_any(str(EXAMPLES / source)), "schedule.checkpoint_every=20", "algorithm.lr=2e-4",
                    "nodes.rollout.max_new_tokens=7", "placement.roles.policy/generate.tp=2",
                    "placement.colocate=[[policy, policy/generate]]")
    assert got == load_job_text(edited, "edited.yaml").spec


def test_later_overrides_win_and_lists_take_an_index() -> None:
    spec = with_sets(load_job(GRPO), "schedule.steps=3", "schedule.steps=5", "algorithm.betas.1=0.99",
                     "models.policy.checkpoint=", "run.out_dir=runs/x")
    assert spec.schedule.steps == 5 and spec.algorithm.betas == (0.9, 0.99) and spec.run.out_dir == "runs/x"


def test_run_shorthands_are_overrides() -> None:
    """`--steps 5 --strategy colocated` is the same change as the --set form (and clears device pins)."""
    job = load_job(EXAMPLES / "aipo_async_tiny.yaml")
    short = _override(job, steps=5, strategy="colocated").spec
    assert short == with_sets(job, "schedule.steps=5", "placement.strategy=colocated",
                              "placement.roles.policy.devices=", "placement.roles.policy/generate.devices=")
    assert all(h.devices is None for h in short.placement.roles.values())


@pytest.mark.parametrize("setting, path, says", [
    ("schedule.checkpoint_evry=3", "schedule.checkpoint_evry", "keys under schedule: mode, max_staleness, steps"),
    ("scedule.steps=3", "scedule", "did you mean 'schedule'?"),
    ("placement.roles.policy.gpus=2", "placement.roles.policy.gpus", "devices, dp, fsdp, tp, pp"),
    ("nodes.rolout.max_new_tokens=3", "nodes.rolout", "nodes of this job: prompts, rollout, score, adv, update"),
    ("models.actor.dtype=float32", "models.actor", "models of this job: policy"),
    ("schedule.steps.every=3", "schedule.steps", "not a section"),
    ("algorithm.betas.2=0.5", "algorithm.betas.2", "not an index"),
    ("schedule.steps=true", "schedule.steps", "not a boolean"),
    ("schedule.steps=ten", "schedule.steps", "must be an integer, not a string (got 'ten')"),
    ("algorithm.lr=.inf", "algorithm.lr", "must be a finite number"),
    ("algorithm.lr='1e-3'", "algorithm.lr", "not a string"),
    ("nodes.rollout.top_p=2", "nodes.rollout.top_p", "less than or equal to 1"),
    ("schedule.mode=later", "schedule.mode", "'sync' or 'async'"),
])
def test_bad_override_exits_2_naming_path_and_option(setting: str, path: str, says: str) -> None:
    result = CliRunner().invoke(main, ["validate", str(GRPO), "--set", setting])
    assert result.exit_code == 2, result.output
    lines = result.stderr.rstrip("\n").split("\n")
    assert len(lines) <= 2 and "Traceback" not in result.stderr
    assert lines[0].startswith(f"error: --set {setting}: {path}: "), lines[0]
    assert says in result.stderr


@pytest.mark.parametrize("text", ["schedule.steps", "=3", "schedule..steps=3", "schedule.steps=[1"])
def test_malformed_set_is_a_user_error(text: str) -> None:
    with pytest.raises(JobError) as info:
        parse_override(text)
    assert str(info.value).startswith(f"--set {text}")


def test_error_found_later_points_at_the_override() -> None:
    """A mistake the typecheck finds in an overridden field is located at the option, not the file."""
    result = CliRunner().invoke(main, ["validate", str(GRPO), "--set", "nodes.update.model=actor"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: --set nodes.update.model=actor: nodes.update.model: "), result.stderr


def test_compile_honours_a_role_pin_set_by_name() -> None:
    result = CliRunner().invoke(main, ["compile", str(GRPO), "--format", "json", "--steps", "2",
                                       "--set", "placement.roles.policy/generate.tp=2",
                                       "--set", "placement.strategy=colocated"])
    assert result.exit_code == 0, result.output
    gen = [p for p in json.loads(result.stdout)["placements"] if p["role"] == "policy/generate"]
    assert gen and gen[0]["parallel"]["tp"] == 2, gen
