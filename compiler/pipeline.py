"""The compiler pipeline: one flat, ordered list of passes. Read it top to bottom.

Each entry is a `Pass` with its contract and its stage's spec; `run_passes` enforces the contracts,
checks the specs between passes when asked (tests, `graphrl --debug`), and reports a failure with the
pass's name and the passes before it.
"""

from __future__ import annotations

from graphrl.compiler.lower import lower
from graphrl.compiler.offload import offload
from graphrl.compiler.passes import Pass
from graphrl.compiler.place import annotate_costs, place
from graphrl.compiler.reshard import reshard
from graphrl.compiler.schedule import schedule
from graphrl.compiler.typecheck import typecheck
from graphrl.compiler.verify import verify
from graphrl.compiler.weight_sync import weight_sync

# What `graphrl validate` runs: needs only the job.
FRONT: tuple[Pass, ...] = (
    typecheck,        # ports, schemas, symbolic shapes, one producer per input, acyclic data edges
)

# What `graphrl compile` runs: needs the cluster and its hardware.
PIPELINE: tuple[Pass, ...] = FRONT + (
    annotate_costs,   # parameters and FLOPs per role and step
    place,            # meshes and layouts per role; drops what does not fit; ranks by step time
    offload,          # what each role moves off its devices between uses, and how many bytes
    reshard,          # each step's responses: generator replicas -> trainer ranks, by prompt group
    weight_sync,      # each new policy version -> generator: DDMA rounds, or an in-place gather
    schedule,         # every rank's instruction order: versions per step (sync/async), checkpoints
    lower,            # per-rank programs: prologue, one-step periodic body, epilogue; durations
    verify,           # no deadlock, memory fits at every instruction, staleness bound holds
)

# Placement preview only (no programs): `graphrl compile --plan` on jobs too large to unroll quickly.
PLACEMENT_ONLY: tuple[Pass, ...] = PIPELINE[:3]
