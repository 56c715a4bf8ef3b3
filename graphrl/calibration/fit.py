"""The host model: the overheads and elementwise rates that reproduce the probes' timings through the
cost model's own formulas.

`fit_host_model` is a pure function of the probe timings, so it is tested on timings made from a known
description.
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from graphrl.calibration.model_probes import Probe
from graphrl.compiler.cost import timing
from graphrl.schemas.hardware import HOST_FIT_FIELDS, HardwareSpec

HOST_FIELDS = HOST_FIT_FIELDS[:-2]  # the host overheads; the fit's last two unknowns are the elementwise rates
_HUGE = 1e30  # a rate so high that the term it divides vanishes


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


def report_fit(probes: list[Probe], fitted: HardwareSpec, report: Callable[[str], None]) -> None:
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
