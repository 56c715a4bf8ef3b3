"""The calibration file: a `HardwareSpec` written atomically, stamped with its machine and format, so that
another machine or another graphrl ignores it (graphrl.compiler.hardware reads it).
"""

from __future__ import annotations

import os
from pathlib import Path

from graphrl.schemas.hardware import HardwareSpec


def write_calibration(spec: HardwareSpec, path: Path) -> None:
    """Write `spec` to `path` atomically, stamped with this machine and the calibration format (unless
    `spec` already names them), so that another machine or another graphrl ignores the file."""
    from graphrl.compiler.hardware import this_machine
    from graphrl.schemas.hardware import CALIBRATION_FORMAT

    # `calibrate` measures one torch thread per process, as ranks run by default.
    spec = spec.model_copy(update=dict(machine=spec.machine or this_machine(threads=1),
                                       calibration_format=spec.calibration_format or CALIBRATION_FORMAT))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(spec.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)
