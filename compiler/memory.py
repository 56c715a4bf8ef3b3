"""Memory of a placement candidate: what one mesh holds at its peak phase (the trainer's state by sharding,
dtype and offload; frozen models as the executors shard them; a generator's weights and KV cache)."""


from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace


from graphrl.schemas.capabilities import generator_reads_trainer
from graphrl.schemas.model import ModelDims
from graphrl.schemas.sharding import staging_layers
from graphrl.compiler import cost
from graphrl.compiler.candidates import GenCfg, Problem, TrainCfg
from graphrl.compiler.roles import Role


# ------------------------------------------------------------------------------------------------
# Memory of one mesh at its peak phase


def micro_tokens(p: Problem, cfg: TrainCfg) -> int:
    w = p.workload
    local = max(1, math.ceil(w.responses / (cfg.dp * cfg.fsdp)))
    per_micro = min(local, w.micro_batch) if w.micro_batch else local
    return per_micro * w.seq_len


def train_state(p: Problem, role: Role, cfg: TrainCfg) -> tuple[cost.MemoryBreakdown, cost.MemoryBreakdown]:
    """(device, host) bytes of a train role while it trains (optimizer offloaded between steps if cfg.offload)."""
    return cost.training_memory(
        role.dims, dp=cfg.dp, fsdp=cfg.fsdp, tp=cfg.tp, pp=cfg.pp, sharding=cfg.sharding,  # type: ignore[arg-type]
        micro_batch_tokens=micro_tokens(p, cfg), seq_len=p.workload.seq_len, recompute=cfg.recompute,
        compute_bytes=role.weight_bytes,
    )


def infer_state(p: Problem, role: Role, cfg: TrainCfg) -> cost.MemoryBreakdown:
    """A frozen model beside the trainer: split over tp like the trainer, its decoder layers sharded over
    the data-parallel ranks (ZeRO-3 inference), the embedding, final norm and head whole."""
    w = p.workload
    d = cfg.dp * cfg.fsdp
    local = max(1, math.ceil(w.responses / d))
    micro = min(local, w.micro_batch) if w.micro_batch else local
    return _frozen_state(role.dims, role.weight_bytes, cfg.tp, cfg.pp, d, micro, w.seq_len)


# Cached: the trainer candidates of a search differ in sharding, recompute and offload far more often
# than in the tp, pp and data-parallel size that a frozen model's memory depends on (405B: ten calls
# per distinct answer). The answer is a frozen value of hashable arguments.
@functools.lru_cache(maxsize=4096)
def _frozen_state(dims: ModelDims, weight_bytes: int, tp: int, pp: int, d: int, micro: int,
                  seq_len: int) -> cost.MemoryBreakdown:
    mem = cost.inference_memory(dims, tp=tp, pp=pp, precision="bf16", batch=micro, context_len=seq_len,
                                generator=False)
    dtype_bytes = max(weight_bytes, cost.BF16_BYTES)  # a float32 frozen model holds 4 bytes a weight
    params, gathered = cost.weight_bytes(dims, dtype_bytes) / (tp * pp), mem.gathered
    if d > 1:  # the decoder layers are sharded over d and gathered one (and the prefetched one) at a time;
        # the embedding, final norm and head stay whole (`executors.parallel.shard_frozen`)
        layer = cost.layer_params(dims) / tp * dtype_bytes
        layers = dims.num_layers / pp * layer
        params, gathered = params - layers + layers / d + 2 * layer, 2 * layer
    return replace(mem, params=params, gathered=gathered)


@dataclass(frozen=True)
class MeshMemory:
    """Per-role device bytes at the mesh's peak, the peak itself, and host bytes."""

    peak: float
    roles: dict[str, cost.MemoryBreakdown]
    host: dict[str, cost.MemoryBreakdown]
    offloaded: dict[str, tuple[str, ...]]


def _idle(mem: cost.MemoryBreakdown, offloaded: tuple[str, ...]) -> float:
    """Bytes an idle role keeps on the device: its state minus what is offloaded, no activations."""
    keep = {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer}
    return sum(v for k, v in keep.items() if k not in offloaded)


def resident_while_generating(mem: MeshMemory) -> float:
    """Bytes per device the trainer mesh keeps while a colocated generator runs on it: every role's
    idle state, minus what the candidate offloads. The search, the plan's layout and its predicted
    Generate duration all leave the generator the rest."""
    return sum(_idle(m, mem.offloaded[name]) for name, m in mem.roles.items())


def trainer_mesh_memory(p: Problem, cfg: TrainCfg, extra_resident: float = 0.0) -> MeshMemory:
    """Peak bytes per device of the trainer mesh: the train roles and the frozen roles beside them.

    Phases run one at a time: the frozen models' forwards, then each train role's update. In a phase the
    active role holds its full state plus activations; idle roles hold their state minus what the
    candidate offloads (optimizer and gradients of idle train roles, weights of idle frozen roles).
    `extra_resident` is memory held by another role in every phase (the colocated generator, say).
    """
    roles: dict[str, cost.MemoryBreakdown] = {}
    host: dict[str, cost.MemoryBreakdown] = {}
    offloaded: dict[str, tuple[str, ...]] = {}
    for role in p.roles_of("train"):
        dev, h = train_state(p, role, cfg)
        roles[role.name], host[role.name] = dev, h
        offloaded[role.name] = ("grads", "optimizer") if cfg.offload else ()
    for role in p.roles_of("infer"):
        roles[role.name] = infer_state(p, role, cfg)
        host[role.name] = cost.MemoryBreakdown()
        offloaded[role.name] = ("params",) if cfg.offload else ()
    # Train roles that also run forwards (a critic's values, the old policy's log-probs) keep their
    # weights in every phase anyway (only their gradients and optimizer state are offloaded).
    phases = [[r.name for r in p.roles_of("infer")]] + [[r.name] for r in p.roles_of("train")]
    peak = 0.0
    for active in phases:
        total = extra_resident
        for name, mem in roles.items():
            total += mem.total if name in active else _idle(mem, offloaded[name])
        peak = max(peak, total)
    return MeshMemory(peak, roles, host, offloaded)


def gen_per_sequence(p: Problem, role: Role, tp: int) -> float:
    """Device bytes one in-flight sequence adds to a generator: its KV cache and decode activations."""
    one = cost.inference_memory(role.dims, tp=tp, pp=1, precision="bf16", batch=1,
                                context_len=p.workload.seq_len, generator=True)
    return one.kv_cache + one.activations


def gen_kv_per_token(role: Role, tp: int) -> float:
    """Device bytes one cached token adds to a generator (a tp rank holds its share of the KV heads)."""
    return cost.kv_cache_bytes_per_token(role.dims, cost.BF16_BYTES) / cost.kv_shards(role.dims, tp)


def reads_trainer(p: Problem, train: TrainCfg, gen: GenCfg | None) -> bool:
    """Whether a colocated generator of this layout samples from the trainer's own weights
    (`generator_reads_trainer`, the rule the executors follow): they are charged once, as the trainer
    holds them (whole, or gathered by FSDP2 from the sync through the next backward), and the sync is
    that gather or nothing."""
    if gen is None or train.pp > 1:
        return False
    role = p.policy
    one_unit = cost.fsdp_unit_layers(role.dims, tp=1, dtype_bytes=role.weight_bytes) >= role.dims.num_layers
    return generator_reads_trainer(colocated=True, gen_tp=gen.tp, precision=gen.precision, train_tp=train.tp,
                                   sharding=train.sharding, one_unit=one_unit)


def gen_weights(role: Role, tp: int, precision: str) -> float:
    """A generator's weight bytes per device: the model's own dtype (a float32 CPU model stores 4 bytes per
    weight); with fp8, the block linears at 1 byte plus their scales and the rest still at the dtype."""
    dtype_bytes = max(role.weight_bytes, cost.BF16_BYTES)
    if precision == "fp8":
        return cost.weight_bytes(role.dims, cost.PRECISION_BYTES["fp8"], dtype_bytes) / tp
    return cost.weight_bytes(role.dims, dtype_bytes) / tp


def engine_weights(role: Role, tp: int, precision: str, engine: str) -> float:
    """Bytes per device of a serving engine's own copy of the generator's weights. The role's module stays
    beside it (the weight sync fills it, the engine reloads from it); the native sampler samples from the
    module itself (none)."""
    return 0.0 if engine == "native" else gen_weights(role, tp, precision)


def held_weights(role: Role, tp: int, precision: str, engine: str, *, reads: bool = False) -> float:
    """Bytes per device of a generator's weights as its rank holds them beyond the trainer's: the role's
    module (none when it is the trainer's, `reads`), and beside it a serving engine's own copy."""
    own = 0.0 if reads else gen_weights(role, tp, precision)
    return own + engine_weights(role, tp, precision, engine)


def engine_resident(role: Role, tp: int, precision: str, engine: str, kv_tokens: float, *,
                    sleeps: bool = False) -> float:
    """Bytes per device a serving engine keeps through every phase: its weights and its KV cache, which
    it allocates once at start (none for the native sampler, whose cache lives for one generation, and
    none for an engine that sleeps between its generations, `engine_sleeps`: it holds them only while it
    generates)."""
    if engine == "native" or sleeps:
        return 0.0
    return engine_weights(role, tp, precision, engine) + kv_tokens * gen_kv_per_token(role, tp)


def gen_sync_staging(role: Role, tp: int, precision: str, *, colocated: bool, engine: str = "native") -> float:
    """Bytes per device a generator holds beside its weights while a weight sync fills it:
    - fp8: the block linears of one staging group of layers (`staging_layers`; the sync runs group by
      group) of its shard at the trainer's dtype, received whole before they are quantized
      (`executors.fp8.staging_tensors`). A colocated tp-1 generator quantizes the trainer's weights tensor
      by tensor (none staged); a generator at the model's precision receives straight into its weights.
    - a vLLM engine over a tensor-parallel replica: the whole weights, gathered from the replica's shards
      on its first rank for the engine's reload (its workers cut their own shards); charged on every rank
      of the replica."""
    staging = 0.0
    if precision == "fp8" and not (colocated and tp == 1):
        layers = staging_layers(role.dims, tp)
        staging += cost.layer_linear_params(role.dims) * layers / tp * max(role.weight_bytes, cost.BF16_BYTES)
    if engine == "vllm" and tp > 1:
        staging += gen_weights(role, 1, precision)
    return staging
