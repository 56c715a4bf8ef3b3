"""Which `HardwareSpec` a cluster means: a datasheet preset, an explicit description, or `cpu-local`.

`cpu-local` uses the figures `graphrl calibrate` measured on this machine when a calibration file exists
(`$GRAPHRL_CALIBRATION`, default `~/.cache/graphrl/cpu-local.json`), and the preset's defaults
otherwise. Setting GRAPHRL_CALIBRATION=none ignores any calibration (used by golden-plan tests, so
plans do not depend on the machine that compiles them).

A calibration file that cannot be trusted (unreadable, corrupt, of another format version, or measured on
another machine) is never an error: compiling still works, with a `CalibrationWarning` that names the file
and the reason, on the preset's defaults.
"""

from __future__ import annotations

import json
import os
import platform
import warnings
from pathlib import Path

from pydantic import ValidationError

from graphrl.errors import CalibrationWarning, format_path
from graphrl.schemas.cluster import ClusterSpec
from graphrl.schemas.hardware import CALIBRATION_FORMAT, HARDWARE_PRESETS, HardwareSpec, MachineId

CPUINFO = Path("/proc/cpuinfo")


def calibration_path() -> Path | None:
    value = os.environ.get("GRAPHRL_CALIBRATION")
    if value is not None:
        return None if value.lower() in ("", "none", "0") else Path(value)
    return Path.home() / ".cache" / "graphrl" / "cpu-local.json"


def _cpu_model() -> str:
    """/proc/cpuinfo's first `model name` (Linux), else what platform.processor() says (macOS, Windows)."""
    try:
        for line in CPUINFO.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor().strip()


def this_machine(threads: int | None = None) -> MachineId:
    """The machine this process runs on (`threads`: the torch threads per rank of a measurement, if any)."""
    return MachineId(cpu_model=_cpu_model(), logical_cores=os.cpu_count() or 1, threads=threads)


def _read_trusted(path: Path) -> tuple[HardwareSpec | None, str]:
    """(the calibration in `path`, "") when it can be used on this machine, else (None, why not)."""
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"unreadable ({type(exc).__name__}: {exc})".splitlines()[0]
    if not isinstance(raw, dict):
        return None, f"not a hardware description (a JSON {type(raw).__name__}, not an object)"
    # The version first: a file of another version may fail the schema only because of that.
    found = raw.get("calibration_format")
    if found is None or raw.get("machine") is None:
        return None, (f"older format (it records no {'format version' if found is None else 'machine'}; "
                      f"this graphrl reads format {CALIBRATION_FORMAT})")
    if found != CALIBRATION_FORMAT:
        return None, f"format version {found!r}; this graphrl reads format {CALIBRATION_FORMAT}"
    try:
        spec = HardwareSpec.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        return None, f"not a valid hardware description ({format_path(err['loc'])}: {err['msg']})"
    assert spec.machine is not None
    here = this_machine()
    if not spec.machine.same_machine(here):
        return None, f"measured on another machine ({spec.machine.describe()}; this one is {here.describe()})"
    return spec, ""


def load_calibration(path: Path, preset: str = "cpu-local") -> HardwareSpec:
    """The calibration in `path`, or, with a `CalibrationWarning` naming the file and the reason, the
    `preset`'s defaults when the file is corrupt, invalid, of another format version or from another
    machine."""
    spec, reason = _read_trusted(path)
    if spec is not None:
        return spec
    warnings.warn(f"calibration file {path} ignored: {reason}; using the {preset} defaults (rerun graphrl calibrate)",
                  CalibrationWarning, stacklevel=2)
    return HARDWARE_PRESETS[preset]


def resolve_hardware(cluster: ClusterSpec) -> HardwareSpec:
    if isinstance(cluster.hardware, HardwareSpec):
        return cluster.hardware
    if cluster.hardware == "cpu-local":
        path = calibration_path()
        if path is not None and path.exists():
            return load_calibration(path)
    return HARDWARE_PRESETS[cluster.hardware]


def measured_environment(env: str, options: dict) -> float | None:
    """Seconds of one call of an environment (its class and options) as this machine's calibration measured
    them (`graphrl calibrate JOB`), or None. An environment runs on the host whatever the devices."""
    path = calibration_path()
    if path is None or not path.exists():
        return None
    spec, _ = _read_trusted(path)
    key = json.dumps(options, sort_keys=True)
    found = [t for t in (spec.environments if spec is not None else ()) if t.env == env and t.options == key]
    return found[-1].seconds_per_call if found else None
