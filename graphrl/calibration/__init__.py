"""`graphrl calibrate`: measure this machine and write the `cpu-local` hardware description.

Measured, one thread per process as ranks run by default:
- matmul FLOP/s by size (the peak) and memory bandwidth (large tensor copies);
- general matmul shapes (widths 128 to 2048: square, key/value, MLP up and down, vocabulary heads) and the
  work over a vocabulary, with every thread count a rank may use (`rank_thread_counts`), so that a job never
  calibrated is timed from rates measured near its own shapes and threads;
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
graphrl.compiler.hardware). One module per job: `harness` (timing and local processes), `microbench`,
`model_probes`, `job_probes`, `fit` (the host model), `collectives`, `engines`, `files` (the calibration
file) and `speed` (the machine-speed check a run prints); `calibrate` here composes them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from graphrl.calibration.collectives import collective_fits, p2p_bandwidth_latency
from graphrl.calibration.engines import engine_throughputs
from graphrl.calibration.files import write_calibration
from graphrl.calibration.fit import fit_host_model, report_fit
from graphrl.calibration.job_probes import general_probe_job, job_models, probe_jobs
from graphrl.calibration.microbench import (
    GENERAL_VOCAB,
    general_matmul_shapes,
    instruction_overhead,
    matmul_flops,
    measure_matmuls,
    measure_vocab,
    memory_bandwidth,
    model_matmul_shapes,
    rank_thread_counts,
    report_vocab,
)
from graphrl.calibration.model_probes import probe_side_by_side
from graphrl.calibration.speed import machine_speed
from graphrl.compiler.background import usable_cores
from graphrl.executors.host_memory import keep_freed_host_memory
from graphrl.schemas.hardware import HARDWARE_PRESETS, HOST_FIT_FIELDS, EnvironmentTiming, HardwareSpec, HostFit
from graphrl.schemas.model import MODEL_PRESETS

__all__ = ["calibrate", "machine_speed", "write_calibration"]


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
        general_vocab = []
        cores = usable_cores()
        for t in rank_thread_counts(cores):
            report(f"measuring general matmul shapes and a {GENERAL_VOCAB}-entry vocabulary ({t} thread(s))...")
            fits += measure_matmuls(general_matmul_shapes(), 4, t, report)
            general_vocab.append(measure_vocab(GENERAL_VOCAB, 16, 256, t))
            report_vocab(general_vocab[-1], report)
        side_by_side = min(max_ranks, os.cpu_count() or 1) if with_p2p else 1
        report(f"timing the executor's model code on probe models ({side_by_side} process(es) side by side)...")
        probes = probe_side_by_side(side_by_side)
        # The general probe model first, as a job at each thread count, then the jobs given.
        # (Without multi-process measurements, each on one process.)
        probed = [general_probe_job(t, cores if with_p2p else t) for t in rank_thread_counts(cores)] + targets
        job_fits, vocab_costs, optimizer_param_s, job_probes = probe_jobs(probed, report, fits, tuple(general_vocab))
        vocab_costs = tuple(general_vocab) + vocab_costs
        # fp8 weights are dequantized at use on a CPU: the same matmul rate as unquantized ones.
        measured = base.model_copy(update=dict(peak_bf16_flops=peak, peak_fp8_flops=peak, memory_bandwidth=mem_bw,
                                               host_link_bandwidth=mem_bw, matmuls=fits + job_fits,
                                               vocab=vocab_costs, optimizer_param_s=optimizer_param_s))
        report("fitting the host model (general figures, from the probe model):")
        fitted = fit_host_model(probes, measured)
        report_fit(probes, fitted, report)
        host_fits = []
        for job, own in zip(probed, job_probes):
            # A job on several ranks also learns from the data-parallel probes what a rank's update costs
            # beside its peers.
            together = own + ([p for p in probes if p.ranks > 1] if job.ranks > 1 else [])
            report(f"fitting the host model of {job.name}'s models:")
            job_fit = fit_host_model(together, measured)
            report_fit(together, job_fit, report)
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
    update: dict[str, Any] = dict(op_overhead_s=per_op, engines=engine_throughputs(report),
                                  environments=measured_environments(jobs, report))
    ram = physical_memory_bytes()
    if ram:  # a local rank is a process on a core: its share of the machine's memory
        update["memory_bytes"] = ram / (os.cpu_count() or 1)
        report(f"memory per rank: {update['memory_bytes'] / 2**30:.1f} GiB ({ram / 2**30:.1f} GiB over {os.cpu_count()} cores)")
    return fitted.model_copy(update=update)


def measured_environments(jobs: tuple[str | Path, ...], report: Callable[[str], None]) -> tuple[EnvironmentTiming, ...]:
    """The environments of the jobs that have one, each timed over a few of its episodes."""
    from graphrl.calibration.environments import measure_environment

    return tuple(t for job in jobs if (t := measure_environment(job, report)) is not None)


def physical_memory_bytes() -> int | None:
    """This machine's physical memory in bytes, where the OS says (None elsewhere)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _distinct_host_fits(fits: list[HostFit]) -> tuple[HostFit, ...]:
    """One fit per (width, threads, step size): the last job's, when two jobs share all three."""
    return tuple({(f.hidden_size, f.threads, f.tokens): f for f in fits}.values())
