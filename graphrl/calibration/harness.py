"""How calibration times a call and runs a measurement on local processes.

Every measurement of `graphrl calibrate` goes through these: a kernel's best loop, a model-code probe's
typical loop and its rounds between the other phases, one call timed once, and a function run on a
world of local gloo ranks. They live apart from what is measured so that every measurement times alike.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist


def best_time(fn: Callable[[], Any], repeat: int = 5, min_time_s: float = 0.05) -> float:
    """Seconds per call: the best of `repeat` timed loops, each at least `min_time_s` long (a kernel's own
    rate, undisturbed)."""
    return min(_loop_times(fn, repeat, min_time_s))


def typical_time(fn: Callable[[], Any], repeat: int = 5, min_time_s: float = 0.05) -> float:
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


# A probe call at least this long is timed only in the rounds that call the phases in turn: a loop of its
# own would add five calls per phase and probe, minutes on a real model (SmolLM2 at 3 and 6 layers).
LONG_CALL_S = 0.5


def phase_times(calls: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Seconds per call of each phase: the median of rounds that call the phases in turn, as a run calls
    each once per step between the others, on caches the others have just used; for a call shorter than
    `LONG_CALL_S`, the slower of that and a loop of its own (calls of the same phase back to back). Every
    process of a gloo group times the same calls."""
    first = torch.tensor([timed_once(fn) for fn in calls.values()])  # warm-up, and which calls are long
    if dist.is_initialized():  # every process decides alike: a probe's calls may run collectives
        dist.all_reduce(first, op=dist.ReduceOp.MAX)
    loops = {name: typical_time(fn, repeat=5) for (name, fn), t in zip(calls.items(), first.tolist())
             if t < LONG_CALL_S}
    cold = _interleaved_times(calls)
    return {name: max(loops.get(name, 0.0), cold[name]) for name in calls}


def timed_once(fn: Callable[[], Any]) -> float:
    """Seconds of one call of `fn`."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def spawn(world: int, measure: Callable[..., Any], *args: Any, timeout_s: float = 300.0) -> Any:
    """Run `measure(rank, world, *args)` on `world` local gloo processes; rank 0's result. A rank's
    error ends the measurement at once, naming every rank that failed and why."""
    from graphrl.executors.local_world import WorldFailed, run_on_ranks

    try:
        return run_on_ranks(world, measure, *args, timeout_s=timeout_s)[0]
    except WorldFailed as exc:
        raise RuntimeError(f"calibration on {world} local processes failed: {exc}") from None
