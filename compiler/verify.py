"""The verify pass: the programs cannot deadlock, memory fits at every instruction, staleness holds.

- **deadlock**: the programs are run symbolically with blocking semantics (graphrl.compiler.simulate);
  every `Send` must meet its `Recv`, every group instruction its whole group.
- **memory**: a ledger per rank of the bytes each role keeps on the device (weights, gradients,
  optimizer state, minus what is offloaded), plus the transient bytes (activations, KV cache) of the
  instruction running; it must stay within the device's usable memory at every instruction.
- **staleness**: every `Generate` uses the version its rank holds, which was synced after the train step
  that produced it; `sync` plans generate step i with version i, `async` ones with a version no older
  than i - max_staleness.
Each violation is a `VerifyError` naming the rank, the instruction index and the reason.
"""

from __future__ import annotations


from graphrl.errors import Location, PlanFileError, VerifyError
from graphrl.schemas.plan import Layout, Plan
from graphrl.schemas.program import TRAITS, Programs, describe

from graphrl.compiler.semantics import SEMANTICS, STATE, Ledger
from graphrl.compiler.simulate import run_programs



def _ranks_of(layout: Layout, mesh_name: str) -> range:
    mesh = next(m for m in layout.meshes if m.name == mesh_name)
    return mesh.devices


def check_memory(programs: Programs, layout: Layout, usable_bytes: float) -> float:
    """Walk each rank's program with a ledger (each instruction's effect from its semantics); return the
    highest bytes seen on any device."""
    placements = {p.role: p for p in layout.placements}
    highest = 0.0
    for rank, stream in enumerate(programs.streams):
        ledger = Ledger(placements)
        for p in layout.placements:
            if rank in _ranks_of(layout, p.mesh):
                colocated_generator = p.kind == "generate" and layout.strategy == "colocated"
                ledger.keep(p.role, () if colocated_generator else STATE)
        for index, ins in enumerate(stream):
            ledger.at = (rank, index, ins)
            transient = SEMANTICS[type(ins)].memory(ins, ledger)  # applies the effect to the ledger first
            total = ledger.held + transient
            if total > highest:
                highest = total
            if total > usable_bytes * (1 + 1e-9):
                raise VerifyError(f"{ledger.where}: device memory {total / 1e9:.2f} GB exceeds the usable "
                                  f"{usable_bytes / 1e9:.2f} GB", fix="offload idle state, shard further, or use more devices")
    return highest


def check_staleness(programs: Programs, mode: str, max_staleness: int) -> None:
    streams = programs.streams  # expanded once for both walks
    produced: set[int] = {0}
    for stream in streams:
        for ins in stream:
            if TRAITS[type(ins)].weights == "produces":
                produced.add(ins.version)  # type: ignore[union-attr]
    for rank, stream in enumerate(streams):
        held: int | None = None
        for index, ins in enumerate(stream):
            weights = TRAITS[type(ins)].weights
            if weights == "sets":
                if ins.version not in produced:  # type: ignore[union-attr]
                    raise VerifyError(f"rank {rank} instruction {index} ({describe(ins)}): version {ins.version} "  # type: ignore[union-attr]
                                      "is never produced by a train step")
                held = ins.version  # type: ignore[union-attr]
            elif weights == "uses":
                version, step = ins.version, ins.step  # type: ignore[union-attr]
                if held != version:
                    raise VerifyError(f"rank {rank} instruction {index} ({describe(ins)}): generates with version "
                                      f"{version} but holds {held}", fix="compiler bug: a weight sync is missing")
                lowest = step if mode == "sync" else step - max_staleness
                if version < lowest or version > step:
                    raise VerifyError(f"rank {rank} instruction {index} ({describe(ins)}): version {version} "
                                      f"breaks the staleness bound ({mode}, max_staleness {max_staleness})")


def proof_window(programs: Programs, max_staleness: int) -> Programs:
    """The programs of the shortest run that proves every run: each prologue, `max_staleness + 2` body
    iterations on every rank, and each epilogue.

    Why that is enough: iteration k + 1 of a body is iteration k with every step, weight version and tag
    advanced by one, on every rank alike, so what one iteration does to a rank's memory, to its weight
    version and to its rendezvous with other ranks, the next one does one step later. A rank's
    cross-rank partners lie at most `max_staleness + 1` iterations away (the generator runs that far
    ahead), so a window of `max_staleness + 2` iterations contains every pattern of meeting that a
    longer run can contain, between the prologue, the body and the epilogue. A body that leaves memory
    where it found it (its offloads and onloads pair up: `check_body_memory_balance`) can run any
    number of times."""
    return programs.with_steps(programs.window_steps(max_staleness + 2))


def check_body_memory_balance(programs: Programs) -> None:
    """Every body moves as much state off the device as back onto it, role by role, so the ledger is
    the same at the start of every iteration."""
    for rank, program in enumerate(programs.ranks):
        net: dict[tuple[str, str], int] = {}
        for ins in program.body:
            moves = TRAITS[type(ins)].moves
            if moves:
                for k in ins.state:  # type: ignore[union-attr]
                    net[(ins.role, k)] = net.get((ins.role, k), 0) + moves  # type: ignore[union-attr]
        unbalanced = sorted(f"{role}.{k}" for (role, k), n in net.items() if n != 0)
        if unbalanced:
            raise VerifyError(f"rank {rank}: one loop iteration changes what is on the device "
                              f"({', '.join(unbalanced)}): memory would drift from step to step",
                              fix="compiler bug: offloads and onloads of a step must pair up")


def verify_programs(programs: Programs, layout: Layout, usable_bytes: float, mode: str, max_staleness: int) -> float:
    """Run every check on the proof window; return the peak device bytes the ledger saw."""
    check_body_memory_balance(programs)
    window = proof_window(programs, max_staleness)
    run_programs(window)  # deadlock and group agreement
    check_staleness(window, mode, max_staleness)
    return check_memory(window, layout, usable_bytes)


def runnable_plan(plan: Plan, source: str) -> Plan:
    """`plan`, read from the file `source`, once its programs are proven to run to the end; refuses an
    edited file (a send without its receive, a group instruction some members lack) by the verifier's
    deadlock check on the window that proves every run."""
    if plan.programs is None:
        return plan
    try:
        if plan.programs.num_ranks != plan.cluster.num_devices:
            raise ValueError(f"{plan.programs.num_ranks} rank programs for {plan.cluster.num_devices} devices")
        run_programs(proof_window(plan.programs, plan.job.schedule.max_staleness))
    except (VerifyError, ValueError) as exc:
        raise PlanFileError(f"the plan's programs cannot run: {exc}", location=Location(source),
                            fix="recompile the job with `graphrl compile JOB -o plan.msgpack`") from None
    return plan


__all__ = ["check_body_memory_balance", "check_memory", "check_staleness", "proof_window", "runnable_plan",
           "verify_programs"]
