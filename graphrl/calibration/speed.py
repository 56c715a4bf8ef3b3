"""The machine-speed check a run prints: one of a calibration's matmuls timed again now.

A shared machine's speed drifts; `graphrl run` on a calibrated machine reports this ratio beside the
prediction's error, so the error can be read against how far the machine itself moved.
"""

from __future__ import annotations

from typing import Any

import torch

from graphrl.calibration.harness import best_time
from graphrl.calibration.microbench import TORCH_DTYPES
from graphrl.schemas.hardware import HardwareSpec


def machine_speed(hw: HardwareSpec) -> dict[str, Any] | None:
    """This machine's speed now against its speed when `hw` was calibrated: the calibration's largest
    matmul (most work per call: its largest weight at its most rows) timed again as `measure_matmuls` timed
    it, same dtype and threads. `ratio` above 1: faster now. A run's prediction error can then be read
    beside how far the machine itself moved (a shared VM's speed drifts by 10-25% between hours). None
    where `hw` holds no measured matmuls (a preset)."""
    if not hw.matmuls:
        return None
    fit = max(hw.matmuls, key=lambda f: f.k * f.n * f.rows[-1])
    rows, dtype = fit.rows[-1], TORCH_DTYPES[fit.dtype_bytes]
    previous = torch.get_num_threads()
    torch.set_num_threads(fit.threads)
    try:
        w, x = torch.randn(fit.n, fit.k, dtype=dtype), torch.randn(rows, fit.k, dtype=dtype)
        seconds = best_time(lambda: torch.nn.functional.linear(x, w), repeat=3, min_time_s=0.01)
    finally:
        torch.set_num_threads(previous)
    return {"k": fit.k, "n": fit.n, "rows": rows, "threads": fit.threads, "dtype_bytes": fit.dtype_bytes,
            "calibrated_s": fit.seconds[-1], "measured_s": seconds, "ratio": fit.seconds[-1] / seconds}
