"""Plan files: msgpack of the plan's JSON form, with a format version. Loading never unpickles.

A file is a msgpack map `{"graphrl_plan": <format version>, "plan": <Plan as JSON-compatible data>}`.
Loading checks the magic key and the version, then validates through the pydantic `Plan` model, so a
corrupted or foreign file is an error naming the file, never arbitrary code execution. Whether its programs
run to the end is the compiler's check (`graphrl.compiler.verify.runnable_plan`), made where a plan file is
taken in (the CLI); the ranks read the plan their launcher took, as it is.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgpack
from pydantic import ValidationError

from graphrl.errors import Location, PlanFileError
from graphrl.schemas.plan import PLAN_FORMAT_VERSION, Plan
from graphrl.schemas.program import Programs

MAGIC = "graphrl_plan"


def plan_to_bytes(plan: Plan) -> bytes:
    body = {MAGIC: PLAN_FORMAT_VERSION, "plan": plan.model_dump(mode="json", exclude={"programs"}),
            "programs": plan.programs.to_data() if plan.programs is not None else None}
    return msgpack.packb(body, use_bin_type=True)


def plan_from_bytes(data: bytes, source: str = "<bytes>") -> Plan:
    """The plan in `data`."""
    where = Location(source)
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise PlanFileError(f"not a plan file (msgpack: {exc})", location=where,
                            fix="write one with `graphrl compile JOB -o plan.msgpack`") from None
    if not isinstance(obj, dict) or MAGIC not in obj:
        raise PlanFileError("not a graphrl plan file", location=where,
                            fix="write one with `graphrl compile JOB -o plan.msgpack`")
    if obj[MAGIC] != PLAN_FORMAT_VERSION:
        older = {1: " (version 1 plans unrolled every step; this graphrl writes periodic programs)",
                 2: " (version 2 plans stored meshes as first device and count; this graphrl stores their devices)",
                 3: " (version 3 plans left the executors to resolve the job graph; this graphrl binds it in the plan)",
                 6: " (version 6 plans left ranks to plan the weight syncs they did not store; this graphrl stores "
                    "every sync's rounds)"}.get(obj[MAGIC], "")
        raise PlanFileError(f"plan format version {obj[MAGIC]} is not supported (this graphrl reads "
                            f"{PLAN_FORMAT_VERSION}){older}", location=where, fix="recompile the job with this graphrl")
    try:
        programs = Programs.from_data(obj["programs"]) if obj.get("programs") is not None else None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PlanFileError(f"plan file has corrupted programs: {exc}", location=where, fix="recompile the job") from None
    try:
        return Plan.model_validate({**obj["plan"], "programs": programs})
    except ValidationError as exc:
        raise PlanFileError(f"plan file is corrupted: {exc.errors()[0]['msg']} at "
                            f"{'.'.join(map(str, exc.errors()[0]['loc']))}", location=where,
                            fix="recompile the job") from None


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write atomically: a temporary file in the same folder, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(plan_to_bytes(plan))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_plan(path: str | Path) -> Plan:
    """The plan in file `path` (`plan_from_bytes`)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PlanFileError(f"cannot read plan file {path}: {exc.strerror}", fix="check the path") from None
    return plan_from_bytes(data, str(path))
