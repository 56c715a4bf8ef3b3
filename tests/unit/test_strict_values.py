"""Strict scalar types: what the schemas accept, beside what tests/bad_jobs shows they refuse.

Pydantic's lax mode took `batch_size: true` as 1, `lr: "1e-3"` as a number and `lr: .inf` as a learning
rate. The schemas now keep a value's type as written; these tests pin the one conversion kept (an
integer for a real number) and the YAML 1.2 floats the loader reads, so strictness does not refuse
what users rightly write.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from graphrl.builder import Job
from graphrl.errors import JobError
from graphrl.loader import load_job_text
from graphrl.schemas.cluster import ClusterSpec

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml").read_text()


@pytest.mark.parametrize("written, value", [("1", 1.0), ("1e-3", 1e-3), ("2.5E-4", 2.5e-4), ("1.0e-3", 1e-3), ("3", 3.0)])
def test_numbers_as_yaml_writes_them_are_accepted(written: str, value: float) -> None:
    """`lr: 1e-3` is a string under PyYAML's YAML 1.1 rules; a strict float field would refuse it, so the
    loader reads plain exponent numbers as YAML 1.2 does. An integer stays fine where a real is typed."""
    job = load_job_text(EXAMPLE.replace("lr: 1.0e-3", f"lr: {written}"), "job.yaml")
    assert job.spec.algorithm.lr == value and isinstance(job.spec.algorithm.lr, float)


def test_quoted_number_stays_a_string_and_is_refused() -> None:
    with pytest.raises(JobError) as info:
        load_job_text(EXAMPLE.replace("lr: 1.0e-3", 'lr: "1e-3"'), "job.yaml")
    assert info.value.path == ("algorithm", "lr")
    assert "not a string" in info.value.message and info.value.fix == "write the number without quotes"


def test_python_jobs_are_as_strict_as_yaml() -> None:
    job = Job("strict", cluster="local-cpu-2")
    job.model("policy", preset="tiny-digits")
    with pytest.raises(JobError) as info:
        job.dataset("prompts", task="digits-copy", batch_size=True, prompt_len=6)
        job.build()
    assert "batch_size" in str(info.value)


@pytest.mark.parametrize("field, value", [("num_nodes", True), ("devices_per_node", "2"), ("host_memory_bytes", float("inf"))])
def test_cluster_files_are_strict_too(field: str, value: object) -> None:
    with pytest.raises(ValueError):
        ClusterSpec(**{"name": "c", "num_nodes": 1, "devices_per_node": 2, "hardware": "cpu-local", field: value})


def test_task_options_refuse_non_finite_values_with_one_message() -> None:
    """An option's value may be any scalar, but not inf: the union's four member errors are one field's
    error, and the finite-number one is reported."""
    with pytest.raises(JobError) as info:
        load_job_text(EXAMPLE.replace("options: {num_digits: 4}", "options: {num_digits: .inf}"), "job.yaml")
    assert info.value.path == ("nodes", "prompts", "options", "num_digits")
    assert info.value.message == "must be a finite number (got inf)"
