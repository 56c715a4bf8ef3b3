"""Plan files: exact round trip, no unpickling, clear errors for foreign or corrupted files."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from graphrl.compiler.compile import compile_job
from graphrl.errors import PlanFileError
from graphrl.loader import job_cluster, load_job
from graphrl.plan_io import load_plan, plan_from_bytes, plan_to_bytes, save_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", ["grpo_tiny.yaml", "ppo_tiny.yaml", "llama3_70b.yaml"])
def test_round_trip_is_exact(tmp_path, name):
    job = load_job(EXAMPLES / name)
    plan = compile_job(job, job_cluster(job, None))
    save_plan(plan, tmp_path / "plan.msgpack")
    again = load_plan(tmp_path / "plan.msgpack")
    assert again == plan
    assert plan_to_bytes(again) == plan_to_bytes(plan)


@pytest.mark.parametrize("payload, words", [
    (b"\x80\x04\x95garbage-pickle", "not a"),
    (msgpack.packb({"something": 1}), "not a graphrl plan"),
    (msgpack.packb({"graphrl_plan": 999, "plan": {}}), "version 999"),
    (msgpack.packb({"graphrl_plan": 2, "plan": {"job": 3}}), "corrupted"),
    (msgpack.packb({"graphrl_plan": 1, "plan": {}}), "version 1 is not supported"),
])
def test_bad_plan_files(payload, words):
    with pytest.raises(PlanFileError) as info:
        plan_from_bytes(payload, "x.msgpack")
    assert words in str(info.value)
