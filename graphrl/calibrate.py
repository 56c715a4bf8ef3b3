"""`graphrl calibrate`: measure this machine and write the `cpu-local` hardware description.

Measured: matmul FLOP/s by size (the largest size gives the peak; the size of a tiny model's layers
gives the achievable fraction), memory bandwidth (large tensor copies), and gloo point-to-point
bandwidth and latency between two local processes. The result is a `HardwareSpec` JSON file that the
`cpu-local` preset uses from then on (see graphrl.compiler.hardware).
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphrl.schemas.hardware import HARDWARE_PRESETS, HardwareSpec


def _best_time(fn: Callable[[], None], repeat: int = 5, min_time_s: float = 0.05) -> float:
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


def layer_overhead(num_tokens: int = 4) -> float:
    """Seconds of host time per transformer layer per pass: forward a few tokens through a narrow
    Llama at two depths; the FLOPs are negligible, so the slope is the per-layer dispatch cost."""
    from graphrl.executors.models.llama import Llama
    from graphrl.schemas.model import ModelDims

    def model(layers: int) -> Llama:
        dims = ModelDims(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=2,
                         num_kv_heads=1, max_seq_len=64, rope_theta=10000.0)
        return Llama(dims).eval()

    ids = torch.zeros(1, num_tokens, dtype=torch.int64)
    mask = torch.ones(1, num_tokens, dtype=torch.bool)
    shallow, deep = model(2), model(10)
    with torch.no_grad():
        t2 = _best_time(lambda: shallow(ids, mask))
        t10 = _best_time(lambda: deep(ids, mask))
    return max((t10 - t2) / 8, 0.0)


def instruction_overhead() -> float:
    """Seconds of fixed host work an executed instruction costs besides its math: a rule reward over a
    small batch, which is almost nothing but dispatch."""
    from graphrl.tasks import REWARDS

    ids = torch.randint(0, 10, (8, 6))
    mask = torch.ones(8, 6, dtype=torch.bool)
    fn = REWARDS["digits_copy"]
    return _best_time(lambda: fn(ids, mask, ids[:, :5], mask[:, :5]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _p2p_worker(rank: int, port: int, sizes: list[int], queue) -> None:  # noqa: ANN001
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {}
    for size in sizes:
        buf = torch.zeros(size // 4)
        times = []
        for _ in range(7):
            dist.barrier()
            t = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t) / 2)
        results[size] = statistics.median(times)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def p2p_bandwidth_latency(sizes: tuple[int, ...] = (4, 1 << 20, 16 << 20)) -> tuple[float, float]:
    """(bytes/s, seconds) of gloo send/recv between two local processes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_p2p_worker, args=(r, port, list(sizes), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    latency = results[sizes[0]]
    big = sizes[-1]
    bandwidth = big / max(results[big] - latency, 1e-9)
    return bandwidth, latency


def calibrate(report: Callable[[str], None] = print, with_p2p: bool = True) -> HardwareSpec:
    base = HARDWARE_PRESETS["cpu-local"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ranks run one thread each by default
    try:
        report("measuring matmul FLOP/s (one thread)...")
        flops = matmul_flops()
        peak = max(flops.values())
        small = flops[min(flops)]
        for n, f in flops.items():
            report(f"  {n:>5} x {n:<5} {f / 1e9:8.2f} GFLOP/s")
        report("measuring memory bandwidth...")
        mem_bw = memory_bandwidth()
        report(f"  {mem_bw / 1e9:.2f} GB/s")
        report("measuring per-layer and per-instruction host overheads...")
        per_layer = layer_overhead()
        per_op = instruction_overhead()
        report(f"  {per_layer * 1e6:.0f} µs per layer pass, {per_op * 1e6:.0f} µs per instruction")
    finally:
        torch.set_num_threads(threads)
    p2p_bw, latency = base.intra_node_bandwidth, base.link_latency_s
    if with_p2p:
        report("measuring gloo point-to-point between two processes...")
        p2p_bw, latency = p2p_bandwidth_latency()
        report(f"  {p2p_bw / 1e9:.2f} GB/s, latency {latency * 1e6:.0f} µs")
    return base.model_copy(update=dict(
        peak_bf16_flops=peak, memory_bandwidth=mem_bw, intra_node_bandwidth=p2p_bw, inter_node_bandwidth=p2p_bw,
        host_link_bandwidth=mem_bw, link_latency_s=latency, compute_efficiency=min(1.0, max(small / peak, 0.05)),
        layer_overhead_s=per_layer, op_overhead_s=per_op,
    ))


def write_calibration(spec: HardwareSpec, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(spec.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)
