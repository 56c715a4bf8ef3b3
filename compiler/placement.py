"""Placement search: where every role lives, in what layout, and whether it fits.

Two families of layouts are enumerated:

- **colocated** (the layout of DeepSpeed-Chat-like systems, and LlamaRL's colocated mode): every role on
  every device. The trainer is sharded over all devices; each step the generator's tensor-parallel
  weights are gathered from the trainer's shards in place, generation runs, then the frozen models and
  the trainer take their turns. Phases run one after another (synchronous). State of idle roles may be
  offloaded to host memory to make room.
- **disaggregated**: the generator on its own devices, the trainer (with the frozen models beside it)
  on the rest. The generator gets new weights by DDMA point-to-point transfers; with an `async`
  schedule generation of step i+1 overlaps training of step i.

Each candidate fixes dp/fsdp/tp/pp, sharding, recompute, generator precision and offload. Candidates
that do not fit memory are dropped with the reason; the rest are ranked by predicted step time
(analytical model of `graphrl.compiler.cost`). For large clusters the generator and trainer halves are
ranked separately per device split and only the best few of each are combined (a beam), which keeps the
405B-on-1024-GPUs search to about a second; `exhaustive=True` combines every pair. Ties break on the
candidate's label, so the same job and cluster always give the same plan.

This module holds the search and the time of each candidate's halves; the candidates themselves and
their enumeration are `candidates.py`, their memory `memory.py`, and the chosen one becomes the plan's
`Layout` in `to_layout.py`.
"""


from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from graphrl.errors import PlacementError
from graphrl.engine_support import ENGINE_PRECISIONS, engine_sleeps
from graphrl.ops import rollout_bytes_per_response
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.model import ModelDims
from graphrl.schemas.program import CostKey
from graphrl.schemas.sharding import llama_params, region_size, shard_bounds

from graphrl.compiler import cost, timing
from graphrl.compiler.candidates import (GB, Evaluated, GenCfg, Problem, TrainCfg, gen_cfgs, splits, strategies,
                                         train_cfgs)
from graphrl.compiler.ddma import DDMA_BUCKET_BYTES
from graphrl.compiler.memory import (MeshMemory, engine_resident, gen_kv_per_token, gen_per_sequence, gen_sync_staging,
                                     gen_weights, held_weights, infer_state, reads_trainer, resident_while_generating,
                                     train_state, trainer_mesh_memory)
from graphrl.compiler.roles import Workload


# ------------------------------------------------------------------------------------------------
# Time of the halves


class GenerationTime(NamedTuple):
    seconds: float
    concurrent: int  # sequences in flight per replica
    kv_tokens: float  # KV-cache tokens a replica holds


def generation_time(p: Problem, gen: GenCfg, free_bytes: float, *, reads: bool = False) -> GenerationTime | None:
    """Seconds of generating one step's responses, the sequences in flight and the KV-cache tokens per
    replica; None if no sequence fits next to the weights. Replicas run in parallel.

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
    t = waves * timing.generation_time(role.dims, batch, w.prompt_len, w.response_len, gen.tp, gen.precision,  # type: ignore[arg-type]
                                       p.hw, intra_node=not p.tp_group_spans(gen.tp), dtype_bytes=role.weight_bytes,
                                       lengths=lengths, continuous=engine != "native")
    t *= timing.engine_time_factor(p.hw, engine)
    return GenerationTime(t + p.hw.op_overhead_s, min(batch, share), kv_tokens)


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
        forward = timing.forward_time(role.dims, tokens=whole.tokens, seq_len=whole.keys, head_rows=whole.head_rows,
                                      microbatches=whole.microbatches, dtype_bytes=role.weight_bytes,
                                      trained=role.kind == "train",
                                      # frozen models are sharded over the trainer's ranks (`infer_state`)
                                      sharded=role.kind == "infer" or cfg.sharding in ("zero2", "fsdp"),
                                      **common).total_s + p.hw.op_overhead_s
        if role.kind == "infer":
            out[CostKey("Forward", role.name)] = forward
            continue
        shape = dict(tokens=mini.tokens, seq_len=mini.keys, head_rows=mini.head_rows, microbatches=mini.microbatches,
                     sharding=cfg.sharding, recompute=cfg.recompute, dtype_bytes=role.weight_bytes)
        step = timing.training_step_time(role.dims, **shape, **common).total_s  # type: ignore[arg-type]
        first = step
        if gathered_at_sync and role is p.policy:
            first = timing.training_step_time(role.dims, **shape, **common,  # type: ignore[arg-type]
                                              weights_gathered=True).total_s
        steps = w.updates_per_step * w.optimizer_steps
        out[CostKey("TrainStep", role.name)] = first + step * (steps - 1) + p.hw.op_overhead_s
        if role is p.policy:  # the step's metrics (reward, loss, ...) are all-reduced over the trainer ranks
            out[CostKey("TrainStep", role.name)] += timing.collective_time(
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
        "offload": 2 * timing.offload_time(offload_bytes(p, cfg), p.hw),
    }


def weight_sync_time(p: Problem, train: TrainCfg, gen: GenCfg) -> tuple[float, float]:
    """(seconds, bytes on links) for DDMA: every generator replica receives the full bf16 weights,
    split over its tp ranks; all trainer ranks send in parallel. The busier of the receive side (one
    generator rank's share) and the send side (all bytes over all trainer ranks) moves its bytes in
    rounds of at most one DDMA bucket, timed as the weight-sync pass times the planned rounds
    (`timing.weight_copy_seconds`); a serving engine then reloads them (`engine_reload_time`)."""
    role = p.policy
    weights = cost.weight_bytes(role.dims, cost.BF16_BYTES)
    total = weights * gen.dp
    spans = p.spans(min(train.first, gen.first), train.n + gen.n)
    busiest = max(weights / gen.tp, total / train.n)  # one generator rank's share, one trainer rank's
    buckets = [DDMA_BUCKET_BYTES] * int(busiest // DDMA_BUCKET_BYTES) + [busiest % DDMA_BUCKET_BYTES]
    copy = timing.weight_copy_seconds(p.hw, [b for b in buckets if b > 0], spans)
    return copy + engine_reload_time(p, gen), total


def engine_reload_time(p: Problem, gen: GenCfg) -> float:
    """Seconds for the generator's engine to take the new weights it was handed: 0 for the native sampler,
    which computes with the tensors it was given. A tensor-parallel replica first gathers its shards whole
    on its first rank, one gather per tensor (its engine's workers cut their own shards)."""
    role = p.generator
    if role is None or p.engine_of(role.name) == "native":
        return 0.0
    return timing.engine_refit_seconds(role.dims, p.hw, gen.tp, max(role.weight_bytes, cost.BF16_BYTES),
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
    weights = cost.weight_bytes(role.dims, cost.BF16_BYTES)
    group = train.dp * train.fsdp
    sharded = group > 1 and train.sharding in ("zero2", "fsdp")  # FSDP2 holds shards between steps
    if not sharded and train.tp == gen.tp:
        return 0.0, 0.0
    group = max(group, 2)
    spans = p.spans(0, p.num_devices)
    if train.tp == gen.tp == 1:  # whole weights, gathered an FSDP2 unit at a time (`full_weights`)
        held = cost.weight_bytes(role.dims, role.weight_bytes)
        units = cost.fsdp_units(role.dims, tp=1, dtype_bytes=role.weight_bytes)
        return timing.chunked_collective_time("all_gather", held, units, group, p.hw, spans), held * gen.dp
    if train.tp == 1 and train.dp == 1 and train.sharding == "fsdp" and train.fsdp == gen.tp == gen.n:
        shard_bytes, tensors = unaligned_tp_shards(role.dims, gen.tp)
        if not tensors:
            return 0.0, 0.0
        return timing.chunked_collective_time("all_gather", shard_bytes, tensors, group, p.hw, spans), shard_bytes
    t = timing.chunked_collective_time("all_gather", weights / gen.tp, cost.param_tensor_count(role.dims), group,
                                     p.hw, spans)
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
        shard_bytes += copies * region_size(region) * cost.BF16_BYTES
        tensors += copies
    return shard_bytes, tensors


def rollout_transfer_time(p: Problem, spans: bool) -> tuple[float, float]:
    w = p.workload
    total = w.responses * rollout_bytes_per_response(w.prompt_len, w.sent_response_len(w.responses))
    return timing.p2p_seconds(p.hw, total, spans), total


# ------------------------------------------------------------------------------------------------
# Evaluation of full candidates


def _reject(ev: Evaluated, role: str, needed: float, available: float, why: str) -> Evaluated:
    ev.fits = False
    ev.worst_role, ev.needed_bytes, ev.available_bytes = role, needed, available
    ev.overflow = needed / available if available > 0 else math.inf
    ev.reason = why
    return ev


def evaluate_colocated(p: Problem, train: TrainCfg, gen: GenCfg | None, *, mem: MeshMemory | None = None,
                       times: dict[str, float] | None = None) -> Evaluated:
    """One colocated candidate. `mem` and `times` are the trainer's own figures, passed in when the search
    already has them for this trainer (`times` with `gathered_at_sync` as this generator reads the
    trainer's weights, `reads_trainer`)."""
    ev = Evaluated("colocated", train, gen, fits=True)
    mem = mem or trainer_mesh_memory(p, train)
    if mem.peak > p.usable:
        return _reject(ev, p.policy.name, mem.peak, p.usable,
                       f"trainer mesh needs {mem.peak / GB:.1f} GB per device, {p.usable / GB:.1f} GB usable")
    phases: dict[str, float] = {}
    if gen is not None:
        g = p.generator
        assert g is not None
        engine = p.engine_of(g.name)
        resident = resident_while_generating(mem)
        reads = reads_trainer(p, train, gen)
        res = generation_time(p, gen, p.usable - resident, reads=reads)
        if res is None:
            weights = held_weights(g, gen.tp, gen.precision, engine, reads=reads)
            need = resident + weights + gen_per_sequence(p, g, gen.tp)
            return _reject(ev, g.name, need, p.usable,
                           f"generator weights ({weights / GB:.1f} GB{_with_engine_copy(engine)}) beside "
                           f"{resident / GB:.1f} GB of trainer state leave no room for one sequence's KV cache")
        kept = engine_resident(g, gen.tp, gen.precision, engine, res.kv_tokens,
                               sleeps=engine_sleeps(engine, colocated=True, device_kind=p.hw.kind))
        if kept and mem.peak + kept > p.usable:
            return _reject(ev, g.name, mem.peak + kept, p.usable,
                           f"the {engine} engine keeps its weights and KV cache ({kept / GB:.1f} GB per device) "
                           f"while the trainer's phases need {mem.peak / GB:.1f} GB (it cannot sleep on "
                           f"{p.hw.kind.upper()}s)")
        staging = gen_sync_staging(g, gen.tp, gen.precision, colocated=True, engine=engine)
        need = resident + held_weights(g, gen.tp, gen.precision, "native", reads=reads) + staging + kept
        if staging and need > p.usable:
            return _reject(ev, g.name, need, p.usable,
                           f"the generator's weight sync stages {staging / GB:.1f} GB per device beside its "
                           f"weights and {resident / GB:.1f} GB of trainer state")
        phases["generate"] = res[0]
        phases["reshard_in_place"] = reshard_in_place_time(p, train, gen)[0]
    times = times or trainer_times(p, train, gathered_at_sync=reads_trainer(p, train, gen))
    phases.update(infer=times["infer"], train=times["train"], offload=times["offload"])
    ev.phases = {k: v for k, v in phases.items() if v > 0 or k in ("generate", "train")}
    ev.step_time_s = sum(ev.phases.values())
    return ev


def _with_engine_copy(engine: str) -> str:
    return "" if engine == "native" else f", with the {engine} engine's own copy"


def _gen_half(p: Problem, gen: GenCfg) -> tuple[float, str | None, float]:
    """(seconds, rejection reason, bytes needed) of a generator alone on its mesh."""
    g = p.generator
    assert g is not None
    engine = p.engine_of(g.name)
    res = generation_time(p, gen, p.usable)
    if res is None:
        weights = held_weights(g, gen.tp, gen.precision, engine)
        need = weights + gen_per_sequence(p, g, gen.tp)
        return math.inf, (f"generator weights {weights / GB:.1f} GB per device{_with_engine_copy(engine)} leave no "
                          f"room for the KV cache ({p.usable / GB:.1f} GB usable)"), need
    staging = gen_sync_staging(g, gen.tp, gen.precision, colocated=False, engine=engine)
    need = gen_weights(g, gen.tp, gen.precision) + staging + engine_resident(g, gen.tp, gen.precision, engine,
                                                                            res.kv_tokens)
    if need > p.usable:
        return math.inf, (f"the generator's weight sync stages {staging / GB:.1f} GB per device beside its "
                          f"weights ({p.usable / GB:.1f} GB usable)"), need
    return res[0], None, 0.0


def combine_disaggregated(p: Problem, train: TrainCfg, gen: GenCfg, gen_time: float,
                          times: dict[str, float]) -> Evaluated:
    ev = Evaluated("disaggregated", train, gen, fits=True)
    sync_t, _ = weight_sync_time(p, train, gen)
    data_t, _ = rollout_transfer_time(p, p.spans(min(train.first, gen.first), train.n + gen.n))
    trainer_side = times["infer"] + times["train"] + times["offload"]
    phases = {"generate": gen_time, "reshard": data_t, "infer": times["infer"], "train": times["train"],
              "weight_sync": sync_t}
    if times["offload"] > 0:
        phases["offload"] = times["offload"]
    if p.mode == "async":
        step = max(gen_time + sync_t, trainer_side + sync_t + data_t)
    else:
        step = gen_time + data_t + trainer_side + sync_t
    ev.phases = phases
    ev.step_time_s = step
    return ev


@dataclass
class SearchResult:
    best: Evaluated
    baseline: Evaluated | None
    considered: int
    ranked: list[Evaluated]
    rejected: list[Evaluated]


def search(p: Problem, *, exhaustive: bool = False, beam: int = 4) -> SearchResult:
    """Enumerate, evaluate and rank candidates. Raises PlacementError when none fits."""
    evaluated: list[Evaluated] = []
    considered = 0
    families = strategies(p)
    colocated: list[Evaluated] = []
    if "colocated" in families or True:  # the colocated-synchronous baseline is always computed
        n = p.num_devices
        gens = gen_cfgs(p, 0, n) if p.generator else [None]
        for train in train_cfgs(p, 0, n):
            mem = trainer_mesh_memory(p, train)
            times: dict[bool, dict[str, float]] = {}  # by whether the generator reads the trainer's weights
            for gen in gens:
                considered += 1
                reads = reads_trainer(p, train, gen)
                if mem.peak <= p.usable and reads not in times:
                    times[reads] = trainer_times(p, train, gathered_at_sync=reads)
                colocated.append(evaluate_colocated(p, train, gen, mem=mem, times=times.get(reads)))
    if "colocated" in families:
        evaluated.extend(colocated)
    if "disaggregated" in families:
        for g_first, g_n, t_first, t_n in splits(p):
            gen_ranked: list[tuple[float, str, GenCfg]] = []
            for gen in gen_cfgs(p, g_first, g_n):
                considered += 1
                t, why, need = _gen_half(p, gen)
                if why is None:
                    gen_ranked.append((t, gen.label, gen))
                else:
                    ev = Evaluated("disaggregated", TrainCfg(t_first, t_n, 1, 1, 1, 1, "none", False, False), gen, True)
                    evaluated.append(_reject(ev, p.generator.name, need, p.usable, why))
            train_ranked: list[tuple[float, str, TrainCfg, dict[str, float]]] = []
            for train in train_cfgs(p, t_first, t_n):
                considered += 1
                mem = trainer_mesh_memory(p, train)
                if mem.peak > p.usable:
                    ev = Evaluated("disaggregated", train, None, True)
                    evaluated.append(_reject(ev, p.policy.name, mem.peak, p.usable,
                                             f"trainer mesh needs {mem.peak / GB:.1f} GB per device, {p.usable / GB:.1f} GB usable"))
                    continue
                times = trainer_times(p, train)
                train_ranked.append((times["infer"] + times["train"] + times["offload"], train.label, train, times))
            gen_ranked.sort(key=lambda x: (x[0], x[1]))
            train_ranked.sort(key=lambda x: (x[0], x[1]))
            if not exhaustive:
                gen_ranked, train_ranked = gen_ranked[:beam], train_ranked[:beam]
            for gt, _, gen in gen_ranked:
                for _, _, train, times in train_ranked:
                    considered += 1
                    evaluated.append(combine_disaggregated(p, train, gen, gt, times))
    fitting = sorted((e for e in evaluated if e.fits), key=Evaluated.key)
    rejected = [e for e in evaluated if not e.fits]
    baseline = _baseline(colocated)
    if not fitting:
        raise no_fit_error(p, rejected)
    return SearchResult(fitting[0], baseline, considered, fitting, rejected)


def _baseline(colocated: list[Evaluated]) -> Evaluated | None:
    """The DeepSpeed-Chat-like reference: colocated, synchronous, bf16 generation, nothing offloaded
    (offload and then fp8 are allowed only when nothing else fits)."""
    def bf16(e: Evaluated) -> bool:
        return e.gen is None or e.gen.precision == "bf16"

    for keep in (lambda e: bf16(e) and not e.train.offload, bf16, lambda e: True):
        pool = sorted((e for e in colocated if e.fits and keep(e)), key=Evaluated.key)
        if pool:
            return pool[0]
    return None


def no_fit_error(p: Problem, rejected: list[Evaluated]) -> PlacementError:
    """The nearest miss, with the bytes it needed and what would make it fit."""
    nearest = min(rejected, key=lambda e: (e.overflow, e.label)) if rejected else None
    if nearest is None:
        return PlacementError("no candidate layout exists for these pins", path=("placement",),
                              fix="loosen the pins under placement.roles")
    factor = nearest.overflow
    need_devices = int(math.ceil(p.num_devices * factor))
    fixes = [f"more devices (about {need_devices} instead of {p.num_devices})"]
    if nearest.gen is not None and p.generator is not None and nearest.worst_role == p.generator.name:
        engine = p.engine_of(p.generator.name)  # only what this engine runs is offered
        if nearest.gen.precision == "bf16" and p.hw.peak_fp8_flops > 0 and "fp8" in ENGINE_PRECISIONS[engine]:
            fixes.append("fp8 generation (precision: fp8)")
        fixes.append(f"a larger generator tp (tp: {nearest.gen.tp * 2})")
        if engine != "native":
            fixes.append("engine: native (no second copy of the weights, a cache that lives for one generation)")
    else:
        if nearest.train.sharding != "fsdp":
            fixes.append("sharding: fsdp")
        if not nearest.train.offload:
            fixes.append("offload: true")
        fixes.append(f"a larger tp (tp: {nearest.train.tp * 2})")
    return PlacementError(
        f"no layout fits: {nearest.worst_role} needs {nearest.needed_bytes / GB:.2f} GB per device, "
        f"{nearest.available_bytes / GB:.2f} GB available (nearest: {nearest.label}"
        + (f": {nearest.reason}" if nearest.reason else "") + ")",
        path=("placement", "roles", nearest.worst_role or ""), fix="try " + ", or ".join(fixes),
    )
