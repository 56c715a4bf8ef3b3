"""The phase table: what one step of a placement candidate costs, phase by phase (generation, the trainer
mesh's forwards and updates, offloading, weight sync, the colocated reshard, the rollouts' transfer), and
each instruction kind's predicted duration on its layout.

These are the model's time (`timing.py`) and memory (`memory.py`) applied to one candidate as the
executors run it: how a generator's share of the responses fits its cache and in how many waves, how a
pass is cut into micro-batches, how many optimizer steps an update takes, what a weight sync moves. The
search sums them into a candidate's step time, the plan's Layout records them on its operations, and
`layout_durations` hands them to the simulator as the lowered programs' durations.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from graphrl.compiler.cost.memory import (
    gen_kv_per_token,
    gen_per_sequence,
    held_weights,
    infer_state,
    reads_trainer,
    resident_while_generating,
    train_state,
    trainer_mesh_memory,
)
from graphrl.compiler.cost.model import (
    BF16_BYTES,
    fsdp_units,
    param_count,
    param_tensor_count,
    weight_bytes,
)
from graphrl.compiler.cost.timing import (
    chunked_collective_time,
    collective_time,
    engine_refit_seconds,
    engine_time_factor,
    forward_time,
    generation_time,
    offload_time,
    p2p_seconds,
    training_step_time,
    weight_copy_seconds,
)
from graphrl.compiler.ddma import DDMA_BUCKET_BYTES
from graphrl.compiler.roles import Role, Workload
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.model import ModelDims
from graphrl.schemas.plan import Layout, LoraFigure, LoraSummary
from graphrl.schemas.program import CostKey
from graphrl.schemas.sharding import llama_params, lora_param_count, region_size, shard_bounds

from graphrl.ops import rollout_bytes_per_response

if TYPE_CHECKING:  # the candidates' types only: candidates.py reads the cost model
    from graphrl.compiler.candidates import Evaluated, GenCfg, Problem, TrainCfg


# ------------------------------------------------------------------------------------------------
# The phases of one candidate


class GenerationTime(NamedTuple):
    seconds: float
    concurrent: int  # sequences in flight per replica
    kv_tokens: float  # KV-cache tokens a replica holds
    env_seconds: float = 0.0  # of `seconds`, an episode node's environment calls on the critical path


def generation_phase(p: Problem, gen: GenCfg, free_bytes: float, *, reads: bool = False) -> GenerationTime | None:
    """Seconds of generating one step's responses, the sequences in flight and the KV-cache tokens per
    replica; None if no sequence fits next to the weights. Replicas run in parallel, each wave of one
    replica timed by `timing.generation_time`.

    The native sampler allocates each sequence's cache for prompt_len + max_new_tokens up front: a replica
    that cannot hold its whole share at once generates it in waves. An engine with a paged cache holds
    only the tokens that exist and frees a response's blocks when it ends: it needs the peak of the
    running responses' tokens (`Lengths.peak_tokens`), and runs in waves only where that exceeds its
    cache. A generator's `memory_fraction` pin is the share of the device its weights and cache take
    (vLLM's gpu_memory_utilization: the engine reserves all of it), so it must be free beside whatever
    else stays resident while it generates (else None: a layout that offloads more may fit). `reads`: the
    generator samples from the trainer's weights (`reads_trainer`), which `free_bytes` has left out already."""
    role = p.generator
    assert role is not None
    w = p.workload
    hint = p.hint(role.name)
    engine = p.engine_of(role.name)
    if hint.memory_fraction is not None:
        if hint.memory_fraction * p.hw.memory_bytes > free_bytes:
            return None
        free_bytes = hint.memory_fraction * p.hw.memory_bytes
    per_seq = gen_per_sequence(p, role, gen.tp)
    room = free_bytes - held_weights(role, gen.tp, gen.precision, engine, reads=reads)
    share = math.ceil(w.responses / gen.dp)
    if per_seq <= 0 or room < per_seq:
        return None
    lengths = w.response_lengths
    if engine == "native":
        concurrent = int(room // per_seq)
        waves = math.ceil(share / concurrent)
        kv_tokens = min(concurrent, share) * w.seq_len
    else:
        per_token = gen_kv_per_token(role, gen.tp)
        activations = per_seq - per_token * w.seq_len  # one decode row's working set
        capacity = (room - activations * share) / per_token  # tokens of KV cache
        if capacity < w.seq_len:
            return None
        peak = lengths.peak_tokens(share, w.prompt_len)
        waves = math.ceil(peak / capacity)
        kv_tokens = capacity if hint.memory_fraction is not None else min(capacity, max(peak, w.seq_len))
    batch = math.ceil(share / waves)
    timed = functools.partial(generation_time, role.dims, batch, tp=gen.tp, precision=gen.precision, hw=p.hw,
                    intra_node=not p.tp_group_spans(gen.tp), dtype_bytes=role.weight_bytes,
                    continuous=engine != "native", lora=role.lora)
    if w.episode is None:
        t = waves * timed(prompt_len=w.prompt_len, response_len=w.response_len, lengths=lengths)
        env = 0.0
    else:  # each turn prefills the episode so far and decodes the model's turn; the environment answers it
        t = waves * sum(timed(prompt_len=w.prompt_len + context, response_len=tokens)
                        for context, tokens in w.episode.turn_plan(w.response_len))
        env = waves * w.episode.env_seconds(w.response_len)
    t *= engine_time_factor(p.hw, engine)
    return GenerationTime(t + env + p.hw.op_overhead_s, min(batch, share), kv_tokens, env)


# One float64 per reported metric (reward sum and count, tokens, loss, KL, entropy, grad norm, ...).
METRICS_BYTES = 16 * 8


@dataclass(frozen=True)
class PassShape:
    """What one log-prob, value or training pass over `responses` responses computes (all data-parallel
    ranks together), as the executors cut it."""

    tokens: float  # tokens through the trunk
    keys: float  # keys each token attends to
    head_rows: float  # positions the head scores: the real response tokens
    microbatches: int  # per data-parallel rank


def pass_shape(w: Workload, responses: int, d: int, pp: int) -> PassShape:
    """A pass over `responses` responses on `d` data-parallel ranks: each rank's share cut into micro-batches
    of `micro_batch` rows (packed: of a token budget of `micro_batch` longest sequences), one when unset;
    pipelines need at least pp of them in flight."""
    local = max(1, math.ceil(responses / d))
    lengths = w.response_lengths
    if w.pack:
        budget = w.micro_batch * w.seq_len if w.micro_batch else math.inf
        micro = max(1, math.ceil(local * (w.prompt_len + lengths.mean) / budget))
    else:
        micro = max(1, math.ceil(local / w.micro_batch)) if w.micro_batch else 1
    seq, keys = w.pass_sequence(local / micro)
    micro = max(micro, 4 * pp) if pp > 1 else micro
    return PassShape(responses * seq, keys, responses * lengths.mean, micro)


def role_times(p: Problem, cfg: TrainCfg, *, gathered_at_sync: bool = False) -> dict[CostKey, float]:
    """Seconds per step of each op kind of each role on the trainer mesh, keyed by (kind, role)
    (e.g. TrainStep of policy, Forward of reference); the instruction durations the simulator uses.
    A training step is `updates_per_step` passes of `optimizer_steps` optimizer steps, each over its
    mini-batch. `gathered_at_sync`: a colocated generator's weight sync gathered the policy's weights
    (`reads_trainer`), so the first optimizer step's forward gathers nothing."""
    w = p.workload
    d = cfg.dp * cfg.fsdp
    spans_dp = p.spans(cfg.first, cfg.n) if d > 1 else False
    common = dict(hw=p.hw, dp=cfg.dp, fsdp=cfg.fsdp, tp=cfg.tp, pp=cfg.pp,
                  intra_node_tp=not p.tp_group_spans(cfg.tp), dp_spans_nodes=spans_dp)
    whole = pass_shape(w, w.responses, d, cfg.pp)
    mini = pass_shape(w, w.responses // w.optimizer_steps, d, cfg.pp)
    out: dict[CostKey, float] = {}
    for role in p.roles_of("infer", "train"):
        forward = forward_time(role.dims, tokens=whole.tokens, seq_len=whole.keys, head_rows=whole.head_rows,
                               microbatches=whole.microbatches, dtype_bytes=role.weight_bytes,
                               trained=role.kind == "train",
                               # frozen models are sharded over the trainer's ranks (`infer_state`)
                               sharded=role.kind == "infer" or cfg.sharding in ("zero2", "fsdp"),
                               **common).total_s + p.hw.op_overhead_s
        if role.kind == "infer":
            out[CostKey("Forward", role.name)] = forward
            continue
        shape = dict(tokens=mini.tokens, seq_len=mini.keys, head_rows=mini.head_rows, microbatches=mini.microbatches,
                     sharding=cfg.sharding, recompute=cfg.recompute, dtype_bytes=role.weight_bytes, lora=role.lora)
        step = training_step_time(role.dims, **shape, **common).total_s  # type: ignore[arg-type]
        first = step
        if gathered_at_sync and role is p.policy:
            first = training_step_time(role.dims, **shape, **common,  # type: ignore[arg-type]
                                       weights_gathered=True).total_s
        steps = w.updates_per_step * w.optimizer_steps
        out[CostKey("TrainStep", role.name)] = first + step * (steps - 1) + p.hw.op_overhead_s
        if role is p.policy:  # the step's metrics (reward, loss, ...) are all-reduced over the trainer ranks
            out[CostKey("TrainStep", role.name)] += collective_time(
                "all_reduce", METRICS_BYTES, cfg.n, p.hw, p.spans(cfg.first, cfg.n))
        # A trained role may also run forwards: a critic's values, the policy's old log-probs.
        if role.forwards:
            out[CostKey("Forward", role.name)] = forward
    return out


def offload_bytes(p: Problem, cfg: TrainCfg) -> float:
    """Bytes per device moved to host (and back) each step when the candidate offloads idle state."""
    if not cfg.offload:
        return 0.0
    moved = 0.0
    for role in p.roles_of("train"):
        dev, _ = train_state(p, role, cfg)
        moved += dev.grads + dev.optimizer
    for role in p.roles_of("infer"):
        moved += infer_state(p, role, cfg).params
    return moved


def trainer_times(p: Problem, cfg: TrainCfg, *, gathered_at_sync: bool = False) -> dict[str, float]:
    """Seconds per step of the trainer mesh's phases: frozen forwards ('infer'), updates ('train') and
    moving idle state to host and back ('offload'); `gathered_at_sync` as for `role_times`."""
    per_role = role_times(p, cfg, gathered_at_sync=gathered_at_sync)
    return {
        "infer": sum(v for k, v in per_role.items() if k.kind == "Forward"),
        "train": sum(v for k, v in per_role.items() if k.kind == "TrainStep"),
        "offload": 2 * offload_time(offload_bytes(p, cfg), p.hw),
    }


def synced_bytes(generator: Role) -> float:
    """Bytes one generator replica receives per weight sync: the bf16 weights, or where it holds LoRA adapters
    (`lora.sync: adapters`), the adapters alone (it keeps the base it loaded)."""
    if generator.lora is not None:
        return lora_param_count(generator.dims, generator.lora) * BF16_BYTES
    return weight_bytes(generator.dims, BF16_BYTES)


def weight_sync_time(p: Problem, train: TrainCfg, gen: GenCfg) -> tuple[float, float]:
    """(seconds, bytes on links) for DDMA: every generator replica receives the full bf16 weights,
    split over its tp ranks; all trainer ranks send in parallel. The busier of the receive side (one
    generator rank's share) and the send side (all bytes over all trainer ranks) moves its bytes in
    rounds of at most one DDMA bucket, timed as the weight-sync pass times the planned rounds
    (`weight_copy_seconds`); a serving engine then reloads them (`engine_reload_time`)."""
    role = p.policy
    weights = synced_bytes(p.generator or role)
    total = weights * gen.dp
    spans = p.spans(min(train.first, gen.first), train.n + gen.n)
    busiest = max(weights / gen.tp, total / train.n)  # one generator rank's share, one trainer rank's
    buckets = [DDMA_BUCKET_BYTES] * int(busiest // DDMA_BUCKET_BYTES) + [busiest % DDMA_BUCKET_BYTES]
    copy = weight_copy_seconds(p.hw, [b for b in buckets if b > 0], spans)
    return copy + engine_reload_time(p, gen), total


def engine_reload_time(p: Problem, gen: GenCfg) -> float:
    """Seconds for the generator's engine to take the new weights it was handed: 0 for the native sampler,
    which computes with the tensors it was given. A tensor-parallel replica first gathers its shards whole
    on its first rank, one gather per tensor (its engine's workers cut their own shards)."""
    role = p.generator
    if role is None or p.engine_of(role.name) == "native":
        return 0.0
    return engine_refit_seconds(role.dims, p.hw, gen.tp, max(role.weight_bytes, BF16_BYTES),
                                p.tp_group_spans(gen.tp))


def reshard_in_place_time(p: Problem, train: TrainCfg, gen: GenCfg) -> tuple[float, float]:
    """(seconds, bytes) of filling the generator's weights from the trainer's on the same devices, and the
    engine's reload of them (`engine_reload_time`)."""
    t, moved = _fill_in_place(p, train, gen)
    return t + engine_reload_time(p, gen), moved


def _fill_in_place(p: Problem, train: TrainCfg, gen: GenCfg) -> tuple[float, float]:
    """Colocated: each device gathers its generator tp shard from the trainer's shards, one all-gather
    per weight tensor; a whole (tp 1) generator gathers the trainer's FSDP2 units, one all-gather each.
    Replicated trainer weights (no FSDP) with the generator's tp are read in place.
    An fsdp trainer exactly as wide as one tp generator already holds, on each device, that device's tp
    shard of every tensor whose cuts line up (`fsdp_shard_dim`): only the others are gathered."""
    role = p.policy
    weights = weight_bytes(role.dims, BF16_BYTES)
    group = train.dp * train.fsdp
    sharded = group > 1 and train.sharding in ("zero2", "fsdp")  # FSDP2 holds shards between steps
    if not sharded and train.tp == gen.tp:
        return 0.0, 0.0
    group = max(group, 2)
    spans = p.spans(0, p.num_devices)
    if train.tp == gen.tp == 1:  # whole weights, gathered an FSDP2 unit at a time (`full_weights`)
        held = weight_bytes(role.dims, role.weight_bytes)
        units = fsdp_units(role.dims, tp=1, dtype_bytes=role.weight_bytes)
        return chunked_collective_time("all_gather", held, units, group, p.hw, spans), held * gen.dp
    if train.tp == 1 and train.dp == 1 and train.sharding == "fsdp" and train.fsdp == gen.tp == gen.n:
        shard_bytes, tensors = unaligned_tp_shards(role.dims, gen.tp)
        if not tensors:
            return 0.0, 0.0
        return chunked_collective_time("all_gather", shard_bytes, tensors, group, p.hw, spans), shard_bytes
    if p.generator is not None and p.generator.lora is not None:  # the adapters alone (the DDMA record's)
        weights = synced_bytes(p.generator)
    t = chunked_collective_time("all_gather", weights / gen.tp, param_tensor_count(role.dims), group, p.hw, spans)
    return t, weights * gen.dp


@functools.lru_cache(maxsize=64)
def unaligned_tp_shards(dims: ModelDims, tp: int) -> tuple[float, int]:
    """(bf16 bytes of one device's tp shards, tensor count) of the tensors whose tp shard is not what an
    fsdp shard over the same `tp` devices holds: the norms (tp replicates them, fsdp cuts them),
    replicated KV heads, row-parallel weights whose columns do not split evenly."""
    fsdp = Mesh.contiguous([("dp", 1), ("fsdp", tp), ("tp", 1), ("pp", 1)], 0)
    gen = Mesh.contiguous([("dp", 1), ("fsdp", 1), ("tp", tp), ("pp", 1)], 0)
    shard_bytes, tensors = 0.0, 0
    for param in llama_params(dims):
        if param.layer not in (None, 0):
            continue  # every layer is laid out as layer 0
        if all(shard_bounds(param, fsdp, r) == shard_bounds(param, gen, r) for r in range(tp)):
            continue
        copies = dims.num_layers if param.layer == 0 else 1
        region = shard_bounds(param, gen, 0)
        assert region is not None
        shard_bytes += copies * region_size(region) * BF16_BYTES
        tensors += copies
    return shard_bytes, tensors


def rollout_transfer_time(p: Problem, spans: bool) -> tuple[float, float]:
    """(seconds, bytes) of one step's rollouts sent from the generator's mesh to the trainer's (`spans`: the
    two meshes together span more than one node)."""
    w = p.workload
    total = w.responses * rollout_bytes_per_response(w.prompt_len, w.sent_response_len(w.responses), w.routes,
                                                 w.episode.columns if w.episode else 0)
    return p2p_seconds(p.hw, total, spans), total


# ------------------------------------------------------------------------------------------------
# Each instruction kind's duration on a layout


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
        res = generation_phase(p, ev.gen, free, reads=reads)
        durations[CostKey("Generate", gen_role.name)] = res[0] if res else math.inf
    return durations


def lora_comparison(p: Problem, ev: Evaluated) -> LoraSummary | None:
    """For a job whose policy trains LoRA adapters: the policy trainer's state per device, its step, the
    weight sync's bytes and the reference's weights on `ev`'s layout, beside the same job trained in full on
    that layout (every weight trained and synced, a reference initialised from the policy its own copy).
    None for a job without adapters."""
    role = p.policy
    if role.lora is None:
        return None
    cfg = ev.train
    full_role = replace(role, lora=None, bases=())
    references = tuple(Role(name, name, "infer", role.dims, (), role.weight_bytes, True) for name in role.bases)
    full = replace(p, roles=tuple(full_role if r is role else replace(r, lora=None) if r.model == role.model else r
                                  for r in p.roles) + references)
    (lora_mem, _), (full_mem, _) = train_state(p, role, cfg), train_state(full, full_role, cfg)
    lora_train = role_times(p, cfg)[CostKey("TrainStep", role.name)]
    full_train = role_times(full, cfg)[CostKey("TrainStep", role.name)]
    replicas = ev.gen.dp if ev.gen is not None else 0
    reference = sum(infer_state(full, r, cfg).params for r in references)
    lora_peak, full_peak = trainer_mesh_memory(p, cfg).peak, trainer_mesh_memory(full, cfg).peak
    figures = [
        LoraFigure(what="trained parameters (whole model)", unit="params",
                   lora=lora_param_count(role.dims, role.lora), full=param_count(role.dims)),
        LoraFigure(what="trainer weights", unit="bytes", lora=lora_mem.params, full=full_mem.params),
        LoraFigure(what="trainer gradients", unit="bytes", lora=lora_mem.grads, full=full_mem.grads),
        LoraFigure(what="trainer optimizer state", unit="bytes", lora=lora_mem.optimizer, full=full_mem.optimizer),
        LoraFigure(what="trainer activations", unit="bytes", lora=lora_mem.activations, full=full_mem.activations),
        LoraFigure(what="reference weights", unit="bytes", lora=0.0, full=reference),
        LoraFigure(what="trainer mesh at its peak", unit="bytes", lora=lora_peak, full=full_peak),
        LoraFigure(what="training seconds per step", unit="seconds", lora=lora_train, full=full_train),
        LoraFigure(what="weight sync bytes per step (all replicas)", unit="bytes",
                   lora=synced_bytes(p.generator or role) * replicas, full=synced_bytes(full_role) * replicas),
    ]
    return LoraSummary(rank=role.lora.rank, adapter_params=lora_param_count(role.dims, role.lora),
                       base_params=param_count(role.dims), base_reference=list(role.bases), figures=figures,
                       full_fits=full_peak <= p.usable)
