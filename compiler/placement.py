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

This module holds the search: the candidates themselves and their enumeration are `candidates.py`, what
each costs (its meshes' memory and the time of its phases) the cost model's (`cost/`), and the chosen one
becomes the plan's `Layout` in `to_layout.py`.
"""


from __future__ import annotations

import math
from dataclasses import dataclass

from graphrl.errors import PlacementError
from graphrl.schemas.sharding import tp_split_problem
from graphrl.engine_support import ENGINE_PRECISIONS, engine_sleeps

from graphrl.compiler.candidates import (GB, Evaluated, GenCfg, Problem, TrainCfg, gen_cfgs, splits, strategies,
                                         train_cfgs)
from graphrl.compiler.cost import (MeshMemory, engine_resident, gen_per_sequence, gen_sync_staging, gen_weights,
                                   generation_phase, held_weights, reads_trainer, resident_while_generating,
                                   reshard_in_place_time, rollout_transfer_time, trainer_mesh_memory, trainer_times,
                                   weight_sync_time)


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
        res = generation_phase(p, gen, p.usable - resident, reads=reads)
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
    res = generation_phase(p, gen, p.usable)
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
        trained = p.roles_of("train")
        if all(tp_split_problem(role.dims, nearest.train.tp * 2, "train") is None for role in trained):
            fixes.append(f"a larger tp (tp: {nearest.train.tp * 2})")
        elif any(role.dims.is_moe for role in trained):
            fixes.append("a smaller micro_batch_size (a mixture-of-experts trainer shards its experts with fsdp, "
                         "which gathers a whole layer's experts at a time)")
    return PlacementError(
        f"no layout fits: {nearest.worst_role} needs {nearest.needed_bytes / GB:.2f} GB per device, "
        f"{nearest.available_bytes / GB:.2f} GB available (nearest: {nearest.label}"
        + (f": {nearest.reason}" if nearest.reason else "") + ")",
        path=("placement", "roles", nearest.worst_role or ""), fix="try " + ", or ".join(fixes),
    )
