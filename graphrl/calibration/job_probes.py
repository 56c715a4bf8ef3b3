"""Per-job probes (`graphrl calibrate JOB`): a job's matmul shapes, vocabulary work and optimizer step
measured at its own sizes, and its models' code timed at reduced depth with its threads and ranks.

A job's models are costed from what was measured on them, not extrapolated from the small probe model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from graphrl.calibration.harness import spawn
from graphrl.calibration.microbench import (
    MAX_MEASURED_OPTIMIZER_PARAMS,
    MIN_MEASURED_VOCAB,
    measure_matmuls,
    measure_optimizer,
    measure_vocab,
    model_matmul_shapes,
    report_vocab,
)
from graphrl.calibration.model_probes import Probe, probe_model_code
from graphrl.compiler.cost import param_count
from graphrl.schemas.hardware import MatmulFit, VocabCost
from graphrl.schemas.model import ModelDims


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


# A model of a small LLM's width (SmolLM2's is 576, Qwen2.5-0.5B's 896), probed by `graphrl calibrate` without
# a job as a job of its own at every thread count a rank may use: the host figures of models about this wide
# (their per-layer and per-pass times, elementwise rates) then come from code of that width, not from the
# 64-wide probe model's.
GENERAL_PROBE_DIMS = ModelDims(vocab_size=32768, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
                               num_kv_heads=2)


def general_probe_job(threads: int, cores: int) -> JobModels:
    """The general probe model as a job of ranks with `threads` threads each, as many as share `cores`."""
    return JobModels(f"a {GENERAL_PROBE_DIMS.hidden_size}-wide probe model", ((GENERAL_PROBE_DIMS, 4),), threads, (1,),
                     max(1, cores // threads), 8, 32, 16)


# The job probes: the job's own per-rank batch (and a quarter of it) and lengths, at two depths (the
# per-layer time is their difference): its own depth up to this many layers, and half of that. A layer
# measured in a one- to three-layer model costs more than one deep in the stack (SmolLM2 generating 64
# sequences: 0.46 s a layer between 1 and 3 layers, 0.37 s between 3 and 6, 0.41 s from 10 to 30).
JOB_PROBE_MAX_LAYERS = 6


def job_probe_layers(num_layers: int) -> tuple[int, ...]:
    """The depths a job's model of `num_layers` layers is probed at (one, for a one-layer model)."""
    deepest = min(num_layers, JOB_PROBE_MAX_LAYERS)
    return tuple(sorted({max(1, deepest // 2), deepest}))


def _job_probe_times(rank: int, world: int, threads: int, *args: Any) -> list[Probe]:
    torch.set_num_threads(threads)
    return probe_model_code(*args)


def probe_jobs(jobs: list[JobModels], report: Callable[[str], None], known: tuple[MatmulFit, ...] = (),
               known_vocab: tuple[VocabCost, ...] = ()
               ) -> tuple[tuple[MatmulFit, ...], tuple[VocabCost, ...], float, list[list[Probe]]]:
    """Each job's matmul shapes and vocabulary work measured (those not in `known` / `known_vocab`), the
    optimizer step at the largest job's model size (seconds per parameter, 0 without a job), and its models'
    code timed at reduced depth, with its threads (a list of probes per job)."""
    fits: list[MatmulFit] = []
    vocabs: dict[tuple[int, int], VocabCost] = {(v.vocab_size, v.threads): v for v in known_vocab}  # by (size, threads)
    probes: list[list[Probe]] = []
    optimizer_param_s = 0.0
    measured: set[tuple[int, int, int, int]] = {(f.k, f.n, f.dtype_bytes, f.threads) for f in known}
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
                if dims.vocab_size >= MIN_MEASURED_VOCAB and (dims.vocab_size, job.threads) not in vocabs:
                    cost = measure_vocab(dims.vocab_size, job.batch, min(job.batch * job.response_len, 1024),
                                         job.threads)
                    vocabs[(dims.vocab_size, job.threads)] = cost
                    report_vocab(cost, report)
                torch.set_num_threads(job.threads)
                # Side by side on as many processes as the job's ranks that share this machine's cores, as its
                # ranks compute (each is slower than alone: shared caches and memory bandwidth).
                side_by_side = max(1, min(job.ranks, (os.cpu_count() or 1) // job.threads))
                layers = job_probe_layers(dims.num_layers)
                report(f"timing {job.name}'s model code at {' and '.join(map(str, layers))} layers, {job.threads} "
                       f"thread(s), {side_by_side} process(es) side by side...")
                args = (dims, layers, tuple(sorted({max(1, job.batch // 4), job.batch})), job.prompt_len,
                        job.response_len, dtype_bytes)
                probes[-1] += (spawn(side_by_side, _job_probe_times, job.threads, *args) if side_by_side > 1
                               else probe_model_code(*args))
        largest = max(jobs, key=lambda j: max(param_count(d) for d, _ in j.models), default=None)
        if largest is not None:
            params = min(max(param_count(d) for d, _ in largest.models), MAX_MEASURED_OPTIMIZER_PARAMS)
            optimizer_param_s = measure_optimizer(params, largest.threads)
            report(f"  optimizer (AdamW and clipping) over {params:,} parameters, {largest.threads} thread(s): "
                   f"{optimizer_param_s * 1e9:.2f} ns per parameter")
    finally:
        torch.set_num_threads(previous)
    new_vocab = tuple(v for key, v in vocabs.items() if v not in known_vocab)
    return tuple(fits), new_vocab, optimizer_param_s, probes
