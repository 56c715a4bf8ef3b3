"""The compiler pipeline: one flat, ordered list of passes. Read it top to bottom.

Each entry is a `Pass` with its contract; `run_passes` enforces the contracts and reports a failure
with the pass's name and the passes before it.
"""

from __future__ import annotations

from graphrl.compiler.passes import Pass
from graphrl.compiler.typecheck import typecheck

# Front half: what `graphrl validate` runs. Needs only the job.
FRONT: tuple[Pass, ...] = (
    typecheck,  # ports, schemas, symbolic shapes, one producer per input, acyclic data edges
)

PIPELINE: tuple[Pass, ...] = FRONT
