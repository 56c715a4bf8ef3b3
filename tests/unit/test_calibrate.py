"""`graphrl calibrate` writes a hardware file that the cpu-local preset then uses."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch.distributed as dist
from click.testing import CliRunner

from graphrl.calibrate import (
    COLLECTIVES,
    HOST_FIELDS,
    Probe,
    _spawn,
    collective_fits,
    fit_collective,
    fit_host_model,
    p2p_bandwidth_latency,
    predicted_probe_s,
)
from graphrl.cli import main
from graphrl.compiler import cost
from graphrl.compiler.hardware import resolve_hardware
from graphrl.schemas.cluster import CLUSTER_PRESETS
from graphrl.schemas.hardware import HARDWARE_PRESETS, CollectiveFit, HardwareSpec
from graphrl.schemas.model import MODEL_PRESETS


def test_calibration_file_is_used_by_cpu_local(tmp_path, monkeypatch):
    target = tmp_path / "cpu-local.json"
    out = CliRunner().invoke(main, ["calibrate", "--no-p2p", "-o", str(target)])
    assert out.exit_code == 0, out.output
    spec = HardwareSpec.model_validate_json(target.read_text())
    assert spec.peak_bf16_flops > 1e8 and spec.memory_bandwidth > 1e8
    monkeypatch.setenv("GRAPHRL_CALIBRATION", str(target))
    assert resolve_hardware(CLUSTER_PRESETS["local-cpu-2"]) == spec
    monkeypatch.setenv("GRAPHRL_CALIBRATION", "none")
    assert resolve_hardware(CLUSTER_PRESETS["local-cpu-2"]) == HARDWARE_PRESETS["cpu-local"]


def test_broken_calibration_file_is_a_user_error(tmp_path, monkeypatch):
    bad = tmp_path / "cal.json"
    bad.write_text("{not json")
    monkeypatch.setenv("GRAPHRL_CALIBRATION", str(bad))
    out = CliRunner().invoke(main, ["compile", "examples/grpo_tiny.yaml", "--plan"])
    assert out.exit_code == 2 and "unreadable" in out.output and "Traceback" not in out.output


def test_gloo_p2p_measurement_between_two_processes():
    bandwidth, latency = p2p_bandwidth_latency(sizes=(4, 1 << 16))
    assert bandwidth > 0 and 0 < latency < 1.0


# -- the host model fit ------------------------------------------------------------------------------

def _grid(truth: HardwareSpec) -> list[Probe]:
    """Probes timed exactly as the cost model says `truth` would run them."""
    dims = MODEL_PRESETS["tiny-digits"]
    probes = []
    for phase in ("generate", "forward", "train"):
        for layers in (1, 4):
            for batch in (8, 128):
                d = dims.model_copy(update=dict(num_layers=layers))
                p = Probe(phase, d, batch, 6, 5, 1.0)
                probes.append(dataclasses.replace(p, seconds=predicted_probe_s(p, truth)))
    return probes


BASE = HARDWARE_PRESETS["cpu-local"].model_copy(update=dict(
    peak_bf16_flops=80e9, memory_bandwidth=1e15))  # memory traffic negligible, as the fit assumes
TRUTH = BASE.model_copy(update=dict(
    layer_overhead_s=300e-6, pass_overhead_s=450e-6, decode_token_overhead_s=2e-6,
    train_layer_overhead_s=1.5e-3, train_pass_overhead_s=2e-3, compute_efficiency=0.4))


def test_host_fit_recovers_the_description_that_made_the_timings():
    """Timings made by the cost model from known overheads must give back exactly those overheads:
    a basis that disagreed with the prediction functions (e.g. a wrong micro-batch count) fails here."""
    fitted = fit_host_model(_grid(TRUTH), BASE.model_copy(update={name: 0.0 for name in HOST_FIELDS}))
    for name in HOST_FIELDS + ("compute_efficiency",):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name


def test_host_fit_stays_nonnegative_on_noisy_timings():
    """Noise must not buy a better fit with a negative overhead (which would make large models cheaper
    than small ones); the fitted model still reproduces the timings closely."""
    truth = TRUTH.model_copy(update=dict(pass_overhead_s=0.0))
    rng = random.Random(0)
    probes = [dataclasses.replace(p, seconds=p.seconds * rng.uniform(0.93, 1.07)) for p in _grid(truth)]
    fitted = fit_host_model(probes, BASE)
    assert all(getattr(fitted, name) >= 0.0 for name in HOST_FIELDS)
    for p in probes:
        assert predicted_probe_s(p, fitted) == pytest.approx(p.seconds, rel=0.15)


# -- collectives -------------------------------------------------------------------------------------

def test_collective_fit_reproduces_the_measurement_in_the_cost_model():
    """A fit from {bytes: seconds} must make cost.collective_time return those seconds again."""
    times = {1024: 400e-6, 4 << 20: 9e-3}
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        for n in (2, 3, 4):
            fit = fit_collective(kind, n, times)
            hw = BASE.model_copy(update=dict(collectives=(fit,)))
            for size, seconds in times.items():
                assert cost.collective_time(kind, size, n, hw, spans_nodes=False) == pytest.approx(seconds, rel=1e-9)


def test_collective_time_uses_the_nearest_measured_group_size():
    fit2 = CollectiveFit(kind="all_reduce", group_size=2, bus_bandwidth=1e9, latency_s=1e-4)
    fit4 = CollectiveFit(kind="all_reduce", group_size=4, bus_bandwidth=4e9, latency_s=1e-5)
    hw = BASE.model_copy(update=dict(collectives=(fit2, fit4)))
    assert cost.measured_collective(hw, "all_reduce", 3) is fit2
    assert cost.measured_collective(hw, "all_reduce", 8) is fit4
    assert cost.measured_collective(hw, "all_gather", 2) is None
    ring = 2 * 7 * (1e6 / (8 * 4e9) + 1e-5)
    assert cost.collective_time("all_reduce", 1e6, 8, hw, spans_nodes=False) == pytest.approx(ring)
    # Across nodes, and for kinds never measured, the link figures apply.
    plain = BASE.model_copy(update=dict(collectives=()))
    assert cost.collective_time("all_reduce", 1e6, 8, hw, True) == cost.collective_time("all_reduce", 1e6, 8, plain, True)
    assert cost.collective_time("all_gather", 1e6, 2, hw, False) == cost.collective_time("all_gather", 1e6, 2, plain, False)


@pytest.mark.slow
def test_gloo_collectives_measured_for_every_group_size():
    fits = collective_fits(max_ranks=3, sizes=(1024, 1 << 16), repeats=3)
    assert {(f.kind, f.group_size) for f in fits} == {(k, n) for k in COLLECTIVES for n in (2, 3)}
    assert all(f.bus_bandwidth > 0 and f.latency_s >= 0 for f in fits)


def _fail_on_rank_one(rank: int, world: int) -> dict:
    if rank == 1:
        raise RuntimeError("boom")
    dist.barrier()
    return {}


def test_a_failing_measurement_process_is_reported_not_waited_for():
    """A rank that failed used to leave the parent blocked on the result queue until its timeout (300 s);
    now the parent ends at once and names the failing rank with its error."""
    with pytest.raises(RuntimeError, match="rank 1: RuntimeError: boom"):
        _spawn(2, _fail_on_rank_one, timeout_s=120)
