"""Memory by kind: the bytes a role holds on one device (weights, gradients, optimizer state, activations, KV
cache, an engine's copy) and what a candidate's meshes hold at their peak phase.

The role-level formulas (`training_memory`, `inference_memory`) take a model's sizes (`model.py`) and a
layout's degrees; the mesh accounting below them charges each role of a placement candidate as the
executors hold it (the trainer's state by sharding, dtype and offload; frozen models as the executors
shard them; a generator's weights, KV cache and staging) and finds the phase where a mesh holds most.
The search rejects what does not fit with these figures, and the plan records them.

Memory follows mixed-precision Adam accounting (ZeRO, Rajbhandari et al. 2020) and the activation
accounting of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models").
Units: bytes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from graphrl.compiler.cost.model import (
    ADAM_MOMENT_BYTES_PER_PARAM,
    BF16_BYTES,
    FP32_BYTES,
    LOGIT_BYTES,
    fsdp_unit_layers,
    kv_cache_bytes_per_token,
    kv_shards,
    layer_linear_params,
    layer_params,
    param_count,
    weight_bytes,
)
from graphrl.compiler.roles import Role
from graphrl.schemas.capabilities import generator_reads_trainer
from graphrl.schemas.job import PRECISION_BYTES, SHARDINGS, Precision, Sharding
from graphrl.schemas.model import ModelDims
from graphrl.schemas.sharding import lora_param_count, staging_layers

if TYPE_CHECKING:  # the candidates' types only: candidates.py reads the cost model
    from graphrl.compiler.candidates import GenCfg, Problem, TrainCfg


# --------------------------------------------------------------------------------------------------
# Memory of one role


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes held on one device (or in one host's memory for that device), by kind."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    gathered: float = 0.0
    """Of `params` and `grads`: the unsharded copies a sharded role holds only while it computes
    (FSDP2's all-gathered weights and unreduced gradients); the rest is its resting state."""
    engine_weights: float = 0.0
    """A serving engine's own copy of a generator's weights, beside the role's module."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.kv_cache + self.engine_weights

    @property
    def resting_state(self) -> float:
        """Weights, gradients and optimizer state held between steps (what a run's ledger measures)."""
        return self.params + self.grads + self.optimizer - self.gathered

    def as_dict(self) -> dict[str, float]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "kv_cache": self.kv_cache,
            "gathered": self.gathered,
            "engine_weights": self.engine_weights,
            "total": self.total,
        }

    def __add__(self, other: "MemoryBreakdown") -> "MemoryBreakdown":
        if not isinstance(other, MemoryBreakdown):
            return NotImplemented
        return MemoryBreakdown(
            self.params + other.params,
            self.grads + other.grads,
            self.optimizer + other.optimizer,
            self.activations + other.activations,
            self.kv_cache + other.kv_cache,
            self.gathered + other.gathered,
            self.engine_weights + other.engine_weights,
        )

    def __radd__(self, other: object) -> "MemoryBreakdown":
        # Lets `sum(breakdowns)` start from 0.
        if other == 0:
            return self
        return NotImplemented


ZERO_MEMORY = MemoryBreakdown()


def activation_bytes_per_token_per_layer(
    dims: ModelDims, seq_len: int, tp: int, flash_attention: bool = True
) -> float:
    """Activation bytes one token leaves in one layer for the backward pass (bf16, no recompute).

    Korthikanti et al. 2022, section 4: s*b*h*(34 + 5*a*s/h) per layer, i.e. 34*H + 5*heads*seq per
    token, all of it divided by tp (tensor + sequence parallelism). The 5*heads*seq term is the
    stored softmax scores, dropout mask and dropped-out scores; flash attention (torch SDPA on GPUs)
    stores none of them, only an fp32 log-sum-exp per head: 4*heads bytes. The 34*H term assumes a 4H
    GELU MLP; it is kept as published for the SwiGLU MLP.
    """
    attention = 4 * dims.num_heads if flash_attention else 5 * dims.num_heads * seq_len
    return (34 * dims.hidden_size + attention) / tp


def training_memory(
    dims: ModelDims,
    *,
    dp: int,
    fsdp: int,
    tp: int,
    pp: int,
    sharding: Sharding,
    micro_batch_tokens: int,
    seq_len: int,
    recompute: bool,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    flash_attention: bool = True,
    compute_bytes: int = BF16_BYTES,
    adapter_params: float | None = None,
) -> tuple[MemoryBreakdown, MemoryBreakdown]:
    """Bytes a training role holds per device, and per device in host memory: (device, host).

    State is charged as the executors hold it (`graphrl.schemas.capabilities`). `compute_bytes` is the
    model's dtype: 2 (bfloat16) trains in mixed precision, bf16 weights and gradients with fp32 master
    weights and AdamW moments (2 + 2 + 12 bytes per parameter, ZeRO paper section 3.1); 4 (float32)
    holds 4 + 4 + 8. Per device, parameters are first divided by tp*pp (model parallel, balanced
    stages), then over the data-parallel group D = dp*fsdp as the sharding runs:
      none (DDP): nothing sharded;
      zero1 (DDP + ZeroRedundancyOptimizer): the optimizer state (fp32 master and moments) / D;
      zero2, fsdp (FSDP2): weights, gradients and optimizer state rest as shards (/ D). The unsharded
        copies are `gathered`: zero2 (`reshard_after_forward=False`) keeps every unit's weights from
        forward through backward, fsdp the current and the prefetched unit's; both hold one unit's
        unreduced gradient. A unit is consecutive layers up to `FSDP_UNIT_BYTES` (`fsdp_layer_units`);
        a model smaller than that is one unit, gathered whole.
    offload_optimizer moves the optimizer state to host; offload_params moves the weight and gradient
    shards to host (FSDP2 CPUOffloadPolicy), leaving only the gathered buffers on the device.
    `adapter_params`: LoRA adapters train on a frozen base: the weights are the base's and the adapters' (those
    one tp rank holds, `lora_param_count(..., tp)`), gradients and optimizer state the adapters' alone (sharded
    over the data-parallel group as above).

    Activations for one micro-batch of `micro_batch_tokens` tokens on one data-parallel rank, with
    L/pp layers per stage, per token per layer:
      no recompute: `activation_bytes_per_token_per_layer` (Korthikanti et al. 2022);
      full recompute: only the layer input 2*H/tp, plus one layer's full working set for the
      micro-batch being recomputed.
    With pipeline parallelism (1F1B), the first stage keeps pp micro-batches in flight (Korthikanti
    et al. 2022, pipeline parallelism), so it holds about L layers' worth regardless of pp; the last
    stage keeps one micro-batch plus the logits. Logits: micro_batch_tokens * vocab * (2 + 4) / tp
    (bf16 output and its fp32 upcast for the loss). The larger of the two stages is returned.
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; expected one of {SHARDINGS}")
    d = dp * fsdp
    base_per_device = param_count(dims) / (tp * pp)
    adapters_per_device = (adapter_params or 0.0) / pp
    params_per_device = base_per_device + adapters_per_device
    trained_share = 1.0 if adapter_params is None else adapters_per_device / params_per_device
    trained_per_device = params_per_device * trained_share
    mixed = compute_bytes < FP32_BYTES
    master = FP32_BYTES if mixed else 0  # an fp32 copy of the weights beside the compute-dtype ones
    layer_bytes = layer_params(dims) / tp * compute_bytes
    unit_bytes = fsdp_unit_layers(dims, tp=tp, dtype_bytes=compute_bytes, pp=pp) * layer_bytes
    whole = unit_bytes >= dims.num_layers / pp * layer_bytes  # one unit: the model with its root
    gathered_weights = gathered_grads = 0.0
    weights = params_per_device * compute_bytes
    grads = trained_per_device * compute_bytes
    optimizer = trained_per_device * (ADAM_MOMENT_BYTES_PER_PARAM + master)
    if sharding in ("zero1", "zero2", "fsdp"):
        optimizer /= d
    if sharding in ("zero2", "fsdp") and d > 1:
        gathered_weights = params_per_device * compute_bytes if sharding == "zero2" or whole else 2 * unit_bytes
        gathered_grads = (params_per_device * compute_bytes if whole else unit_bytes) * trained_share
        weights = weights / d + gathered_weights
        grads = grads / d + gathered_grads

    host_weights = host_grads = host_optimizer = 0.0
    if offload_optimizer:
        host_optimizer, optimizer = optimizer, 0.0
    if offload_params:  # only the buffers a layer is computed with stay on the device
        host_weights, host_grads = weights - gathered_weights, grads - gathered_grads
        gathered_weights, gathered_grads = min(2 * unit_bytes, params_per_device * compute_bytes), unit_bytes
        weights, grads = gathered_weights, gathered_grads
    gathered = gathered_weights + gathered_grads

    layers_per_stage = dims.num_layers / pp
    per_token = activation_bytes_per_token_per_layer(dims, seq_len, tp, flash_attention)
    full_layer = micro_batch_tokens * per_token
    if recompute:
        per_micro_batch = micro_batch_tokens * layers_per_stage * BF16_BYTES * dims.hidden_size / tp
        working = full_layer
    else:
        per_micro_batch = full_layer * layers_per_stage
        working = 0.0
    logits = micro_batch_tokens * dims.vocab_size * LOGIT_BYTES / tp
    first_stage = pp * per_micro_batch + working + (logits if pp == 1 else 0.0)
    last_stage = per_micro_batch + working + logits
    activations = max(first_stage, last_stage)

    device = MemoryBreakdown(params=weights, grads=grads, optimizer=optimizer, activations=activations,
                             gathered=gathered)
    host = MemoryBreakdown(params=host_weights, grads=host_grads, optimizer=host_optimizer)
    return device, host


def inference_memory(
    dims: ModelDims,
    *,
    tp: int,
    pp: int,
    precision: Precision,
    batch: int,
    context_len: int,
    kv_bytes_per_elem: float = BF16_BYTES,
    generator: bool = True,
) -> MemoryBreakdown:
    """Bytes per device of a generator (`generator=True`) or a frozen forward-only model (logprob,
    value, reward: `generator=False`).

    params: `weight_bytes(dims, precision bytes)` / (tp*pp).
    kv_cache (generators only): batch * context_len * kv_cache_bytes_per_token / (min(tp, kv_heads)*pp).
    activations: no backward, so only one layer's transient working set is alive, per token
    4*H (residual stream and its normed copy, replicated over tp) + 6*I/tp (SwiGLU gate, up and
    their product, bf16), plus logits vocab*(2+4)/tp (bf16 and fp32, for sampling or log-softmax).
    A generator's decode step processes `batch` tokens; a forward pass batch*context_len tokens
    (pass the micro-batch as `batch`).
    """
    if precision not in PRECISION_BYTES:
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(PRECISION_BYTES)}")
    bytes_per_param = PRECISION_BYTES[precision]
    params = weight_bytes(dims, bytes_per_param) / (tp * pp)
    tokens = batch if generator else batch * context_len
    per_token = (
        2 * dims.hidden_size * BF16_BYTES
        + 3 * dims.intermediate_size * BF16_BYTES / tp
        + dims.vocab_size * LOGIT_BYTES / tp
    )
    activations = tokens * per_token
    kv_cache = 0.0
    if generator:
        kv_cache = batch * context_len * kv_cache_bytes_per_token(dims, kv_bytes_per_elem) / (
            kv_shards(dims, tp) * pp
        )
    return MemoryBreakdown(params=params, activations=activations, kv_cache=kv_cache)


# ------------------------------------------------------------------------------------------------
# Memory of one mesh at its peak phase


def micro_tokens(p: Problem, cfg: TrainCfg) -> int:
    w = p.workload
    local = max(1, math.ceil(w.responses / (cfg.dp * cfg.fsdp)))
    per_micro = min(local, w.micro_batch) if w.micro_batch else local
    return per_micro * w.seq_len


def train_state(p: Problem, role: Role, cfg: TrainCfg) -> tuple[MemoryBreakdown, MemoryBreakdown]:
    """(device, host) bytes of a train role while it trains (optimizer offloaded between steps if cfg.offload)."""
    return training_memory(
        role.dims, dp=cfg.dp, fsdp=cfg.fsdp, tp=cfg.tp, pp=cfg.pp, sharding=cfg.sharding,  # type: ignore[arg-type]
        micro_batch_tokens=micro_tokens(p, cfg), seq_len=p.workload.seq_len, recompute=cfg.recompute,
        compute_bytes=role.weight_bytes, adapter_params=adapter_count(role, cfg.tp),
    )


def adapter_count(role: Role, tp: int = 1) -> int | None:
    """A LoRA role's adapter parameters on one rank of a tp group (None: the role has no adapters)."""
    return lora_param_count(role.dims, role.lora, tp) if role.lora is not None else None


def infer_state(p: Problem, role: Role, cfg: TrainCfg) -> MemoryBreakdown:
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
def _frozen_state(dims: ModelDims, role_bytes: int, tp: int, pp: int, d: int, micro: int,
                  seq_len: int) -> MemoryBreakdown:
    mem = inference_memory(dims, tp=tp, pp=pp, precision="bf16", batch=micro, context_len=seq_len,
                           generator=False)
    dtype_bytes = max(role_bytes, BF16_BYTES)  # a float32 frozen model holds 4 bytes a weight
    params, gathered = weight_bytes(dims, dtype_bytes) / (tp * pp), mem.gathered
    if d > 1:  # the decoder layers are sharded over d and gathered one (and the prefetched one) at a time;
        # the embedding, final norm and head stay whole (`executors.parallel.shard_frozen`)
        layer = layer_params(dims) / tp * dtype_bytes
        layers = dims.num_layers / pp * layer
        params, gathered = params - layers + layers / d + 2 * layer, 2 * layer
    return replace(mem, params=params, gathered=gathered)


@dataclass(frozen=True)
class MeshMemory:
    """Per-role device bytes at the mesh's peak, the peak itself, and host bytes."""

    peak: float
    roles: dict[str, MemoryBreakdown]
    host: dict[str, MemoryBreakdown]
    offloaded: dict[str, tuple[str, ...]]


def _idle(mem: MemoryBreakdown, offloaded: tuple[str, ...]) -> float:
    """Bytes an idle role keeps on the device: its state minus what is offloaded, no activations."""
    keep = {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer}
    return sum(v for k, v in keep.items() if k not in offloaded)


def offloaded_bytes(mem: MeshMemory, role: str) -> float:
    """Bytes per device `role` moves to host while it is idle, and back before its phase."""
    return sum(getattr(mem.roles[role], k) for k in mem.offloaded[role])


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
    roles: dict[str, MemoryBreakdown] = {}
    host: dict[str, MemoryBreakdown] = {}
    offloaded: dict[str, tuple[str, ...]] = {}
    for role in p.roles_of("train"):
        dev, h = train_state(p, role, cfg)
        roles[role.name], host[role.name] = dev, h
        offloaded[role.name] = ("grads", "optimizer") if cfg.offload else ()
    for role in p.roles_of("infer"):
        roles[role.name] = infer_state(p, role, cfg)
        host[role.name] = MemoryBreakdown()
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
    # A weight sync that merges the policy's adapters stages one group of layers of its merged linears
    # beside every role's resting state.
    staging = merged_sync_staging(p, cfg)
    if staging:
        peak = max(peak, extra_resident + staging + sum(_idle(m, offloaded[n]) for n, m in roles.items()))
    return MeshMemory(peak, roles, host, offloaded)


def merged_sync_staging(p: Problem, cfg: TrainCfg) -> float:
    """Bytes per device a trainer stages while it sends its weights with its LoRA adapters folded in
    (`lora.sync: merged`): its shard of one staging group's merged linears (`sync_staging_layers`' groups)."""
    policy = p.policy
    if policy.lora is None:  # asked for every trainer candidate: a job without adapters answers at once
        return 0.0
    gen = p.generator
    if gen is None or gen.lora is not None:
        return 0.0
    held = cfg.tp * (cfg.dp * cfg.fsdp if cfg.sharding in ("zero2", "fsdp") else 1)
    layers = staging_layers(policy.dims, cfg.tp * cfg.fsdp)
    return layers * layer_linear_params(policy.dims) / held * max(policy.weight_bytes, BF16_BYTES)


def gen_per_sequence(p: Problem, role: Role, tp: int) -> float:
    """Device bytes one in-flight sequence adds to a generator: its KV cache and decode activations."""
    one = inference_memory(role.dims, tp=tp, pp=1, precision="bf16", batch=1,
                            context_len=p.workload.seq_len, generator=True)
    return one.kv_cache + one.activations


def gen_kv_per_token(role: Role, tp: int) -> float:
    """Device bytes one cached token adds to a generator (a tp rank holds its share of the KV heads)."""
    return kv_cache_bytes_per_token(role.dims, BF16_BYTES) / kv_shards(role.dims, tp)


def reads_trainer(p: Problem, train: TrainCfg, gen: GenCfg | None) -> bool:
    """Whether a colocated generator of this layout samples from the trainer's own weights
    (`generator_reads_trainer`, the rule the executors follow): they are charged once, as the trainer
    holds them (whole, or gathered by FSDP2 from the sync through the next backward), and the sync is
    that gather or nothing."""
    if gen is None or train.pp > 1:
        return False
    role = p.policy
    one_unit = fsdp_unit_layers(role.dims, tp=1, dtype_bytes=role.weight_bytes) >= role.dims.num_layers
    return generator_reads_trainer(colocated=True, gen_tp=gen.tp, precision=gen.precision, train_tp=train.tp,
                                   sharding=train.sharding, one_unit=one_unit)


def gen_weights(role: Role, tp: int, precision: str) -> float:
    """A generator's weight bytes per device: the model's own dtype (a float32 CPU model stores 4 bytes per
    weight); with fp8, the block linears at 1 byte plus their scales and the rest still at the dtype."""
    dtype_bytes = max(role.weight_bytes, BF16_BYTES)
    adapters = (adapter_count(role, tp) or 0) * dtype_bytes  # a LoRA generator's share of the adapters
    if precision == "fp8":
        return weight_bytes(role.dims, PRECISION_BYTES["fp8"], dtype_bytes) / tp + adapters
    return weight_bytes(role.dims, dtype_bytes) / tp + adapters


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
        staging += layer_linear_params(role.dims) * layers / tp * max(role.weight_bytes, BF16_BYTES)
    if engine == "vllm" and tp > 1:
        staging += gen_weights(role, 1, precision)
    return staging


def generator_memory(p: Problem, gen: GenCfg, *, concurrent: int, kv_tokens: float, reads: bool) -> MemoryBreakdown:
    """Bytes per device of the generator while it generates, as the plan records them: its weights (none
    where it samples from the trainer's, `reads`), a cache of `kv_tokens` tokens, the decode activations of
    `concurrent` sequences, and a serving engine's own copy of the weights."""
    g = p.generator
    assert g is not None
    mem = inference_memory(g.dims, tp=gen.tp, pp=1, precision=gen.precision,  # type: ignore[arg-type]
                           batch=concurrent, context_len=p.workload.seq_len, generator=True)
    return replace(mem, params=0.0 if reads else gen_weights(g, gen.tp, gen.precision),
                   kv_cache=kv_tokens * gen_kv_per_token(g, gen.tp),
                   engine_weights=engine_weights(g, gen.tp, gen.precision, p.engine_of(g.name)))


def colocated_peak(mem: MeshMemory, gen_mem: MemoryBreakdown, staging: float, kept: float) -> float:
    """Peak bytes per device of a mesh that trains and generates: the trainer's peak phase beside what the
    engine keeps through every phase (`kept`, `engine_resident`), the generation beside the trainer's idle
    state, or a weight sync filling the generator (its weights and `staging`) beside both."""
    resident = resident_while_generating(mem)
    return max(mem.peak + kept, resident + gen_mem.total, resident + (gen_mem.params + staging) + kept)


def generator_mesh_peak(gen_mem: MemoryBreakdown, staging: float, kept: float) -> float:
    """Peak bytes per device of a generator's own mesh: its generation, or a weight sync filling its weights
    (with `staging`) beside what its engine keeps (`kept`)."""
    return max(gen_mem.total, gen_mem.params + staging + kept)
