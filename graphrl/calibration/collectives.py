"""Communication between local processes: gloo point-to-point bandwidth and latency, and each collective
for every group size, fitted as the ring model's bandwidth and per-step latency that reproduce it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from graphrl.calibration.harness import spawn
from graphrl.compiler.cost import timing
from graphrl.schemas.hardware import CollectiveFit, MeasuredCollective

COLLECTIVES: tuple[MeasuredCollective, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


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
    times = spawn(2, _p2p_times, list(sizes), repeats)["p2p"]
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
        measured = spawn(n, _collective_times, list(sizes), repeats)
        for kind in COLLECTIVES:
            fit = fit_collective(kind, n, measured[kind])
            fits.append(fit)
            report(f"  {n} ranks {kind:<15} {fit.bus_bandwidth / 1e9:6.2f} GB/s, {fit.latency_s * 1e6:5.0f} µs per step")
    return tuple(fits)
