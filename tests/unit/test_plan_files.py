"""Plan files: exact round trip, no unpickling, clear errors for foreign or corrupted files."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from graphrl.compiler.compile import compile_job
from graphrl.errors import PlanFileError
from graphrl.loader import job_cluster, load_job
from graphrl.plan_io import load_plan, plan_from_bytes, plan_to_bytes, save_plan
from graphrl.schemas.plan import PLAN_FORMAT_VERSION

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
    (msgpack.packb({"graphrl_plan": PLAN_FORMAT_VERSION, "plan": {"job": 3}}), "corrupted"),
    (msgpack.packb({"graphrl_plan": 2, "plan": {}}), "version 2 is not supported"),
    (msgpack.packb({"graphrl_plan": 1, "plan": {}}), "version 1 is not supported"),
])
def test_bad_plan_files(payload, words):
    with pytest.raises(PlanFileError) as info:
        plan_from_bytes(payload, "x.msgpack")
    assert words in str(info.value)


def _disaggregated_plan_data():
    job = load_job(EXAMPLES / "aipo_async_tiny.yaml")
    plan = compile_job(job, job_cluster(job, None))
    return plan, msgpack.unpackb(plan_to_bytes(plan), raw=False)


def test_weight_syncs_are_typed_records_that_survive_the_file():
    plan, _ = _disaggregated_plan_data()
    (record,) = plan.programs.weight_syncs.values()
    buckets = list(record.buckets())
    assert buckets and all(b.src != b.dst for b in buckets)
    first = buckets[0]
    assert isinstance(first.slices[0].param, str) and isinstance(first.slices[0].region[0][0], int)
    assert plan_from_bytes(plan_to_bytes(plan)).programs.weight_syncs == plan.programs.weight_syncs


@pytest.mark.parametrize("edit, words", [
    (lambda ws: ws["columns"][0].__setitem__(0, "rank zero"), "columns"),  # a bucket's sender is not a rank
    (lambda ws: ws["rounds"][0].__setitem__(0, 10**6), "an index into columns"),  # a column that is not there
    (lambda ws: ws["contents"][0][1][0].__setitem__(1, 10**6), "parameters"),  # a run past the names
    (lambda ws: ws["summary"].pop("num_buckets"), "num_buckets"),
    (lambda ws: ws.__setitem__("bucket_bytes", 0), "bucket_bytes"),
])
def test_an_edited_weight_sync_record_is_refused_naming_the_field(edit, words):
    _, data = _disaggregated_plan_data()
    (ws,) = data["programs"]["weight_syncs"].values()
    edit(ws)
    with pytest.raises(PlanFileError, match="corrupted programs") as info:
        plan_from_bytes(msgpack.packb(data, use_bin_type=True), "x.msgpack")
    assert words in str(info.value)


# -- typed instructions and the plan file's schema ----------------------------------------------------

@pytest.mark.parametrize("edit, words", [
    (lambda r: r["body"][0].__setitem__(1, "3"), "= '3' is not valid"),  # a step given as text
    (lambda r: r["body"][0].append(7), "fields, got"),  # one value too many
    (lambda r: r["body"][0].__setitem__(0, "Teleport"), "unknown instruction type 'Teleport'"),
])
def test_an_edited_instruction_is_refused_naming_it(edit, words):
    _, data = _disaggregated_plan_data()
    edit(next(r for r in data["programs"]["ranks"] if r["body"]))
    with pytest.raises(PlanFileError, match="corrupted programs") as info:
        plan_from_bytes(msgpack.packb(data, use_bin_type=True), "x.msgpack")
    assert words in str(info.value)


def test_an_unknown_duration_kind_is_refused_with_the_known_ones():
    _, data = _disaggregated_plan_data()
    data["programs"]["durations"]["Teleport:policy"] = 1.0
    with pytest.raises(PlanFileError, match="unknown kind 'Teleport'") as info:
        plan_from_bytes(msgpack.packb(data, use_bin_type=True), "x.msgpack")
    assert "TrainStep" in str(info.value)


def test_instructions_are_strict_typed_records():
    from pydantic import ValidationError

    from graphrl.schemas.program import Generate, Offload

    assert Generate(1, "gen", "policy/generate", 0, 0, 4, "gen.0").stop == 4
    for bad in [("1", "gen", "p", 0, 0, 4, "g"), (True, "gen", "p", 0, 0, 4, "g"), (1, "gen", "p", 0, -1, 4, "g")]:
        with pytest.raises(ValidationError):
            Generate(*bad)
    with pytest.raises(ValidationError, match="params"):
        Offload("policy", ("weights",), 8)


def test_plan_schema_describes_every_field_and_holds_for_a_compiled_plan():
    """`graphrl schema --plan` is the plan file's reference: a compiled plan's content validates against
    it, an edited one does not, and every instruction field, program field and record field is described."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    from click.testing import CliRunner

    from graphrl.cli import main
    from graphrl.schemas.plan import plan_json_schema
    from graphrl.schemas.program import INSTRUCTION_TYPES

    schema = plan_json_schema()
    assert json.loads(CliRunner().invoke(main, ["schema", "--plan"]).output) == schema
    plan, data = _disaggregated_plan_data()
    jsonschema.validate(data, schema)
    rank = next(r for r in data["programs"]["ranks"] if r["body"])
    rank["body"][0] = rank["body"][0] + [1]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, schema)

    defs = schema["$defs"]
    for name in INSTRUCTION_TYPES:
        assert defs[name]["description"]
        assert all(item.get("description") for item in defs[name]["prefixItems"]), name
    programs = schema["properties"]["programs"]["anyOf"][0]
    for record in [schema["properties"]["plan"], *defs.values()]:
        assert all(p.get("description") for p in record.get("properties", {}).values()), record["title"]
    for record in (programs, defs["RankProgram"]):
        assert all(p.get("description") for p in record["properties"].values()), record["title"]
