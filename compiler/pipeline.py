"""The compiler pipeline: one flat, ordered list of passes. Read it top to bottom.

Each entry is a `Pass` with its contract; `run_passes` enforces the contracts and reports a failure
with the pass's name and the passes before it.
"""

from __future__ import annotations

from graphrl.compiler.passes import Pass
from graphrl.compiler.place import annotate_costs, place, schedule, verify
from graphrl.compiler.typecheck import typecheck

# What `graphrl validate` runs: needs only the job.
FRONT: tuple[Pass, ...] = (
    typecheck,        # ports, schemas, symbolic shapes, one producer per input, acyclic data edges
)

# What `graphrl compile` runs: needs the cluster and its hardware.
PIPELINE: tuple[Pass, ...] = FRONT + (
    annotate_costs,   # parameters and FLOPs per role and step
    place,            # meshes and layouts per role; drops what does not fit; ranks by step time
    schedule,         # reshard, DDMA weight sync, offload/onload; unroll steps into per-rank programs
    verify,           # no deadlock, memory fits at every instruction, staleness bound holds
)

# Placement preview only (no programs): `graphrl compile --plan` on jobs too large to unroll quickly.
PLACEMENT_ONLY: tuple[Pass, ...] = PIPELINE[:3]
