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
import queue as queue_module
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphrl.compiler import cost
from graphrl.engine_support import engine_available
from graphrl.schemas.hardware import HARDWARE_PRESETS, CollectiveFit, EngineThroughput, HardwareSpec, MeasuredCollective
from graphrl.schemas.model import MODEL_PRESETS, ModelDims

Phase = Literal["generate", "forward", "train"]
HOST_FIELDS = ("layer_overhead_s", "pass_overhead_s", "decode_token_overhead_s", "train_layer_overhead_s",
               "train_pass_overhead_s")
COLLECTIVES: tuple[MeasuredCollective, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
_HUGE = 1e30  # a rate so high that the term it divides vanishes


def _best_time(fn: Callable[[], Any], repeat: int = 5, min_time_s: float = 0.05) -> float:
    """Seconds per call: the best of `repeat` timed loops, each at least `min_time_s` long."""
    fn()
    calls = 1
    while True:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        if time.perf_counter() - t >= min_time_s or calls > 1 << 20:
            break
        calls *= 2
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


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


def predicted_probe_s(probe: Probe, hw: HardwareSpec) -> float:
    """The cost model's seconds for `probe` on `hw`, through the same functions placement uses (one
    micro-batch: the whole batch in one forward, as a job without `micro_batch_size` runs)."""
    seq_len = probe.prompt_len + probe.response_len
    tokens = probe.batch * seq_len
    if probe.phase == "generate":
        return cost.generation_time(probe.dims, probe.batch, probe.prompt_len, probe.response_len, 1, "bf16", hw)
    if probe.phase == "forward":
        return cost.forward_time(probe.dims, tokens=tokens, seq_len=seq_len, hw=hw, microbatches=1).total_s
    return cost.training_step_time(
        probe.dims, tokens=tokens, seq_len=seq_len, dp=1, fsdp=1, tp=1, pp=1, sharding="none", recompute=False,
        hw=hw, intra_node_tp=True, dp_spans_nodes=False, microbatches=1,
    ).total_s


def _nonnegative_least_squares(rows: list[list[float]], target: list[float]) -> list[float]:
    """argmin ||A x - b|| over x >= 0, exactly: the best unconstrained fit over every subset of free
    variables whose solution is nonnegative (the host model has six unknowns, so 63 subsets)."""
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
    """`base` with the host overheads and compute efficiency that best reproduce the probe timings.

    Each probe's predicted time is linear in six unknowns (five host overheads and seconds per FLOP)
    once memory traffic is negligible, as it is for small models: the basis of each unknown is the
    cost model's prediction on a description where only that unknown is 1. The fit minimises the
    relative error over the probes, with every unknown >= 0.
    """
    zero = {name: 0.0 for name in HOST_FIELDS}
    fast = dict(zero, peak_bf16_flops=_HUGE, compute_efficiency=1.0, memory_bandwidth=_HUGE, memory_efficiency=1.0)
    bases = [base.model_copy(update=dict(fast, **{name: 1.0})) for name in HOST_FIELDS]
    bases.append(base.model_copy(update=dict(fast, peak_bf16_flops=1.0)))  # seconds = FLOPs
    rows = [[predicted_probe_s(p, hw) / p.seconds for hw in bases] for p in probes]
    x = _nonnegative_least_squares(rows, [1.0] * len(probes))
    *overheads, seconds_per_flop = x
    efficiency = 1.0 if seconds_per_flop <= 0 else min(1.0, 1.0 / (seconds_per_flop * base.peak_bf16_flops))
    return base.model_copy(update=dict(zip(HOST_FIELDS, overheads), compute_efficiency=max(efficiency, 1e-3)))


def probe_model_code(
    dims: ModelDims = MODEL_PRESETS["tiny-digits"],
    layers: tuple[int, ...] = (1, 4),
    batches: tuple[int, ...] = (8, 128),
    prompt_len: int = 6,
    response_len: int = 5,
) -> list[Probe]:
    """Time generation, a log-prob forward and a training step (GRPO/PPO loss, gradient clipping,
    AdamW) as the executor runs them, on `dims` at every depth in `layers` and batch in `batches`."""
    from graphrl.executors import algorithms as alg
    from graphrl.executors.models.llama import Llama, generate, token_logprobs_and_entropy
    from graphrl.tasks import PAD

    probes = []
    for num_layers, batch in itertools.product(layers, batches):
        d = dims.model_copy(update=dict(num_layers=num_layers))
        torch.manual_seed(0)
        model = Llama(d)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        prompt_ids = torch.randint(3, d.vocab_size, (batch, prompt_len))
        prompt_mask = torch.ones(batch, prompt_len, dtype=torch.bool)

        def gen() -> Any:
            # eos_id -1 never occurs, so every call runs all response_len passes
            return generate(model, prompt_ids, prompt_mask, response_len, temperature=1.0, top_p=1.0,
                            generator=torch.Generator().manual_seed(0), eos_id=-1, pad_id=PAD)

        model.eval()
        out = gen()
        t_gen = _best_time(gen, repeat=3)
        advantages = torch.randn(batch, response_len)

        def forward() -> None:
            with torch.no_grad():
                token_logprobs_and_entropy(model, prompt_ids, prompt_mask, out.response_ids, out.response_mask)

        def train() -> None:
            optimizer.zero_grad(set_to_none=True)
            logprobs, _ = token_logprobs_and_entropy(model, prompt_ids, prompt_mask, out.response_ids, out.response_mask)
            loss, _ = alg.policy_loss(logprobs, out.logprobs, advantages, out.response_mask, 0.2)
            loss.backward()
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            optimizer.step()
            float(loss.detach())

        model.train()
        t_fwd = _best_time(forward, repeat=3)
        t_train = _best_time(train, repeat=3)
        for phase, seconds in (("generate", t_gen), ("forward", t_fwd), ("train", t_train)):
            probes.append(Probe(phase, d, batch, prompt_len, response_len, seconds))  # type: ignore[arg-type]
    return probes


def _probe_times(rank: int, world: int) -> list[Probe]:
    return probe_model_code()


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@dataclass(frozen=True)
class _Failure:
    rank: int
    error: str


def _worker(rank: int, world: int, port: int, measure: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = measure(rank, world, *args)
        if rank == 0:
            queue.put(result)
    except Exception as exc:  # reported by the parent, with every other rank's error
        queue.put(_Failure(rank, f"{type(exc).__name__}: {exc}".splitlines()[0]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(world: int, measure: Callable[..., Any], *args: Any, timeout_s: float = 300.0) -> Any:
    """Run `measure(rank, world, *args)` on `world` local gloo processes; rank 0's result. A rank's
    error ends the measurement at once, naming every rank that failed and why."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, measure, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                item = queue.get(timeout=0.5)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    what = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}" if dead else "timed out"
                    raise RuntimeError(f"calibration on {world} local processes failed: {what}") from None
                continue
            if not isinstance(item, _Failure):
                return item
            failures = [item]
            for p in procs:  # the others fail soon after (their peer is gone): collect them too
                p.join(timeout=10)
            while not queue.empty():
                failures.append(queue.get())
            detail = "; ".join(f"rank {f.rank}: {f.error}" for f in sorted(failures, key=lambda f: f.rank)
                               if isinstance(f, _Failure))
            raise RuntimeError(f"calibration on {world} local processes failed: {detail}")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


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
    factor, steps = cost.ring_shape(kind, group_size)
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


def calibrate(report: Callable[[str], None] = print, with_p2p: bool = True, max_ranks: int = 4) -> HardwareSpec:
    """Measure this machine into a `cpu-local` description; `with_p2p=False` skips every multi-process
    measurement (point-to-point and collectives keep the preset's figures)."""
    base = HARDWARE_PRESETS["cpu-local"]
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
        side_by_side = min(max_ranks, os.cpu_count() or 1) if with_p2p else 1
        report(f"timing the executor's model code on probe models ({side_by_side} process(es) side by side)...")
        probes = probe_side_by_side(side_by_side)
        # fp8 weights are dequantized at use on a CPU: the same matmul rate as unquantized ones.
        measured = base.model_copy(update=dict(peak_bf16_flops=peak, peak_fp8_flops=peak, memory_bandwidth=mem_bw,
                                               host_link_bandwidth=mem_bw))
        fitted = fit_host_model(probes, measured)
        for p in probes:
            pred = predicted_probe_s(p, fitted)
            report(f"  {p.phase:<9} {p.dims.num_layers} layers x {p.batch:>4} sequences: {p.seconds * 1e3:7.2f} ms, "
                   f"model {pred * 1e3:7.2f} ms ({100 * (pred - p.seconds) / p.seconds:+.0f}%)")
        report(f"  per layer: {fitted.layer_overhead_s * 1e6:.0f} µs forward, {fitted.train_layer_overhead_s * 1e6:.0f} µs "
               f"training, {fitted.decode_token_overhead_s * 1e6:.2f} µs per generated token; per pass: "
               f"{fitted.pass_overhead_s * 1e6:.0f} µs forward, {fitted.train_pass_overhead_s * 1e6:.0f} µs training; "
               f"{fitted.compute_efficiency * peak / 1e9:.1f} GFLOP/s achieved")
        report("measuring per-instruction overhead...")
        per_op = instruction_overhead()
        report(f"  {per_op * 1e6:.0f} µs per instruction")
    finally:
        torch.set_num_threads(threads)
    update: dict[str, Any] = dict(op_overhead_s=per_op)
    if with_p2p:
        report("measuring gloo point-to-point between two processes...")
        p2p_bw, latency = p2p_bandwidth_latency()
        report(f"  {p2p_bw / 1e9:.2f} GB/s, latency {latency * 1e6:.0f} µs")
        update.update(intra_node_bandwidth=p2p_bw, inter_node_bandwidth=p2p_bw, link_latency_s=latency)
        report(f"measuring gloo collectives on 2 to {max_ranks} processes...")
        update["collectives"] = collective_fits(max_ranks, report=report)
    update["engines"] = engine_throughputs(report)
    return fitted.model_copy(update=update)


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
                          EngineContext(0, torch.device("cpu"), threads, 0, prompt_len + response_len))
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
