"""`graphrl calibrate`: measure this machine and write the `cpu-local` hardware description.

Measured, one thread per process as ranks run:
- matmul FLOP/s by size (the peak) and memory bandwidth (large tensor copies);
- the host model: the executor's own model code (generation, a log-prob forward, a training step with
  loss, clipping and AdamW) timed on probe models of several depths and batch sizes, then fitted to the
  cost model's formulas, which give per-layer and per-pass host overheads and the achieved FLOP rate;
- per-instruction overhead: the executor's rollout join with a rule reward and a GRPO advantage;
- gloo point-to-point bandwidth and latency between two processes, and all-reduce, all-gather,
  reduce-scatter and broadcast for every group size from 2 to N ranks, each fitted as the ring-model
  bandwidth and latency that reproduce it;
- where vllm can be imported, the vLLM engine's generation tokens/s next to the native sampler's on the
  same probe model and prompts (`engine_throughputs`), which costs generators placed on that engine.

The result is a `HardwareSpec` JSON file that the `cpu-local` preset uses from then on (see
graphrl.compiler.hardware). `fit_host_model` is a pure function of the probe timings, so it is tested
on timings made from a known description.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

from graphrl.compiler import timing
from graphrl.compiler.cost import param_count
from graphrl.engine_support import engine_available
from graphrl.executors.host_memory import keep_freed_host_memory
from graphrl.schemas.hardware import (HARDWARE_PRESETS, CollectiveFit, EngineThroughput, HardwareSpec, HostFit,
                                      HOST_FIT_FIELDS, MatmulFit, MeasuredCollective, VocabCost)
from graphrl.schemas.model import MODEL_PRESETS, ModelDims

Phase = Literal["generate", "forward", "train"]
HOST_FIELDS = HOST_FIT_FIELDS[:-2]  # the host overheads; the fit's last two unknowns are the elementwise rates
COLLECTIVES: tuple[MeasuredCollective, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
_HUGE = 1e30  # a rate so high that the term it divides vanishes


def _best_time(fn: Callable[[], Any], repeat: int = 5, min_time_s: float = 0.05) -> float:
    """Seconds per call: the best of `repeat` timed loops, each at least `min_time_s` long (a kernel's own
    rate, undisturbed)."""
    return min(_loop_times(fn, repeat, min_time_s))


def _typical_time(fn: Callable[[], Any], repeat: int = 5, min_time_s: float = 0.05) -> float:
    """Seconds per call: the median of `repeat` timed loops, each at least `min_time_s` long. The model
    code probes use it: a run's steps share cores, caches and memory with the other ranks' steps, and the
    report compares the prediction with a run's median step, not its best."""
    return statistics.median(_loop_times(fn, repeat, min_time_s))


def _loop_times(fn: Callable[[], Any], repeat: int, min_time_s: float) -> list[float]:
    """Seconds per call of `repeat` loops of as many calls as make one loop last `min_time_s`. Between
    processes of a gloo group (a data-parallel probe, whose every call runs collectives) the processes
    agree on the number of calls first, the largest any of them needs."""
    fn()
    calls = 1
    while True:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        done = time.perf_counter() - t >= min_time_s or calls > 1 << 20
        if dist.is_initialized():
            flag = torch.tensor([int(done)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            done = bool(flag.item())
        if done:
            break
        calls *= 2
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls)
    return times


def _interleaved_times(calls: dict[str, Callable[[], Any]], cycles: int = 9) -> dict[str, float]:
    """Seconds per call of each of `calls`, the median over `cycles` rounds that call each once in turn:
    what a call costs right after the others, as a run's phases do (a tight loop of one call keeps its
    own code and data warm). Every process of a gloo group runs the same rounds."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(cycles):
        for name, fn in calls.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def matmul_flops(sizes: tuple[int, ...] = (64, 128, 256, 512, 1024)) -> dict[int, float]:
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        out[n] = 2 * n**3 / _best_time(lambda: torch.mm(a, b))
    return out


def memory_bandwidth(num_bytes: int = 128 * 2**20) -> float:
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _best_time(lambda: dst.copy_(src), repeat=3)  # read + write


# --------------------------------------------------------------------------------------------------
# The host model: probes of the executor's model code, fitted to the cost model


@dataclass(frozen=True)
class Probe:
    """One timed call of the executor's model code on a probe model."""

    phase: Phase
    dims: ModelDims
    batch: int  # sequences
    prompt_len: int
    response_len: int
    seconds: float
    dtype_bytes: int = 4
    threads: int = 1
    ranks: int = 1  # processes side by side; a training probe is data-parallel over all of them
    sharding: str = "none"  # a training probe's sharding over its ranks (DDP, or FSDP2 for fsdp)
    tp: int = 1  # a generation probe's tensor-parallel size (one replica over that many ranks)


def predicted_probe_s(probe: Probe, hw: HardwareSpec) -> float:
    """The timing model's seconds for `probe` on `hw`, through the same functions placement uses (one
    micro-batch: the whole batch in one forward, as a job without `micro_batch_size` runs; log-probs of
    the response positions only)."""
    seq_len = probe.prompt_len + probe.response_len
    tokens = probe.batch * seq_len
    rows = probe.batch * probe.response_len
    hw = hw.for_rank(probe.threads, probe.dims.hidden_size, probe.batch * (probe.prompt_len + probe.response_len))
    if probe.phase == "generate":
        return timing.generation_time(probe.dims, probe.batch, probe.prompt_len, probe.response_len, probe.tp, "bf16",
                                      hw, dtype_bytes=probe.dtype_bytes)
    if probe.phase == "forward":  # sharded: a frozen model's forward, data-parallel over the probe's ranks
        ranks = probe.ranks if probe.sharding == "fsdp" else 1
        return timing.forward_time(probe.dims, tokens=tokens * ranks, seq_len=seq_len, hw=hw, microbatches=1,
                                   dtype_bytes=probe.dtype_bytes, head_rows=rows * ranks, fsdp=ranks,
                                   sharded=probe.sharding == "fsdp").total_s
    return timing.training_step_time(
        probe.dims, tokens=tokens * probe.ranks, seq_len=seq_len, dp=probe.ranks, fsdp=1, tp=1, pp=1,
        sharding=probe.sharding, recompute=False, hw=hw, intra_node_tp=True, dp_spans_nodes=False, microbatches=1,
        dtype_bytes=probe.dtype_bytes, head_rows=rows * probe.ranks,
    ).total_s


def _nonnegative_least_squares(rows: list[list[float]], target: list[float]) -> list[float]:
    """argmin ||A x - b|| over x >= 0, exactly: the best unconstrained fit over every subset of free
    variables whose solution is nonnegative (the host model has twelve unknowns, so 4095 subsets)."""
    a, b = torch.tensor(rows, dtype=torch.float64), torch.tensor(target, dtype=torch.float64)[:, None]
    n = a.shape[1]
    best, best_err = [0.0] * n, float(b.square().sum())
    for k in range(1, n + 1):
        for subset in itertools.combinations(range(n), k):
            x = torch.linalg.lstsq(a[:, list(subset)], b).solution[:, 0]
            if bool((x < 0).any()):
                continue
            err = float((a[:, list(subset)] @ x[:, None] - b).square().sum())
            if err < best_err - 1e-18:
                best_err, best = err, [0.0] * n
                for i, v in zip(subset, x.tolist()):
                    best[i] = v
    return best


def fit_host_model(probes: list[Probe], base: HardwareSpec) -> HardwareSpec:
    """`base` with the host overheads and the elementwise rates that best reproduce the probe timings.

    The matmuls and collectives are known (`base`'s measured matmul fits or roofline, its collective
    fits); what remains of each probe's time is linear in ten unknowns: eight host overheads and the
    seconds per elementwise byte of a forward and of a backward. The basis of each unknown is the timing
    model's prediction on a description where only that unknown is 1 and nothing else costs anything. The
    fit minimises the relative error over the probes, with every unknown >= 0.
    """
    zero = {name: 0.0 for name in HOST_FIELDS}
    # The vocabulary work and the optimizer step are known where `base` measured them (they cost nothing in
    # the bases); where it did not, they are elementwise bytes, which the forward rate's basis counts.
    vocab_known = tuple(v.model_copy(update=dict(generate=0.0, forward=0.0, train=0.0)) for v in base.vocab)
    free = dict(zero, peak_bf16_flops=_HUGE, compute_efficiency=1.0, memory_bandwidth=_HUGE, memory_efficiency=1.0,
                matmuls=(), vocab=vocab_known, optimizer_param_s=1 / _HUGE if base.optimizer_param_s > 0 else 0.0,
                kernel_overhead_s=0.0, elementwise_bandwidth=_HUGE,
                backward_elementwise_bandwidth=_HUGE, collectives=(), link_latency_s=0.0,
                intra_node_bandwidth=_HUGE, inter_node_bandwidth=_HUGE)
    bases = [base.model_copy(update=dict(free, **{name: 1.0})) for name in HOST_FIELDS]
    bases.append(base.model_copy(update=dict(free, elementwise_bandwidth=1.0)))  # seconds = forward bytes
    bases.append(base.model_copy(update=dict(free, backward_elementwise_bandwidth=1.0)))  # seconds = backward's
    known = base.model_copy(update=dict(zero, elementwise_bandwidth=_HUGE, backward_elementwise_bandwidth=_HUGE))
    rows = [[predicted_probe_s(p, hw) / p.seconds for hw in bases] for p in probes]
    target = [1.0 - predicted_probe_s(p, known) / p.seconds for p in probes]
    *overheads, forward_s_per_byte, backward_s_per_byte = _nonnegative_least_squares(rows, target)
    return base.model_copy(update=dict(zip(HOST_FIELDS, overheads),
                                       elementwise_bandwidth=1.0 / max(forward_s_per_byte, 1 / _HUGE),
                                       backward_elementwise_bandwidth=1.0 / max(backward_s_per_byte, 1 / _HUGE)))


# --------------------------------------------------------------------------------------------------
# Matmul rates of the shapes a job's models use


MATMUL_ROWS = (1, 4, 16, 64, 256, 1024, 4096)
# Rows past which a shape is not measured (its time grows in proportion to the rows there): about
# 20 GFLOP per call, a tenth of a second on one core.
MATMUL_MAX_FLOPS = 2e10
_TORCH_DTYPES = {4: torch.float32, 2: torch.bfloat16}


def model_matmul_shapes(dims: ModelDims, tps: tuple[int, ...] = (1,)) -> set[tuple[int, int]]:
    """(k, n) of every linear of `dims` on one rank of each tp group size in `tps`: the block linears and
    the vocabulary-parallel output head."""
    shapes = set()
    for tp in tps:
        shapes.update(timing.layer_matmul_shapes(dims, tp))
        shapes.add((dims.hidden_size, -(-dims.vocab_size // tp)))
    return shapes


def measure_matmuls(shapes: set[tuple[int, int]], dtype_bytes: int, threads: int,
                    report: Callable[[str], None] = lambda s: None) -> tuple[MatmulFit, ...]:
    """Seconds of `torch.nn.functional.linear` for each (k, n) weight shape by rows (`MATMUL_ROWS`, up to
    `MATMUL_MAX_FLOPS` per call), with `threads` torch threads."""
    dtype = _TORCH_DTYPES[dtype_bytes]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    fits = []
    try:
        for k, n in sorted(shapes):
            w = torch.randn(n, k, dtype=dtype)
            rows = [r for r in MATMUL_ROWS if r == 1 or 2 * r * k * n <= MATMUL_MAX_FLOPS]
            seconds = []
            for r in rows:
                x = torch.randn(r, k, dtype=dtype)
                seconds.append(_best_time(lambda: torch.nn.functional.linear(x, w), repeat=3, min_time_s=0.01))
            fits.append(MatmulFit(k=k, n=n, dtype_bytes=dtype_bytes, threads=threads, rows=tuple(rows),
                                  seconds=tuple(seconds)))
            big = rows[-1]
            report(f"  {k:>6} x {n:<6} {dtype_bytes * 8}-bit, {threads} thread(s): {2 * k * n / seconds[0] / 1e9:6.1f} "
                   f"GFLOP/s at 1 row, {2 * big * k * n / seconds[-1] / 1e9:6.1f} at {big}")
    finally:
        torch.set_num_threads(previous)
    return tuple(fits)


def machine_speed(hw: HardwareSpec) -> dict[str, Any] | None:
    """This machine's speed now against its speed when `hw` was calibrated: the calibration's largest
    matmul (most work per call: its largest weight at its most rows) timed again as `measure_matmuls` timed
    it, same dtype and threads. `ratio` above 1: faster now. A run's prediction error can then be read
    beside how far the machine itself moved (a shared VM's speed drifts by 10-25% between hours). None
    where `hw` holds no measured matmuls (a preset)."""
    if not hw.matmuls:
        return None
    fit = max(hw.matmuls, key=lambda f: f.k * f.n * f.rows[-1])
    rows, dtype = fit.rows[-1], _TORCH_DTYPES[fit.dtype_bytes]
    previous = torch.get_num_threads()
    torch.set_num_threads(fit.threads)
    try:
        w, x = torch.randn(fit.n, fit.k, dtype=dtype), torch.randn(rows, fit.k, dtype=dtype)
        seconds = _best_time(lambda: torch.nn.functional.linear(x, w), repeat=3, min_time_s=0.01)
    finally:
        torch.set_num_threads(previous)
    return {"k": fit.k, "n": fit.n, "rows": rows, "threads": fit.threads, "dtype_bytes": fit.dtype_bytes,
            "calibrated_s": fit.seconds[-1], "measured_s": seconds, "ratio": fit.seconds[-1] / seconds}


def _probe_trainer(model: Any, sharding: str, group: Any) -> Any:
    """`model` as the executor trains it on a probe: wrapped for `sharding` over `group` (none: alone),
    with its optimizer, in a role state `training.update` takes."""
    from graphrl.executors.parallel import build_optimizer, wrap_trainer
    from graphrl.executors.roles import RoleState
    from graphrl.schemas.plan import MemoryBytes, RolePlacement

    wrapped, wrapping = wrap_trainer(model, sharding, group, torch.device("cpu"))
    optimizer = build_optimizer(wrapped, sharding, wrapping, group, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0)
    placement = RolePlacement(role="probe", model="probe", kind="train", ops=["train"], mesh="probe",
                              memory_bytes=MemoryBytes())
    return RoleState(placement, model, wrapped, wrapping, optimizer)


def _probe_generate(model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, uniforms: torch.Tensor) -> Any:
    """The executor's sampler on a probe: eos_id -1 never occurs, so every call runs all passes; one
    uniform number per row and token, as the executor draws them."""
    from graphrl.executors.models.llama import generate
    from graphrl.tasks import PAD

    return generate(model, prompt_ids, prompt_mask, uniforms.shape[1], temperature=1.0, top_p=1.0,
                    uniforms=uniforms, eos_id=-1, pad_id=PAD)


def _probe_update(role: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, out: Any,
                  advantages: torch.Tensor, group: Any) -> Callable[[], None]:
    """One call of the executor's own update (loss weights, GRPO loss, clipping, AdamW) on `out`."""
    from graphrl.executors import training
    from graphrl.schemas.job import AlgorithmSpec

    rollouts = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=out.response_ids,
                    response_mask=out.response_mask, behaviour_logprobs=out.logprobs, version=torch.tensor([0]))
    algorithm = AlgorithmSpec()

    def update() -> None:
        training.update(role, "grpo", algorithm, rollouts, {"advantages": advantages}, None, None,
                        temperature=1.0, group=group, rt=_PROBE_RUNTIME, node="probe", step=0)

    return update


def probe_model_code(
    dims: ModelDims = MODEL_PRESETS["tiny-digits"],
    layers: tuple[int, ...] = (1, 4),
    batches: tuple[int, ...] = (8, 128),
    prompt_len: int = 6,
    response_len: int = 5,
    dtype_bytes: int = 4,
) -> list[Probe]:
    """Time generation, a log-prob forward and a training step (GRPO/PPO loss, gradient clipping,
    AdamW) as the executor runs them, on `dims` at every depth in `layers` and batch in `batches`, in
    the dtype of `dtype_bytes` bytes, with this process's torch threads."""
    from graphrl.executors.models.llama import Llama, token_logprobs_and_entropy

    # Side by side on several processes, the probe trains data-parallel over all of them (DDP on gloo), as
    # the ranks of a run do: its step includes the gradient reduction and the loss's all-reduces.
    group = dist.group.WORLD if dist.is_initialized() else None
    probes = []
    for num_layers, batch in itertools.product(layers, batches):
        d = dims.model_copy(update=dict(num_layers=num_layers))
        torch.manual_seed(0)
        model = Llama(d).to(_TORCH_DTYPES[dtype_bytes])
        role = _probe_trainer(model, "none", group)
        prompt_ids = torch.randint(3, d.vocab_size, (batch, prompt_len))
        prompt_mask = torch.ones(batch, prompt_len, dtype=torch.bool)
        uniforms = torch.rand(batch, response_len, generator=torch.Generator().manual_seed(0))

        out = _probe_generate(model, prompt_ids, prompt_mask, uniforms)
        train = _probe_update(role, prompt_ids, prompt_mask, out, torch.randn(batch, response_len), group)

        def generate() -> None:
            _probe_generate(model, prompt_ids, prompt_mask, uniforms)

        def forward() -> None:
            with torch.no_grad():
                token_logprobs_and_entropy(model, prompt_ids, prompt_mask, out.response_ids, out.response_mask)

        times = _phase_times({"generate": generate, "forward": forward, "train": train})
        for phase, seconds in times.items():
            probes.append(Probe(phase, d, batch, prompt_len, response_len, seconds, dtype_bytes,  # type: ignore[arg-type]
                                torch.get_num_threads(), dist.get_world_size() if group is not None else 1))
    return probes


# A probe call at least this long is timed only in the rounds that call the phases in turn: a loop of its
# own would add five calls per phase and probe, minutes on a real model (SmolLM2 at 3 and 6 layers).
LONG_CALL_S = 0.5


def _phase_times(calls: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Seconds per call of each phase: the median of rounds that call the phases in turn, as a run calls
    each once per step between the others, on caches the others have just used; for a call shorter than
    `LONG_CALL_S`, the slower of that and a loop of its own (calls of the same phase back to back). Every
    process of a gloo group times the same calls."""
    first = torch.tensor([_timed_once(fn) for fn in calls.values()])  # warm-up, and which calls are long
    if dist.is_initialized():  # every process decides alike: a probe's calls may run collectives
        dist.all_reduce(first, op=dist.ReduceOp.MAX)
    loops = {name: _typical_time(fn, repeat=5) for (name, fn), t in zip(calls.items(), first.tolist())
             if t < LONG_CALL_S}
    cold = _interleaved_times(calls)
    return {name: max(loops.get(name, 0.0), cold[name]) for name in calls}


@dataclass(frozen=True)
class _ProbeRuntime:
    """What the executor's update reads of a rank's runtime in a probe: where collective buffers live."""

    comm_device: torch.device = torch.device("cpu")


_PROBE_RUNTIME = _ProbeRuntime()


def probe_layouts(dims: ModelDims = MODEL_PRESETS["tiny-digits"], layers: tuple[int, ...] = (1, 4),
                  batch: int = 128, prompt_len: int = 6, response_len: int = 5) -> list[Probe]:
    """On the processes of a gloo group: a training step with FSDP2 (`sharding: fsdp`) and one with ZeRO-1
    (DDP and ZeroRedundancyOptimizer) over all of them, a log-prob forward of a frozen model sharded over
    them, and generation on one tensor-parallel replica over all of them, as the executor runs them."""
    from torch.distributed.device_mesh import DeviceMesh

    from graphrl.executors.models.llama import Llama, token_logprobs_and_entropy
    from graphrl.executors.parallel import shard_frozen
    from graphrl.executors.tensor_parallel import TensorParallelGroup, TensorParallelLlama

    world = dist.get_world_size()
    probes = []
    for num_layers in layers:
        d = dims.model_copy(update=dict(num_layers=num_layers))
        torch.manual_seed(0)
        model = Llama(d)
        prompt_ids = torch.randint(3, d.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
        prompt_mask = torch.ones(batch, prompt_len, dtype=torch.bool)
        uniforms = torch.rand(batch, response_len, generator=torch.Generator().manual_seed(1))
        sharded = TensorParallelLlama.from_full(model, TensorParallelGroup(dist.get_rank(), world, dist.group.WORLD))
        sharded.eval()
        out = _probe_generate(sharded, prompt_ids, prompt_mask, uniforms)
        t_gen = _typical_time(lambda: _probe_generate(sharded, prompt_ids, prompt_mask, uniforms))
        probes.append(Probe("generate", d, batch, prompt_len, response_len, t_gen, 4, torch.get_num_threads(), world,
                            tp=world))
        advantages = torch.randn(batch, response_len, generator=torch.Generator().manual_seed(2))
        train = _probe_update(_probe_trainer(model, "fsdp", dist.group.WORLD), prompt_ids, prompt_mask, out,
                              advantages, dist.group.WORLD)
        probes.append(Probe("train", d, batch, prompt_len, response_len, _typical_time(train), 4,
                            torch.get_num_threads(), world, sharding="fsdp"))
        train = _probe_update(_probe_trainer(Llama(d), "zero1", dist.group.WORLD), prompt_ids, prompt_mask, out,
                              advantages, dist.group.WORLD)
        probes.append(Probe("train", d, batch, prompt_len, response_len, _typical_time(train), 4,
                            torch.get_num_threads(), world, sharding="zero1"))
        frozen = Llama(d).requires_grad_(False)
        shard_frozen(frozen, DeviceMesh.from_group(dist.group.WORLD, "cpu"))

        def forward() -> None:
            with torch.no_grad():
                token_logprobs_and_entropy(frozen, prompt_ids, prompt_mask, out.response_ids, out.response_mask)

        probes.append(Probe("forward", d, batch, prompt_len, response_len, _typical_time(forward), 4,
                            torch.get_num_threads(), world, sharding="fsdp"))
    return probes


def _job_probe_times(rank: int, world: int, threads: int, *args: Any) -> list[Probe]:
    torch.set_num_threads(threads)
    return probe_model_code(*args)


def _probe_times(rank: int, world: int) -> list[Probe]:
    return probe_model_code() + probe_layouts()


def probe_side_by_side(num_processes: int) -> list[Probe]:
    """`probe_model_code` on `num_processes` local processes at once (rank 0's timings): ranks of a run
    compute side by side, and on shared cores and caches each is slower than it would be alone."""
    if num_processes <= 1:
        return probe_model_code()
    return _spawn(num_processes, _probe_times)


def instruction_overhead(batch: int = 128, prompt_len: int = 6, response_len: int = 5, group_size: int = 16) -> float:
    """Seconds of an executed data instruction besides model math: the executor joins the step's rollout
    pieces, then applies a rule reward or a GRPO advantage (the mean of the two)."""
    from graphrl.executors import algorithms as alg
    from graphrl.executors.rollouts import join_rollouts
    from graphrl.tasks import REWARDS

    piece = {"prompt_ids": torch.randint(0, 10, (batch, prompt_len)),
             "prompt_mask": torch.ones(batch, prompt_len, dtype=torch.bool),
             "response_ids": torch.randint(0, 10, (batch, response_len)),
             "response_mask": torch.ones(batch, response_len, dtype=torch.bool),
             "behaviour_logprobs": torch.zeros(batch, response_len), "version": torch.tensor([0])}
    pieces = [(0, batch, piece)]
    reward_fn = REWARDS["digits_copy"]

    def reward() -> None:
        r, _ = join_rollouts(pieces, 0, batch)
        assert r is not None
        float(reward_fn(r["prompt_ids"], r["prompt_mask"], r["response_ids"], r["response_mask"]).float().sum())

    rewards = torch.rand(batch)

    def advantage() -> None:
        r, _ = join_rollouts(pieces, 0, batch)
        assert r is not None
        alg.broadcast_to_tokens(alg.grpo_advantages(rewards, group_size), r["response_mask"]).float()

    return (_best_time(reward) + _best_time(advantage)) / 2


# --------------------------------------------------------------------------------------------------
# Communication between local processes


def _timed(op: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `op` on this rank, each call started together after a barrier."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        op()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _p2p_times(rank: int, world: int, sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    out = {}
    for size in sizes:
        buf = torch.zeros(size // 4)

        def ping_pong() -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        out[size] = _timed(ping_pong, repeats) / 2
    return {"p2p": out}


# torch >= 2.13 names the single-tensor collectives *_single; older releases *_tensor.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _collective_times(rank: int, world: int, sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Seconds of each collective on a full buffer of `size` bytes (rounded to whole float32 shards)."""
    out: dict[str, dict[int, float]] = {kind: {} for kind in COLLECTIVES}
    for size in sizes:
        shard = max(1, size // 4 // world)
        full, part = torch.ones(shard * world), torch.ones(shard)
        ops = {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: _ALL_GATHER(full, part),
            "reduce_scatter": lambda: _REDUCE_SCATTER(part, full),
            "broadcast": lambda: dist.broadcast(full, 0),
        }
        for kind, op in ops.items():
            out[kind][shard * world * 4] = _timed(op, repeats)
    return out


def _spawn(world: int, measure: Callable[..., Any], *args: Any, timeout_s: float = 300.0) -> Any:
    """Run `measure(rank, world, *args)` on `world` local gloo processes; rank 0's result. A rank's
    error ends the measurement at once, naming every rank that failed and why."""
    from graphrl.executors.local_world import WorldFailed, run_on_ranks

    try:
        return run_on_ranks(world, measure, *args, timeout_s=timeout_s)[0]
    except WorldFailed as exc:
        raise RuntimeError(f"calibration on {world} local processes failed: {exc}") from None


def _line_fit(times: dict[int, float]) -> tuple[float, float]:
    """(intercept s, slope s/byte) through the smallest and the largest of {bytes: seconds}: the
    smallest buffer's time is almost all latency and the largest's almost all bandwidth, which a
    least-squares line over sizes that span three orders of magnitude would blur."""
    small, big = min(times), max(times)
    slope = max((times[big] - times[small]) / max(big - small, 1), 1e-15)
    return max(times[small] - slope * small, 0.0), slope


def fit_collective(kind: MeasuredCollective, group_size: int, times: dict[int, float]) -> CollectiveFit:
    """The ring-model bandwidth and per-step latency that reproduce measured {bytes: seconds}."""
    intercept, slope = _line_fit(times)
    factor, steps = timing.ring_shape(kind, group_size)
    return CollectiveFit(kind=kind, group_size=group_size, bus_bandwidth=factor / slope, latency_s=intercept / steps)


def p2p_bandwidth_latency(sizes: tuple[int, ...] = (4, 1 << 20, 16 << 20), repeats: int = 7) -> tuple[float, float]:
    """(bytes/s, seconds) of gloo send/recv between two local processes."""
    times = _spawn(2, _p2p_times, list(sizes), repeats)["p2p"]
    latency = times[sizes[0]]
    big = sizes[-1]
    return big / max(times[big] - latency, 1e-9), latency


def collective_fits(
    max_ranks: int = 4, sizes: tuple[int, ...] = (1 << 10, 4 << 20), repeats: int = 15,
    report: Callable[[str], None] = lambda s: None,
) -> tuple[CollectiveFit, ...]:
    """All-reduce, all-gather, reduce-scatter and broadcast measured on 2..max_ranks local processes."""
    fits = []
    for n in range(2, max_ranks + 1):
        measured = _spawn(n, _collective_times, list(sizes), repeats)
        for kind in COLLECTIVES:
            fit = fit_collective(kind, n, measured[kind])
            fits.append(fit)
            report(f"  {n} ranks {kind:<15} {fit.bus_bandwidth / 1e9:6.2f} GB/s, {fit.latency_s * 1e6:5.0f} µs per step")
    return tuple(fits)


# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobModels:
    """What `graphrl calibrate JOB` measures for one job: its models' shapes in their dtype, on ranks of its
    threads, with probes of its own per-rank sizes."""

    name: str
    models: tuple[tuple[ModelDims, int], ...]  # (dims, bytes per element) of each distinct model
    threads: int
    tps: tuple[int, ...]  # tensor-parallel sizes the search may give a role on the job's cluster
    ranks: int  # devices of the job's cluster
    batch: int  # responses per rank
    prompt_len: int
    response_len: int


def job_models(path: str | Path) -> JobModels:
    """The shapes, dtypes, threads and per-rank sizes of the job file at `path`."""
    from graphrl.compiler.roles import derive_roles, derive_workload
    from graphrl.compiler.typecheck import typecheck
    from graphrl.ir import build_graph
    from graphrl.loader import job_cluster, load_job

    loaded = load_job(path)
    graph = typecheck(build_graph(loaded.spec), None, "preview")
    workload = derive_workload(graph)
    devices = job_cluster(loaded, None).num_devices
    models = tuple(sorted({(r.dims, r.weight_bytes) for r in derive_roles(graph)}, key=lambda m: m[0].model_dump_json()))
    return JobModels(loaded.spec.name, models, loaded.spec.run.threads_per_rank,
                     tuple(t for t in (1, 2, 4, 8) if t <= devices), devices, max(1, workload.responses // devices),
                     workload.prompt_len, workload.response_len)


# Vocabularies below this are not measured: their work is a few kernels' overhead, which the fitted
# per-pass host time carries.
MIN_MEASURED_VOCAB = 1024


def measure_vocab(vocab_size: int, sample_rows: int, pass_rows: int, threads: int) -> VocabCost:
    """Seconds per row and entry of the executor's work over float32 logits of `vocab_size` entries:
    sampling with one uniform per row plus the token's log-prob (`sample_rows` rows, one decode step), a
    log-prob pass's log-softmax, gather and entropy, and a training pass's forward and backward of the
    log-probs (`pass_rows` rows)."""
    from graphrl.executors.models.llama import _sample

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(sample_rows, vocab_size, generator=g)
        uniform = torch.rand(sample_rows, generator=g)

        def sample() -> None:
            token = _sample(logits, 0.8, 1.0, None, uniform)
            torch.log_softmax(logits / 0.8, dim=-1).gather(-1, token[:, None])

        pass_logits = torch.randn(pass_rows, vocab_size, generator=g)
        tokens = torch.randint(0, vocab_size, (pass_rows, 1), generator=g)

        def logprobs(x: torch.Tensor) -> torch.Tensor:
            logp = torch.log_softmax(x, dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
            return logp.gather(-1, tokens).squeeze(-1).sum() + 0.0 * entropy.sum()

        def forward() -> None:
            with torch.no_grad():
                logprobs(pass_logits)

        trainable = pass_logits.clone().requires_grad_(True)

        def train() -> None:
            trainable.grad = None
            logprobs(trainable).backward()

        per_sample = _best_time(sample, repeat=3, min_time_s=0.02) / (sample_rows * vocab_size)
        per_forward = _best_time(forward, repeat=3, min_time_s=0.02) / (pass_rows * vocab_size)
        per_train = _best_time(train, repeat=3, min_time_s=0.02) / (pass_rows * vocab_size)
    finally:
        torch.set_num_threads(previous)
    return VocabCost(vocab_size=vocab_size, generate=per_sample, forward=per_forward, train=per_train)


# Parameters past which the optimizer is not measured bigger (its rate is steady there).
MAX_MEASURED_OPTIMIZER_PARAMS = 64_000_000


def measure_optimizer(params: int, threads: int) -> float:
    """Seconds per parameter of gradient-norm clipping and an AdamW step over `params` float32
    parameters in eight tensors, with `threads` torch threads, as the executor builds and runs them."""
    from graphrl.executors.parallel import build_optimizer, clip_grad_norm

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tensors = [torch.nn.Parameter(torch.randn(max(1, params // 8))) for _ in range(8)]
        for t in tensors:
            t.grad = torch.randn_like(t)
        optimizer = build_optimizer(torch.nn.ParameterList(tensors), "none", "local", None, lr=1e-4,
                                    betas=(0.9, 0.999), weight_decay=0.0)  # the executor's own optimizer

        def step() -> None:
            clip_grad_norm(tensors, 1.0)
            optimizer.step()

        return _best_time(step, repeat=3, min_time_s=0.05) / (8 * max(1, params // 8))
    finally:
        torch.set_num_threads(previous)


# The job probes: the job's own per-rank batch (and a quarter of it) and lengths, at two depths (the
# per-layer time is their difference): its own depth up to this many layers, and half of that. A layer
# measured in a one- to three-layer model costs more than one deep in the stack (SmolLM2 generating 64
# sequences: 0.46 s a layer between 1 and 3 layers, 0.37 s between 3 and 6, 0.41 s from 10 to 30).
JOB_PROBE_MAX_LAYERS = 6


def job_probe_layers(num_layers: int) -> tuple[int, ...]:
    """The depths a job's model of `num_layers` layers is probed at (one, for a one-layer model)."""
    deepest = min(num_layers, JOB_PROBE_MAX_LAYERS)
    return tuple(sorted({max(1, deepest // 2), deepest}))


def probe_jobs(jobs: list[JobModels], report: Callable[[str], None]
               ) -> tuple[tuple[MatmulFit, ...], tuple[VocabCost, ...], float, list[list[Probe]]]:
    """Each job's matmul shapes and vocabulary work measured, the optimizer step at the largest job's
    model size (seconds per parameter, 0 without a job), and its models' code timed at reduced depth, with
    its threads (a list of probes per job)."""
    fits: list[MatmulFit] = []
    vocabs: dict[int, VocabCost] = {}
    probes: list[list[Probe]] = []
    optimizer_param_s = 0.0
    measured: set[tuple[int, int, int, int]] = set()
    previous = torch.get_num_threads()
    try:
        for job in jobs:
            probes.append([])
            for dims, dtype_bytes in job.models:
                shapes = {(k, n) for k, n in model_matmul_shapes(dims, job.tps)
                          if (k, n, dtype_bytes, job.threads) not in measured}
                report(f"measuring {job.name}'s matmul shapes ({len(shapes)} new)...")
                fits += measure_matmuls(shapes, dtype_bytes, job.threads, report)
                measured |= {(k, n, dtype_bytes, job.threads) for k, n in shapes}
                if dims.vocab_size >= MIN_MEASURED_VOCAB and dims.vocab_size not in vocabs:
                    cost = measure_vocab(dims.vocab_size, job.batch, min(job.batch * job.response_len, 1024),
                                         job.threads)
                    vocabs[dims.vocab_size] = cost
                    report(f"  vocabulary of {dims.vocab_size}: {cost.generate * 1e9:.2f} ns per entry sampling, "
                           f"{cost.forward * 1e9:.2f} log-prob pass, {cost.train * 1e9:.2f} training pass")
                torch.set_num_threads(job.threads)
                # Side by side on as many processes as the job's ranks that share this machine's cores, as its
                # ranks compute (each is slower than alone: shared caches and memory bandwidth).
                side_by_side = max(1, min(job.ranks, (os.cpu_count() or 1) // job.threads))
                layers = job_probe_layers(dims.num_layers)
                report(f"timing {job.name}'s model code at {' and '.join(map(str, layers))} layers, {job.threads} "
                       f"thread(s), {side_by_side} process(es) side by side...")
                args = (dims, layers, tuple(sorted({max(1, job.batch // 4), job.batch})), job.prompt_len,
                        job.response_len, dtype_bytes)
                probes[-1] += (_spawn(side_by_side, _job_probe_times, job.threads, *args) if side_by_side > 1
                               else probe_model_code(*args))
        largest = max(jobs, key=lambda j: max(param_count(d) for d, _ in j.models), default=None)
        if largest is not None:
            params = min(max(param_count(d) for d, _ in largest.models), MAX_MEASURED_OPTIMIZER_PARAMS)
            optimizer_param_s = measure_optimizer(params, largest.threads)
            report(f"  optimizer (AdamW and clipping) over {params:,} parameters, {largest.threads} thread(s): "
                   f"{optimizer_param_s * 1e9:.2f} ns per parameter")
    finally:
        torch.set_num_threads(previous)
    return tuple(fits), tuple(vocabs.values()), optimizer_param_s, probes


def calibrate(report: Callable[[str], None] = print, with_p2p: bool = True, max_ranks: int = 4,
              jobs: tuple[str | Path, ...] = ()) -> HardwareSpec:
    """Measure this machine into a `cpu-local` description; `with_p2p=False` skips every multi-process
    measurement (point-to-point and collectives keep the preset's figures). With `jobs`, the matmul shapes
    of their models are measured in their dtype and threads, and their models' code is probed too."""
    keep_freed_host_memory()  # the probes allocate as a CPU rank does
    base = HARDWARE_PRESETS["cpu-local"]
    targets = [job_models(j) for j in jobs]
    if with_p2p:  # first: the data-parallel probes below are predicted with the measured collectives
        report("measuring gloo point-to-point between two processes...")
        p2p_bw, latency = p2p_bandwidth_latency()
        report(f"  {p2p_bw / 1e9:.2f} GB/s, latency {latency * 1e6:.0f} µs")
        report(f"measuring gloo collectives on 2 to {max_ranks} processes...")
        base = base.model_copy(update=dict(intra_node_bandwidth=p2p_bw, inter_node_bandwidth=p2p_bw,
                                           link_latency_s=latency, collectives=collective_fits(max_ranks, report=report)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ranks run one thread each by default
    try:
        report("measuring matmul FLOP/s (one thread)...")
        flops = matmul_flops()
        peak = max(flops.values())
        for n, f in flops.items():
            report(f"  {n:>5} x {n:<5} {f / 1e9:8.2f} GFLOP/s")
        report("measuring memory bandwidth...")
        mem_bw = memory_bandwidth()
        report(f"  {mem_bw / 1e9:.2f} GB/s")
        tiny = MODEL_PRESETS["tiny-digits"]
        report("measuring the probe model's matmul shapes (one thread)...")
        fits = measure_matmuls(model_matmul_shapes(tiny, (1, 2)), 4, 1, report)
        side_by_side = min(max_ranks, os.cpu_count() or 1) if with_p2p else 1
        report(f"timing the executor's model code on probe models ({side_by_side} process(es) side by side)...")
        probes = probe_side_by_side(side_by_side)
        job_fits, vocab_costs, optimizer_param_s, job_probes = probe_jobs(targets, report)
        # fp8 weights are dequantized at use on a CPU: the same matmul rate as unquantized ones.
        measured = base.model_copy(update=dict(peak_bf16_flops=peak, peak_fp8_flops=peak, memory_bandwidth=mem_bw,
                                               host_link_bandwidth=mem_bw, matmuls=fits + job_fits,
                                               vocab=vocab_costs, optimizer_param_s=optimizer_param_s))
        report("fitting the host model (general figures, from the probe model):")
        fitted = fit_host_model(probes, measured)
        _report_fit(probes, fitted, report)
        host_fits = []
        for job, own in zip(targets, job_probes):
            # A job on several ranks also learns from the data-parallel probes what a rank's update costs
            # beside its peers.
            together = own + ([p for p in probes if p.ranks > 1] if job.ranks > 1 else [])
            report(f"fitting the host model of {job.name}'s models:")
            job_fit = fit_host_model(together, measured)
            _report_fit(together, job_fit, report)
            for dims, _ in job.models:
                host_fits.append(HostFit(hidden_size=dims.hidden_size, threads=job.threads,
                                         tokens=job.batch * (job.prompt_len + job.response_len),
                                         **{name: getattr(job_fit, name) for name in HOST_FIT_FIELDS}))
        fitted = fitted.model_copy(update=dict(host_fits=_distinct_host_fits(host_fits)))
        report("measuring per-instruction overhead...")
        per_op = instruction_overhead()
        report(f"  {per_op * 1e6:.0f} µs per instruction")
    finally:
        torch.set_num_threads(threads)
    update: dict[str, Any] = dict(op_overhead_s=per_op, engines=engine_throughputs(report))
    ram = physical_memory_bytes()
    if ram:  # a local rank is a process on a core: its share of the machine's memory
        update["memory_bytes"] = ram / (os.cpu_count() or 1)
        report(f"memory per rank: {update['memory_bytes'] / 2**30:.1f} GiB ({ram / 2**30:.1f} GiB over {os.cpu_count()} cores)")
    return fitted.model_copy(update=update)


def physical_memory_bytes() -> int | None:
    """This machine's physical memory in bytes, where the OS says (None elsewhere)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _report_fit(probes: list[Probe], fitted: HardwareSpec, report: Callable[[str], None]) -> None:
    for p in probes:
        pred = predicted_probe_s(p, fitted)
        report(f"  {p.phase:<9} {p.dims.num_layers} layers d{p.dims.hidden_size} x {p.batch:>4} sequences, "
               f"{p.ranks} x {p.threads} thread(s): {p.seconds * 1e3:8.2f} ms, model {pred * 1e3:8.2f} ms "
               f"({100 * (pred - p.seconds) / p.seconds:+.0f}%)")
    report(f"  per layer: {fitted.layer_overhead_s * 1e6:.0f} µs forward, {fitted.train_layer_overhead_s * 1e6:.0f} µs "
           f"training, {fitted.decode_token_overhead_s * 1e6:.2f} µs per generated token; per pass: "
           f"{fitted.pass_overhead_s * 1e6:.0f} µs forward, {fitted.train_pass_overhead_s * 1e6:.0f} µs training; "
           f"{fitted.data_parallel_layer_overhead_s * 1e6:.0f} µs per layer on a data-parallel rank "
           f"(+{fitted.sharded_unit_overhead_s * 1e6:.0f} µs per FSDP2 unit, "
           f"{fitted.sharded_forward_unit_overhead_s * 1e6:.0f} in a forward; +{fitted.zero1_step_overhead_s * 1e6:.0f} "
           f"µs per ZeRO-1 step), {fitted.tensor_parallel_layer_overhead_s * 1e6:.0f} "
           f"µs per layer and pass on a tensor-parallel rank; elementwise {_rate(fitted.elementwise_rate)} forward, "
           f"{_rate(fitted.backward_elementwise_rate)} backward")


def _rate(bytes_per_s: float) -> str:
    """A fitted elementwise rate; one the fit left unbounded means no time per elementwise byte (the probes'
    time is all in the measured matmuls, vocabulary work and host terms)."""
    return "no time" if bytes_per_s >= _HUGE / 10 else f"{bytes_per_s / 1e9:.1f} GB/s"


def _distinct_host_fits(fits: list[HostFit]) -> tuple[HostFit, ...]:
    """One fit per (width, threads, step size): the last job's, when two jobs share all three."""
    return tuple({(f.hidden_size, f.threads, f.tokens): f for f in fits}.values())


# A probe the vLLM CPU backend runs (head_dim 64), small enough to measure in seconds.
ENGINE_PROBE = ModelDims(vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                         num_kv_heads=2, max_seq_len=256, rope_theta=10000.0)


def engine_throughputs(report: Callable[[str], None] = print, batch: int = 16, prompt_len: int = 32,
                       response_len: int = 64) -> tuple[EngineThroughput, ...]:
    """Generation tokens/s of each installed engine and of the native sampler, same probe, same prompts
    (float32, no stop token, so every response is `response_len` long); best of two timed runs after a
    warm-up. Empty where no engine besides the native sampler is installed."""
    if not engine_available("vllm"):
        report("vllm is not installed: generators on engine vllm are costed as the native sampler")
        return ()
    from graphrl.executors.engines import EngineContext, GenerationRequest, NativeEngine, build_engine
    from graphrl.executors.models.llama import Llama
    from graphrl.schemas.plan import MemoryBytes, RolePlacement

    torch.manual_seed(0)
    model = Llama(ENGINE_PROBE).float().eval()
    ids = torch.randint(3, ENGINE_PROBE.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    request = GenerationRequest(ids, torch.ones_like(ids, dtype=torch.bool), response_len, 1.0, 1.0, (), 0, 0, 0, 0, 0)
    threads = torch.get_num_threads()
    probe = f"{ENGINE_PROBE.num_layers}-layer d{ENGINE_PROBE.hidden_size} Llama, {batch} x {response_len} tokens, float32, {threads} threads"

    def tokens_per_s(generate: Callable[[], Any]) -> float:
        generate()
        return batch * response_len / min(_timed_once(generate) for _ in range(2))

    report(f"measuring generation engines ({probe})...")
    native = tokens_per_s(lambda: NativeEngine(model).generate(request))
    placement = RolePlacement(role="probe/generate", model="probe", kind="generate", ops=["generate"], mesh="probe",
                              engine="vllm", memory_bytes=MemoryBytes())
    engine = build_engine(placement, model, torch.float32,
                          EngineContext(0, torch.device("cpu"), threads, 0, prompt_len + response_len, max_batch=batch))
    try:
        vllm = tokens_per_s(lambda: engine.generate(request))
    finally:
        engine.close()
    report(f"  native {native:.0f} tokens/s, vllm {vllm:.0f} tokens/s ({vllm / native:.2f}x)")
    return (EngineThroughput(engine="vllm", tokens_per_s=vllm, native_tokens_per_s=native, probe=probe),)


def _timed_once(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_calibration(spec: HardwareSpec, path: Path) -> None:
    """Write `spec` to `path` atomically, stamped with this machine and the calibration format (unless
    `spec` already names them), so that another machine or another graphrl ignores the file."""
    from graphrl.compiler.hardware import this_machine
    from graphrl.schemas.hardware import CALIBRATION_FORMAT

    # `calibrate` measures one torch thread per process, as ranks run by default.
    spec = spec.model_copy(update=dict(machine=spec.machine or this_machine(threads=1),
                                       calibration_format=spec.calibration_format or CALIBRATION_FORMAT))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(spec.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)
