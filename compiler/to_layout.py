"""From the search's chosen candidate to the plan's typed `Layout`: meshes, role placements with their
memory, inserted operations and the estimate, and the candidate summaries the preview lists. Every figure
on them (bytes, seconds, peaks) is the cost model's (`cost/`); this module assembles them."""


from __future__ import annotations

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

from graphrl.compiler.candidates import Evaluated, Problem
from graphrl.compiler.cost import (MemoryBreakdown, colocated_peak, engine_resident, gen_sync_staging,
                                   generation_phase, generator_memory, generator_mesh_peak, offload_time,
                                   offloaded_bytes, reads_trainer, reshard_in_place_time, resident_while_generating,
                                   rollout_transfer_time, trainer_mesh_memory, weight_sync_time)
from graphrl.compiler.placement import SearchResult
from graphrl.compiler.roles import Role, effective_mode


# ------------------------------------------------------------------------------------------------
# From a chosen candidate to the plan's Layout


def _staging_groups(role: Role, tp: int) -> str:
    """How a sync into an fp8 generator runs: its staging groups of layers, one after the other."""
    layers = staging_layers(role.dims, tp)
    groups = -(-role.dims.num_layers // layers)
    return "the whole model at once" if groups == 1 else f"{groups} groups of {layers} layers in turn"


def _mem_bytes(m: MemoryBreakdown) -> MemoryBytes:
    return MemoryBytes(params=m.params, grads=m.grads, optimizer=m.optimizer, activations=m.activations,
                       kv_cache=m.kv_cache, gathered=m.gathered, engine_weights=m.engine_weights)


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
            moved = offloaded_bytes(mem, role.name) * train.n
            t = offload_time(moved / train.n, p.hw)
            operations.append(Operation(kind="offload", src=role.name, dst="host", num_bytes=moved, time_s=t,
                                        detail=f"{', '.join(mem.offloaded[role.name])} while idle"))
            operations.append(Operation(kind="onload", src="host", dst=role.name, num_bytes=moved, time_s=t,
                                        detail="before its phase"))
    environment_s = 0.0
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
        res = generation_phase(p, gen, free, reads=reads)
        environment_s = res.env_seconds if res else 0.0
        kv_tokens = res.kv_tokens if res else p.workload.seq_len
        gmem = generator_memory(p, gen, concurrent=res.concurrent if res else 1, kv_tokens=kv_tokens, reads=reads)
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
            staging = gen_sync_staging(g, gen.tp, gen.precision, colocated=True, engine=engine)
            device_memory.append(DeviceMemory(mesh=trainer_mesh, peak_bytes=colocated_peak(mem, gmem, staging, kept),
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
            device_memory.append(DeviceMemory(mesh="generator", peak_bytes=generator_mesh_peak(gmem, staging, kept),
                                              capacity_bytes=capacity, roles=[g.name]))
    else:
        device_memory.append(DeviceMemory(mesh=trainer_mesh, peak_bytes=mem.peak, capacity_bytes=capacity,
                                          roles=[pl.role for pl in placements]))
    estimate = StepEstimate(step_time_s=ev.step_time_s, phases=ev.phases, mode=effective_mode(p.mode, ev.strategy),
                            environment_s=environment_s)
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
