"""From the search's chosen candidate to the plan's typed `Layout`: meshes, role placements with their
memory, inserted operations and the estimate, each instruction kind's predicted duration on it, and the
candidate summaries the preview lists."""


from __future__ import annotations

import math
from dataclasses import replace

from graphrl.schemas.mesh import Mesh
from graphrl.schemas.sharding import staging_layers
from graphrl.engine_support import engine_sleeps
from graphrl.schemas.plan import (
    CandidateSummary,
    DeviceMemory,
    Layout,
    MemoryBytes,
    Operation,
    RolePlacement,
    StepEstimate,
)
from graphrl.schemas.program import CostKey

from graphrl.compiler import cost, timing
from graphrl.compiler.candidates import Evaluated, Problem
from graphrl.compiler.memory import (engine_resident, engine_weights, gen_kv_per_token, gen_sync_staging, gen_weights,
                                     reads_trainer, resident_while_generating, trainer_mesh_memory)
from graphrl.compiler.placement import (SearchResult, generation_time, reshard_in_place_time, role_times,
                                        rollout_transfer_time, weight_sync_time)
from graphrl.compiler.roles import Role, effective_mode


# ------------------------------------------------------------------------------------------------
# From a chosen candidate to the plan's Layout


def _staging_groups(role: Role, tp: int) -> str:
    """How a sync into an fp8 generator runs: its staging groups of layers, one after the other."""
    layers = staging_layers(role.dims, tp)
    groups = -(-role.dims.num_layers // layers)
    return "the whole model at once" if groups == 1 else f"{groups} groups of {layers} layers in turn"


def _mem_bytes(m: cost.MemoryBreakdown) -> MemoryBytes:
    return MemoryBytes(params=m.params, grads=m.grads, optimizer=m.optimizer, activations=m.activations,
                       kv_cache=m.kv_cache, gathered=m.gathered, engine_weights=m.engine_weights)


def layout_durations(p: Problem, ev: Evaluated, layout: Layout) -> dict[CostKey, float]:
    """Predicted seconds of each (instruction kind, role) on a candidate's layout, from the cost model:
    every role's forward and update, generation, the in-place reshard of a colocated policy, and the
    per-job kinds. Weight syncs by DDMA are timed by their own planner (compiler/weight_sync.py)."""
    reads = layout.strategy == "colocated" and reads_trainer(p, ev.train, ev.gen)
    durations = dict(role_times(p, ev.train, gathered_at_sync=reads))
    overhead = p.hw.op_overhead_s
    durations.update({CostKey("Rule"): overhead, CostKey("Advantage"): overhead, CostKey("Checkpoint"): overhead,
                      CostKey("ReleaseWeights"): 0.0})
    gen_role = p.generator
    if gen_role is not None and ev.gen is not None:
        free = p.usable
        if layout.strategy == "colocated":
            free = p.usable - resident_while_generating(trainer_mesh_memory(p, ev.train))
            durations[CostKey("ReshardInPlace", p.policy.model)] = reshard_in_place_time(p, ev.train, ev.gen)[0]
        res = generation_time(p, ev.gen, free, reads=reads)
        durations[CostKey("Generate", gen_role.name)] = res[0] if res else math.inf
    return durations


def to_layout(p: Problem, ev: Evaluated) -> Layout:
    """The plan's view of a candidate: meshes, per-role placements with memory, inserted operations."""
    train, gen = ev.train, ev.gen
    meshes: list[Mesh] = []
    placements: list[RolePlacement] = []
    operations: list[Operation] = []
    device_memory: list[DeviceMemory] = []
    trainer_mesh = "all" if ev.strategy == "colocated" else "trainer"
    meshes.append(train.mesh(trainer_mesh))
    mem = trainer_mesh_memory(p, train)
    capacity = p.hw.memory_bytes
    for role in p.roles_of("train", "infer"):
        placements.append(RolePlacement(
            role=role.name, model=role.model, kind=role.kind, ops=list(role.ops), mesh=trainer_mesh,
            dp=train.dp, fsdp=train.fsdp, tp=train.tp, pp=train.pp,
            sharding=train.sharding if role.kind == "train" else ("fsdp" if train.dp * train.fsdp > 1 else "none"),  # type: ignore[arg-type]
            precision="bf16", offload=list(mem.offloaded[role.name]),  # type: ignore[arg-type]
            memory_bytes=_mem_bytes(mem.roles[role.name]), host_bytes=_mem_bytes(mem.host[role.name]),
        ))
        if mem.offloaded[role.name]:
            moved = sum(getattr(mem.roles[role.name], k) for k in mem.offloaded[role.name]) * train.n
            t = timing.offload_time(moved / train.n, p.hw)
            operations.append(Operation(kind="offload", src=role.name, dst="host", num_bytes=moved, time_s=t,
                                        detail=f"{', '.join(mem.offloaded[role.name])} while idle"))
            operations.append(Operation(kind="onload", src="host", dst=role.name, num_bytes=moved, time_s=t,
                                        detail="before its phase"))
    if gen is not None and p.generator is not None:
        g = p.generator
        engine = p.engine_of(g.name)
        gen_mesh = trainer_mesh if ev.strategy == "colocated" else "generator"
        if ev.strategy == "disaggregated":
            meshes.append(gen.mesh("generator"))
            free = p.usable
        else:
            free = p.usable - resident_while_generating(mem)
        # A generator that samples from the trainer's weights holds none of its own: the trainer's are charged.
        reads = ev.strategy == "colocated" and reads_trainer(p, train, gen)
        res = generation_time(p, gen, free, reads=reads)
        concurrent = res.concurrent if res else 1
        gmem = cost.inference_memory(g.dims, tp=gen.tp, pp=1, precision=gen.precision,  # type: ignore[arg-type]
                                     batch=concurrent, context_len=p.workload.seq_len, generator=True)
        kv_tokens = res.kv_tokens if res else p.workload.seq_len
        gmem = replace(gmem, params=0.0 if reads else gen_weights(g, gen.tp, gen.precision),
                       kv_cache=kv_tokens * gen_kv_per_token(g, gen.tp),
                       engine_weights=engine_weights(g, gen.tp, gen.precision, engine))
        sleeps = engine_sleeps(engine, colocated=ev.strategy == "colocated", device_kind=p.hw.kind)
        kept = engine_resident(g, gen.tp, gen.precision, engine, kv_tokens, sleeps=sleeps)  # through every phase
        placements.append(RolePlacement(
            role=g.name, model=g.model, kind="generate", ops=list(g.ops), mesh=gen_mesh, dp=gen.dp, tp=gen.tp,
            precision=gen.precision, engine=engine, sleeps=sleeps, memory_bytes=_mem_bytes(gmem),  # type: ignore[arg-type]
        ))
        if ev.strategy == "colocated":
            t, b = reshard_in_place_time(p, train, gen)
            if reads and b:
                fill = (f"gather the trainer's {train.sharding} shards in place: the generator samples from the "
                        "gathered weights, which the trainer's next forward and backward use")
            elif b:
                fill = f"fill tp{gen.tp} generator shards from the trainer's {train.sharding} shards"
            else:
                fill = "the generator reads the trainer's weights in place"
            operations.append(Operation(
                kind="reshard_in_place", src=p.policy.name, dst=g.name, num_bytes=b, time_s=t,
                detail=fill
                + (", quantized to fp8 on this device" if gen.precision == "fp8" else "")
                + _engine_reload(engine, gen.tp)))
            resident = resident_while_generating(mem)
            synced = gmem.params + gen_sync_staging(g, gen.tp, gen.precision, colocated=True, engine=engine)
            device_memory.append(DeviceMemory(mesh=trainer_mesh, peak_bytes=max(mem.peak + kept, resident + gmem.total,
                                                                               resident + synced + kept),
                                              capacity_bytes=capacity, roles=[pl.role for pl in placements]))
        else:
            staging = gen_sync_staging(g, gen.tp, gen.precision, colocated=False, engine=engine)
            t, b = weight_sync_time(p, train, gen)
            operations.append(Operation(
                kind="weight_sync", src=p.policy.name, dst=g.name, num_bytes=b, time_s=t,
                detail=f"DDMA point-to-point, {train.n} senders -> {gen.n} receivers ({gen.dp} replicas x tp{gen.tp})"
                       + (f", fp8: received at the trainer's dtype ({staging / 2**30:.2f} GiB staged per device, "
                          f"{_staging_groups(g, gen.tp)}) and quantized" if gen.precision == "fp8" else "")
                       + _engine_reload(engine, gen.tp)))
            t, b = rollout_transfer_time(p, p.spans(min(train.first, gen.first), train.n + gen.n))
            operations.append(Operation(kind="reshard", src=g.name, dst=trainer_mesh, num_bytes=b, time_s=t,
                                        detail=f"rollouts from {gen.dp} generator replicas to {train.dp * train.fsdp} trainer ranks, balanced by tokens"))
            device_memory.append(DeviceMemory(mesh=trainer_mesh, peak_bytes=mem.peak, capacity_bytes=capacity,
                                              roles=[pl.role for pl in placements if pl.mesh == trainer_mesh]))
            device_memory.append(DeviceMemory(mesh="generator", peak_bytes=max(gmem.total, gmem.params + staging + kept),
                                              capacity_bytes=capacity, roles=[g.name]))
    else:
        device_memory.append(DeviceMemory(mesh=trainer_mesh, peak_bytes=mem.peak, capacity_bytes=capacity,
                                          roles=[pl.role for pl in placements]))
    estimate = StepEstimate(step_time_s=ev.step_time_s, phases=ev.phases, mode=effective_mode(p.mode, ev.strategy))
    return Layout(strategy=ev.strategy, label=ev.label, meshes=meshes, placements=placements,
                  operations=operations, device_memory=device_memory, estimate=estimate)


def summaries(result: SearchResult, limit: int = 200) -> list[CandidateSummary]:
    """The best candidates, then rejected ones (one per distinct reason first), for --explain and JSON."""
    out = [CandidateSummary(label=e.label, strategy=e.strategy, fits=True, step_time_s=e.step_time_s)
           for e in result.ranked[: limit // 2]]
    seen: set[str] = set()
    firsts, rest = [], []
    for e in sorted(result.rejected, key=lambda e: (e.overflow, e.label)):
        reason_kind = (e.reason or "").split(" needs")[0].split(" weights")[0]
        (rest if reason_kind in seen else firsts).append(e)
        seen.add(reason_kind)
    for e in (firsts + rest)[: limit - len(out)]:
        out.append(CandidateSummary(label=e.label, strategy=e.strategy, fits=False, reason=e.reason))
    return out


def _engine_reload(engine: str, tp: int) -> str:
    """How a weight sync's operation ends for the generator's engine (the preview's detail)."""
    if engine != "vllm":
        return ""
    if tp == 1:
        return ", then reloaded into the vLLM engine"
    return ", then reloaded into each replica's vLLM engine as whole tensors gathered on its first rank"
