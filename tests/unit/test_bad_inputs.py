"""What bad input gets: every file in tests/bad_jobs/ fails `graphrl validate` the way STYLE.md promises.

Exit code 2, no traceback, one or two lines (`error: FILE:LINE:COL: field.path: message` and
`  fix: ...`), naming the file, the line where the mistake is, and the field path or key. The table
`EXPECTED` says what each file must produce; a file added to the folder without an entry fails
`test_every_bad_job_has_an_expectation`, so the corpus and its expectations cannot drift apart.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from click.testing import CliRunner

from graphrl.cli import main

REPO = Path(__file__).resolve().parents[2]
BAD_JOBS = REPO / "tests" / "bad_jobs"


class Expect(NamedTuple):
    """What the error for one bad job must contain."""

    where: str  # the field path (or key) named in the message; "" where the whole file is wrong
    line: int | None  # 1-based line of the mistake; None where no line applies (a binary file)
    says: str = ""  # a fragment of the message itself
    file: str | None = None  # the file the error is located in, relative to tests/bad_jobs (default: the job)


EXPECTED: dict[str, Expect] = {
    # -- not YAML, or not a mapping -----------------------------------------------------------------
    "empty.yaml": Expect("", 1, "the file is empty"),
    "comments_only.yaml": Expect("", 1, "the file is empty"),
    "not_utf8.yaml": Expect("", 3, "not valid UTF-8 (byte 0xe9"),
    "binary_nul.yaml": Expect("", None, "binary file"),
    "control_character.yaml": Expect("", 14, "#x0007"),
    "top_level_list.yaml": Expect("", 1, "must be a mapping of keys, not a list"),
    "top_level_scalar.yaml": Expect("", 1, "must be a mapping of keys"),
    # -- YAML syntax and YAML features we refuse ----------------------------------------------------
    "yaml_unclosed_flow_mapping.yaml": Expect("", 29, "invalid YAML"),
    "yaml_bad_indentation.yaml": Expect("", 15, "invalid YAML"),
    "yaml_tab_indentation.yaml": Expect("", 36, "'\\t'"),
    "yaml_merge_key.yaml": Expect("nodes.update", 34, "merge keys"),
    "yaml_complex_key.yaml": Expect("nodes", 25, "plain value"),
    "yaml_int_tag_not_int.yaml": Expect("nodes.prompts.batch_size", 15, "sixteen"),
    "yaml_python_tag.yaml": Expect("nodes.score.fn", 27, "python/object"),
    "yaml_alias_bomb.yaml": Expect("", 49, "more than 1000000 values"),
    "null_node_name.yaml": Expect("nodes", 25, "null"),
    # -- duplicate keys (plain YAML keeps the last silently) ----------------------------------------
    "duplicate_node_name.yaml": Expect("nodes.score", 29, "duplicate key 'score' (first defined on line 25)"),
    "duplicate_model_name.yaml": Expect("models.policy", 10, "duplicate key 'policy' (first defined on line 7)"),
    "duplicate_top_level_key.yaml": Expect("algorithm", 43, "duplicate key 'algorithm'"),
    # -- unknown keys at every level ----------------------------------------------------------------
    "unknown_key_top_level.yaml": Expect("step", 5, "unknown key 'step'"),
    "unknown_key_in_model.yaml": Expect("models.policy.dtyp", 9, "did you mean 'dtype'"),
    "unknown_key_in_model_dims.yaml": Expect("models.policy.dims.n_layers", 9, "did you mean 'num_layers'"),
    "unknown_key_in_node.yaml": Expect("nodes.rollout.max_tokens", 24, "did you mean 'max_new_tokens'"),
    "unknown_key_in_algorithm.yaml": Expect("algorithm.learning_rate", 40, "unknown key 'learning_rate'"),
    "unknown_key_in_schedule.yaml": Expect("schedule.max_stale", 46, "did you mean 'max_staleness'"),
    "unknown_key_in_placement.yaml": Expect("placement.colocated", 49, "did you mean 'colocate'"),
    "unknown_key_in_placement_role.yaml": Expect("placement.roles.policy.gpus", 51, "unknown key 'gpus'"),
    "unknown_key_in_run.yaml": Expect("run.seeds", 48, "did you mean 'seed'"),
    # -- wrong types --------------------------------------------------------------------------------
    "wrong_type_batch_size.yaml": Expect("nodes.prompts.batch_size", 15, "must be an integer, not a string"),
    "wrong_type_nodes_is_list.yaml": Expect("nodes", 11, "valid dictionary"),
    "wrong_type_inputs_is_string.yaml": Expect("nodes.score.inputs", 28, "valid dictionary"),
    "wrong_type_temperature_list.yaml": Expect("nodes.rollout.temperature", 23, "must be a number, not a list"),
    "wrong_type_models_is_scalar.yaml": Expect("models", 6, "valid dictionary"),
    "bad_job_name.yaml": Expect("name", 2, "'grpo tiny'"),
    # -- values no run can use: no coercion between booleans, numbers and strings, no inf or nan ----
    "lr_infinite.yaml": Expect("algorithm.lr", 40, "must be a finite number (got inf)"),
    "lr_nan_word.yaml": Expect("algorithm.lr", 40, "must be a finite number, not the string 'nan'"),
    "temperature_nan.yaml": Expect("nodes.rollout.temperature", 23, "must be a finite number (got nan)"),
    "batch_size_true.yaml": Expect("nodes.prompts.batch_size", 15, "must be an integer, not a boolean (got true)"),
    "steps_quoted.yaml": Expect("schedule.steps", 45, "not a string (got '150')\n  fix: write the number without quotes"),
    "lr_quoted.yaml": Expect("algorithm.lr", 40, "must be a number, not a string (got '3.0e-3')"),
    "samples_per_prompt_float.yaml": Expect("nodes.rollout.samples_per_prompt", 21, "must be an integer (got 8.0)"),
    "normalize_one.yaml": Expect("nodes.adv.normalize", 32, "must be 'group', 'batch' or 'none'"),
    # -- counts and ranges --------------------------------------------------------------------------
    "batch_size_zero.yaml": Expect("nodes.prompts.batch_size", 15, "greater than 0"),
    "steps_negative.yaml": Expect("schedule.steps", 45, "greater than 0 (got -1)"),
    "samples_per_prompt_zero.yaml": Expect("nodes.rollout.samples_per_prompt", 21, "greater than 0"),
    "top_p_above_one.yaml": Expect("nodes.rollout.top_p", 24, "less than or equal to 1"),
    "empty_section.yaml": Expect("run", 47, "(got None)"),  # an empty value is null, not a YAML syntax error
    "missing_required_field.yaml": Expect("nodes.rollout.max_new_tokens", 18, "required field is missing"),
    # a misspelt required key is the typo at its own line, not the key it was meant to be, missing
    "misspelt_required_key.yaml": Expect("nodes.rollout.max_new_token", 22,
                                         "unknown key 'max_new_token'\n  fix: did you mean 'max_new_tokens'?"),
    "node_without_op.yaml": Expect("nodes.score", 25, "no 'op'"),
    "unknown_estimator.yaml": Expect("nodes.adv.estimator", 31, "unknown advantage estimator; known: gae, grpo, reinforce_pp, rloo"),
    # -- references between nodes -------------------------------------------------------------------
    "ref_unknown_node.yaml": Expect("nodes.adv.inputs.rewards", 32, "'scores'"),
    "ref_unknown_port.yaml": Expect("nodes.adv.inputs.rewards", 32, "no output port 'reward'"),
    "ref_malformed.yaml": Expect("nodes.score.inputs", 28, "'rollout' is not of the form 'node.port'"),
    "unknown_input_port.yaml": Expect("nodes.adv.inputs.values", 32, "no input port 'values'"),
    "required_input_unconnected.yaml": Expect("nodes.update.inputs", 37, "'advantages'"),
    "output_never_consumed.yaml": Expect("nodes.old_logprobs", 25, "never used"),
    "data_cycle.yaml": Expect("nodes.rollout.inputs", 29, "cycle"),
    # -- types and shapes along edges ---------------------------------------------------------------
    "schema_mismatch.yaml": Expect("nodes.update_policy.inputs.advantages", 47, "schema mismatch"),
    "shape_mismatch_response_len.yaml": Expect("nodes.update.inputs.rollouts", 43, "shape mismatch"),
    "shape_mismatch_batch_size.yaml": Expect("nodes.adv.inputs.rollouts", 43, "shape mismatch"),
    # -- names that resolve to nothing --------------------------------------------------------------
    "unknown_model_preset.yaml": Expect("models.policy", 7, "'tiny-digit'"),
    "unknown_op.yaml": Expect("nodes.values", 29, "unknown op 'critic'"),
    "unknown_reward_fn.yaml": Expect("nodes.score.fn", 27, "'digit_copy'"),
    "unknown_task.yaml": Expect("nodes.prompts.task", 14, "'digits-count'"),
    "reward_module_missing.yaml": Expect("nodes.score.fn", 27, "cannot import module"),
    "env_class_missing.yaml": Expect("nodes.rollout.env.class", 24, "cannot import module 'no_such_envs'"),
    "env_not_an_environment.yaml": Expect("nodes.rollout.env.class", 24, "it has no method reset(row)"),
    "env_unknown_option.yaml": Expect("nodes.rollout.env.options", 25, "'turnz': did you mean 'turns'?"),
    "env_no_room_for_a_turn.yaml": Expect("nodes.rollout.env.max_total_tokens", 27,
                                          "leaves no room for one turn"),
    "env_on_a_task_without_text.yaml": Expect("nodes.rollout.env", 22, "has no text form"),
    "undeclared_model.yaml": Expect("nodes.rollout.model", 20, "'actor' is not declared"),
    "init_from_undeclared.yaml": Expect("models.reference.init_from", 8, "'actor'"),
    # -- rules between settings ---------------------------------------------------------------------
    "model_trained_twice.yaml": Expect("nodes.update_again.model", 40, "trained by two nodes"),
    "kl_without_ref_logprobs.yaml": Expect("algorithm.kl_coef", 52, "ref_logprobs"),
    "kl_k1_in_loss.yaml": Expect("algorithm.kl_estimator", 60, "kl_in: reward"),
    "kl_k3_is_in_reward.yaml": Expect("algorithm.kl_estimator", 60, "a reward has no gradient"),
    "kl_in_reward_grpo.yaml": Expect("algorithm.kl_in", 45, "reinforce_pp"),
    "normalize_not_offered.yaml": Expect("nodes.adv.normalize", 33, "offers normalize: none"),
    "reward_fn_and_model.yaml": Expect("nodes.score", 33, "exactly one of 'fn'"),
    "reward_neither_fn_nor_model.yaml": Expect("nodes.score", 25, "exactly one of 'fn'"),
    "model_no_preset_no_dims.yaml": Expect("models.policy", 7, "exactly one of 'preset' or 'dims'"),
    "model_dims_heads_mismatch.yaml": Expect("models.policy.dims", 8, "not divisible by num_heads"),
    # -- what a rank refused when it started (or at its first step), refused by validate -------------
    "grpo_group_of_one.yaml": Expect("nodes.rollout.samples_per_prompt", 21, "set samples_per_prompt to 2 or more"),
    "rloo_group_of_one.yaml": Expect("nodes.rollout.samples_per_prompt", 21, "estimator 'rloo' of node 'adv'"),
    "task_prompt_len_too_short.yaml": Expect("nodes.prompts.prompt_len", 16, "set prompt_len to at least 6"),
    "task_unknown_option.yaml": Expect("nodes.prompts.options.num_digit", 17, "did you mean 'num_digits'?"),
    "task_option_out_of_range.yaml": Expect("nodes.prompts.options.num_digits", 17, "num_digits must be at least 1"),
    "reward_fn_wrong_signature.yaml": Expect(
        "nodes.score.fn", 27, "cannot be called as fn(prompt_ids, prompt_mask, response_ids, response_mask): its "
        "signature is (p): too many positional arguments\n  fix: define it as def basename(prompt_ids, "),
    # -- placement and clusters ---------------------------------------------------------------------
    # -- pins the model or the hardware cannot hold (refused by validate, before any search or run) ---
    "pin_tp_exceeds_devices.yaml": Expect("placement.roles.policy/generate.tp", 52, "tp 4 needs 4 devices; the mesh of 'policy/generate' has 1 or 2 devices"),
    "pin_tp_not_dividing_heads.yaml": Expect("placement.roles.policy/generate.tp", 52, "does not divide the 4 attention heads"),
    "pin_tp_kv_heads.yaml": Expect("placement.roles.policy.tp", 53, "tp 6 does not divide the 4 KV heads (a trainer does not replicate"),
    "pin_tp_not_dividing_range.yaml": Expect("placement.roles.policy.tp", 53, "tp 2 does not divide the 3 devices of its range '0-2'"),
    "pin_axes_product.yaml": Expect("placement.roles.policy", 53, "= 1 device, but the mesh of 'policy' has the 2 devices"),
    "pin_unknown_role.yaml": Expect("placement.roles.policy/gen", 52, "roles of this job: policy, policy/generate"),
    "device_range_reversed.yaml": Expect("placement.roles.policy.devices", 49, "'3-1' ends before it starts"),
    "cluster_missing.yaml": Expect("cluster", 4, "neither a preset nor an existing file"),
    "cluster_zero_devices.yaml": Expect("devices_per_node", 4, "greater than 0", file="clusters/zero_devices.yaml"),
    "cluster_unknown_hardware.yaml": Expect("", 2, "unknown hardware preset 'h100'", file="clusters/unknown_hardware.yaml"),
}

# Files that are referenced by the jobs above rather than validated themselves.
HELPER_FILES = {"clusters/zero_devices.yaml", "clusters/unknown_hardware.yaml"}

def _bad_files() -> list[str]:
    return sorted(p.relative_to(BAD_JOBS).as_posix() for p in BAD_JOBS.rglob("*") if p.is_file())


def assert_user_error(output: str, name: str, expect: Expect) -> None:
    """The shape and content STYLE.md promises for a user's mistake."""
    assert "Traceback" not in output, output
    lines = output.rstrip("\n").split("\n")
    assert 1 <= len(lines) <= 2, f"expected one or two lines, got:\n{output}"
    assert lines[0].startswith("error: "), output
    if len(lines) == 2:
        assert lines[1].startswith("  fix: "), output
    file = expect.file or name
    # The place is `FILE:LINE` or `FILE:LINE:COL` (just `FILE` where no line applies) right after "error: ";
    # FILE is the path as given, or the cluster file in a folder below it.
    place = re.escape(file) + (rf":{expect.line}(:\d+)?" if expect.line is not None else "")
    assert re.match(rf"error: (\S*/)?{place}: ", lines[0]), f"{file}:{expect.line} not at {lines[0]!r}"
    if expect.where:
        assert f": {expect.where}: " in lines[0], f"field path {expect.where!r} not in {lines[0]!r}"
    assert expect.says in output, f"{expect.says!r} not in {output!r}"  # the message or its fix


def test_every_bad_job_has_an_expectation() -> None:
    """A new bad job without an entry in EXPECTED (or an entry whose file is gone) fails here."""
    jobs = set(_bad_files()) - HELPER_FILES
    assert jobs == set(EXPECTED), (
        f"missing expectations: {sorted(jobs - set(EXPECTED))}; stale entries: {sorted(set(EXPECTED) - jobs)}"
    )
    assert len(EXPECTED) >= 34
    for helper in HELPER_FILES:
        assert (BAD_JOBS / helper).is_file()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_job_is_refused_with_its_place(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Run from the bad_jobs folder with a relative path so messages name `FILE:LINE` exactly.
    monkeypatch.chdir(BAD_JOBS)
    result = CliRunner().invoke(main, ["validate", name])
    assert result.exit_code == 2, f"exit {result.exit_code}:\n{result.output}"
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    assert result.stdout == "", result.stdout  # errors go to stderr only
    assert_user_error(result.stderr, name, EXPECTED[name])


def test_cluster_path_is_relative_to_the_job_not_the_cwd(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's `cluster: clusters/x.yaml` was resolved against the cwd first, so the same job validated
    differently depending on where it was run. From the repo root, the job's own folder must win."""
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(main, ["validate", "tests/bad_jobs/cluster_zero_devices.yaml"])
    assert result.exit_code == 2
    assert "tests/bad_jobs/clusters/zero_devices.yaml:4" in result.stderr, result.stderr


# A real process shows what reaches a terminal; only a handful, each costs an interpreter and torch import.
SUBPROCESS_CASES = ["binary_nul.yaml", "yaml_python_tag.yaml", "schema_mismatch.yaml", "cluster_zero_devices.yaml"]


def _script() -> Path | None:
    script = Path(sys.executable).parent / "graphrl"
    return script if script.exists() else None


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_bad_job_in_a_real_process(name: str) -> None:
    """`python -m graphrl.cli` and the installed `graphrl` script both exit 2 with no traceback."""
    commands = [[sys.executable, "-m", "graphrl.cli", "validate", name]]
    if name == SUBPROCESS_CASES[0] and _script() is not None:
        commands.append([str(_script()), "validate", name])
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for command in commands:
        proc = subprocess.run(command, cwd=BAD_JOBS, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2, f"{command}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
        assert proc.stdout == ""
        assert_user_error(proc.stderr, name, EXPECTED[name])
