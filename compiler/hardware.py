"""Which `HardwareSpec` a cluster means: a datasheet preset, an explicit description, or `cpu-local`.

`cpu-local` uses the figures `graphrl calibrate` measured on this machine when a calibration file exists
(`$GRAPHRL_CALIBRATION`, default `~/.cache/graphrl/cpu-local.json`), and the preset's defaults
otherwise. Setting GRAPHRL_CALIBRATION=none ignores any calibration (used by golden-plan tests, so
plans do not depend on the machine that compiles them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import ValidationError

from graphrl.errors import ClusterError
from graphrl.schemas.cluster import ClusterSpec
from graphrl.schemas.hardware import HARDWARE_PRESETS, HardwareSpec


def calibration_path() -> Path | None:
    value = os.environ.get("GRAPHRL_CALIBRATION")
    if value is not None:
        return None if value.lower() in ("", "none", "0") else Path(value)
    return Path.home() / ".cache" / "graphrl" / "cpu-local.json"


def load_calibration(path: Path) -> HardwareSpec:
    try:
        return HardwareSpec.model_validate(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, ValidationError) as exc:
        raise ClusterError(f"calibration file {path} is unreadable: {exc}".splitlines()[0],
                           fix="rerun `graphrl calibrate`, or set GRAPHRL_CALIBRATION=none") from None


def resolve_hardware(cluster: ClusterSpec) -> HardwareSpec:
    if isinstance(cluster.hardware, HardwareSpec):
        return cluster.hardware
    if cluster.hardware == "cpu-local":
        path = calibration_path()
        if path is not None and path.exists():
            return load_calibration(path)
    return HARDWARE_PRESETS[cluster.hardware]
