"""`graphrl calibrate` writes a hardware file that the cpu-local preset then uses."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import warnings
from pathlib import Path

import pytest
import torch.distributed as dist
from click.testing import CliRunner

from graphrl.calibration import harness, write_calibration
from graphrl.calibration.collectives import COLLECTIVES, collective_fits, fit_collective, p2p_bandwidth_latency
from graphrl.calibration.fit import HOST_FIELDS, fit_host_model, predicted_probe_s
from graphrl.calibration.harness import LONG_CALL_S, phase_times, spawn
from graphrl import calibration
from graphrl.calibration import job_probes, microbench
from graphrl.calibration.job_probes import job_probe_layers
from graphrl.calibration.model_probes import Probe
from graphrl.cli import main
from graphrl.compiler.cost import timing
from graphrl.compiler.hardware import resolve_hardware, this_machine
from graphrl.errors import CalibrationWarning
from graphrl.schemas.cluster import CLUSTER_PRESETS
from graphrl.schemas.hardware import (CALIBRATION_FORMAT, HARDWARE_PRESETS, CollectiveFit, HardwareSpec, MatmulFit,
                                      VocabCost)
from graphrl.schemas.model import MODEL_PRESETS


def test_calibration_file_is_used_by_cpu_local(tmp_path, monkeypatch):
    # The general shapes and probe model shrunk to keep the test short; what is measured for them is as a
    # full calibration measures it.
    monkeypatch.setattr(microbench, "MATMUL_ROWS", (1, 64, 4096))  # the ends and the middle of the row range
    monkeypatch.setattr(microbench, "GENERAL_WIDTHS", (64,))
    monkeypatch.setattr(microbench, "GENERAL_HEADS", ((64, 2048),))
    monkeypatch.setattr(calibration, "GENERAL_VOCAB", 2048)
    probe_dims = MODEL_PRESETS["tiny-digits"].model_copy(update=dict(hidden_size=96, num_heads=4, num_kv_heads=2,
                                                                     num_layers=2))
    monkeypatch.setattr(calibration, "general_probe_job", lambda threads, cores: job_probes.JobModels(
        "a 96-wide probe model", ((probe_dims, 4),), threads, (1,), max(1, cores // threads), 4, 6, 4))
    monkeypatch.setattr(calibration, "rank_thread_counts", lambda cores: (1, 2))
    target = tmp_path / "cpu-local.json"
    out = CliRunner().invoke(main, ["calibrate", "--no-p2p", "-o", str(target)])
    assert out.exit_code == 0, out.output
    spec = HardwareSpec.model_validate_json(target.read_text())
    assert spec.peak_bf16_flops > 1e8 and spec.memory_bandwidth > 1e8
    # A job never calibrated is timed from general shapes, vocabulary work and host figures measured with
    # every thread count a rank may use, and from the optimizer's own rate.
    for threads in (1, 2):
        assert {(f.k, f.n) for f in spec.matmuls if f.threads == threads} >= {(64, 64), (64, 16), (64, 192), (192, 64),
                                                                           (64, 2048)}
        assert [(v.vocab_size, v.threads) for v in spec.vocab if v.threads == threads] == [(2048, threads)]
        assert {(f.hidden_size, f.threads) for f in spec.host_fits} >= {(96, threads)}
    assert spec.optimizer_param_s > 0
    narrow = spec.for_rank(2, 96)
    assert {f.threads for f in narrow.matmuls} == {2} and {v.threads for v in narrow.vocab} == {2}
    assert narrow.train_layer_overhead_s == next(f for f in spec.host_fits if f.threads == 2).train_layer_overhead_s
    monkeypatch.setenv("GRAPHRL_CALIBRATION", str(target))
    assert resolve_hardware(CLUSTER_PRESETS["local-cpu-2"]) == spec
    monkeypatch.setenv("GRAPHRL_CALIBRATION", "none")
    assert resolve_hardware(CLUSTER_PRESETS["local-cpu-2"]) == HARDWARE_PRESETS["cpu-local"]


# -- calibration files that cannot be trusted ----------------------------------------------------------
#
# A calibration file is only read where it was measured, by the graphrl that wrote it. Before, an unreadable
# file was an error that stopped every compile (a file copied from another machine was silently used);
# now each untrusted file gives one warning naming it and why, and the preset's defaults.

CALIBRATED = HARDWARE_PRESETS["cpu-local"].model_copy(update=dict(peak_bf16_flops=123e9, layer_overhead_s=7e-4))
LOCAL_CPU = CLUSTER_PRESETS["local-cpu-2"]


def _calibration_file(tmp_path, **changes) -> Path:
    """A file as `graphrl calibrate` writes it on this machine, with `changes` to its JSON (None deletes a key)."""
    path = tmp_path / "cpu-local.json"
    write_calibration(CALIBRATED, path)
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    return path


def _ignored(path, monkeypatch, reason: str) -> None:
    monkeypatch.setenv("GRAPHRL_CALIBRATION", str(path))
    with pytest.warns(CalibrationWarning) as caught:
        assert resolve_hardware(LOCAL_CPU) == HARDWARE_PRESETS["cpu-local"]
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(f"calibration file {path} ignored: ") and reason in message, message
    assert message.endswith("; using the cpu-local defaults (rerun graphrl calibrate)"), message


def test_calibration_file_records_this_machine_and_the_format(tmp_path, monkeypatch):
    path = _calibration_file(tmp_path)
    written = HardwareSpec.model_validate_json(path.read_text())
    assert written.calibration_format == CALIBRATION_FORMAT
    assert written.machine is not None and written.machine.same_machine(this_machine())
    assert written.machine.threads == 1  # calibrate measures one thread per process
    monkeypatch.setenv("GRAPHRL_CALIBRATION", str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_hardware(LOCAL_CPU) == written
    assert HARDWARE_PRESETS["cpu-local"].machine is None and HARDWARE_PRESETS["cpu-local"].calibration_format is None


def test_calibration_measured_with_other_threads_is_the_same_machine(tmp_path, monkeypatch):
    """Threads per rank are a setting of the measurement, not the machine: they never refuse a file."""
    machine = this_machine(threads=8).model_dump()
    monkeypatch.setenv("GRAPHRL_CALIBRATION", str(_calibration_file(tmp_path, machine=machine)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_hardware(LOCAL_CPU).peak_bf16_flops == CALIBRATED.peak_bf16_flops


def test_corrupt_calibration_file_is_ignored_with_a_warning(tmp_path, monkeypatch):
    bad = tmp_path / "cal.json"
    bad.write_text("{not json")
    _ignored(bad, monkeypatch, "not JSON")


def test_calibration_file_that_is_not_a_description_is_ignored(tmp_path, monkeypatch):
    _ignored(_calibration_file(tmp_path, peak_bf16_flops=-1.0), monkeypatch,
             "not a valid hardware description (peak_bf16_flops: ")
    _ignored(_calibration_file(tmp_path, memory_bytes="lots"), monkeypatch, "not a valid hardware description")


def test_calibration_file_of_an_older_format_is_ignored(tmp_path, monkeypatch):
    """A file from before machines were recorded names no machine: it may be from anywhere."""
    older = tmp_path / "older.json"
    older.write_text(CALIBRATED.model_dump_json(exclude={"machine", "calibration_format"}))
    _ignored(older, monkeypatch, "older format")
    _ignored(_calibration_file(tmp_path, machine=None), monkeypatch, "older format (it records no machine")


def test_calibration_file_of_another_format_version_is_ignored(tmp_path, monkeypatch):
    newer = _calibration_file(tmp_path, calibration_format=CALIBRATION_FORMAT + 1, fitted_by_a_newer_graphrl=1.0)
    _ignored(newer, monkeypatch, f"format version {CALIBRATION_FORMAT + 1}; this graphrl reads format "
                                 f"{CALIBRATION_FORMAT}")


def test_calibration_file_from_another_machine_is_ignored(tmp_path, monkeypatch):
    here = this_machine()
    other_cpu = dict(here.model_dump(), cpu_model=here.cpu_model + " (another one)")
    _ignored(_calibration_file(tmp_path, machine=other_cpu), monkeypatch, "measured on another machine")
    more_cores = dict(here.model_dump(), logical_cores=here.logical_cores + 62)
    _ignored(_calibration_file(tmp_path, machine=more_cores), monkeypatch,
             f"with {here.logical_cores + 62} logical cores; this one is ")


def test_cli_compiles_on_the_defaults_past_a_broken_calibration_file(tmp_path, monkeypatch):
    """The CLI says it once, on one line, and compiles: before, this exited 2 and no compile ran."""
    bad = tmp_path / "cal.json"
    bad.write_text("{not json")
    monkeypatch.setenv("GRAPHRL_CALIBRATION", str(bad))
    out = CliRunner().invoke(main, ["compile", "examples/grpo_tiny.yaml", "--plan"])
    assert out.exit_code == 0, out.output
    assert "Traceback" not in out.output and "CalibrationWarning" not in out.output
    lines = [line for line in out.stderr.splitlines() if "calibration" in line]
    assert lines == [f"warning: calibration file {bad} ignored: not JSON (Expecting property name enclosed in "
                     "double quotes at line 1, column 2); using the cpu-local defaults (rerun graphrl calibrate)"]


def test_gloo_p2p_measurement_between_two_processes():
    bandwidth, latency = p2p_bandwidth_latency(sizes=(4, 1 << 16))
    assert bandwidth > 0 and 0 < latency < 1.0


# -- the host model fit ------------------------------------------------------------------------------

def _grid(truth: HardwareSpec) -> list[Probe]:
    """Probes timed exactly as the timing model says `truth` would run them: every phase at two widths, two
    depths and two batches, and training also on two ranks side by side. Each unknown needs its own
    variation: depth separates the per-layer from the per-pass overheads, the batch the per-token ones, the
    width the elementwise bytes from both, and two ranks the data-parallel layer overhead."""
    tiny = MODEL_PRESETS["tiny-digits"]
    probes = []
    for phase, width, layers, batch, ranks in itertools.product(
            ("generate", "forward", "train"), (64, 128), (1, 4), (8, 128), (1, 2)):
        if ranks > 1 and phase != "train":
            continue
        dims = tiny.model_copy(update=dict(hidden_size=width, intermediate_size=width * 11 // 4, num_layers=layers))
        p = Probe(phase, dims, batch, 6, 5, 1.0, ranks=ranks)
        probes.append(dataclasses.replace(p, seconds=predicted_probe_s(p, truth)))
    return probes


HOST_UNKNOWNS = HOST_FIELDS + ("elementwise_bandwidth", "backward_elementwise_bandwidth")
# What the fit takes as known: the roofline (or measured matmuls, below), the preset's links; no host time.
BASE = HARDWARE_PRESETS["cpu-local"].model_copy(update={name: 0.0 for name in HOST_FIELDS})
TRUTH_HOST = dict(layer_overhead_s=300e-6, pass_overhead_s=450e-6, decode_token_overhead_s=2e-6,
                  train_layer_overhead_s=1.5e-3, train_pass_overhead_s=2e-3, data_parallel_layer_overhead_s=400e-6,
                  elementwise_bandwidth=3e9, backward_elementwise_bandwidth=1e9)
# A base that measured the probe model's vocabulary work, its optimizer step and one of its matmul shapes.
MEASURED = BASE.model_copy(update=dict(
    optimizer_param_s=3e-9,
    vocab=(VocabCost(vocab_size=16, generate=1e-9, forward=2e-9, train=5e-9),),
    matmuls=(MatmulFit(k=64, n=64, dtype_bytes=4, threads=1, rows=(1, 64, 1024), seconds=(2e-6, 1e-5, 1e-4)),),
))


@pytest.mark.parametrize("base", [BASE, MEASURED], ids=["roofline", "measured"])
def test_host_fit_recovers_the_description_that_made_the_timings(base: HardwareSpec):
    """Timings made by the timing model from known overheads and elementwise rates must give back exactly
    those eight figures: a basis that disagreed with the prediction functions fails here. Two did: without a
    measured optimizer step its elementwise bytes were in no basis (the fit put them on the training
    overheads, twice the true per-layer one), and a measured vocabulary's work was counted twice, as known
    time and again as elementwise bytes of the forward rate's basis."""
    truth = base.model_copy(update=TRUTH_HOST)
    fitted = fit_host_model(_grid(truth), base)
    for name in HOST_UNKNOWNS:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    # Everything the fit takes as known is left as it was.
    assert fitted.model_copy(update={name: getattr(base, name) for name in HOST_UNKNOWNS}) == base


def test_host_fit_stays_nonnegative_on_noisy_timings():
    """Noise must not buy a better fit with a negative overhead (which would make large models cheaper
    than small ones); the fitted model still reproduces the timings closely. With this noise an unconstrained
    least-squares fit gives negative pass and data-parallel layer overheads (-1.9 µs and -233 µs)."""
    truth = BASE.model_copy(update=dict(TRUTH_HOST, pass_overhead_s=0.0, data_parallel_layer_overhead_s=0.0))
    rng = random.Random(3)
    probes = [dataclasses.replace(p, seconds=p.seconds * rng.uniform(0.93, 1.07)) for p in _grid(truth)]
    fitted = fit_host_model(probes, BASE)
    assert all(getattr(fitted, name) >= 0.0 for name in HOST_UNKNOWNS)
    for p in probes:
        assert predicted_probe_s(p, fitted) == pytest.approx(p.seconds, rel=0.15)


# -- collectives -------------------------------------------------------------------------------------

def test_collective_fit_reproduces_the_measurement_in_the_timing_model():
    """A fit from {bytes: seconds} must make timing.collective_time return those seconds again."""
    times = {1024: 400e-6, 4 << 20: 9e-3}
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        for n in (2, 3, 4):
            fit = fit_collective(kind, n, times)
            hw = BASE.model_copy(update=dict(collectives=(fit,)))
            for size, seconds in times.items():
                assert timing.collective_time(kind, size, n, hw, spans_nodes=False) == pytest.approx(seconds, rel=1e-9)


def test_collective_time_uses_the_nearest_measured_group_size():
    fit2 = CollectiveFit(kind="all_reduce", group_size=2, bus_bandwidth=1e9, latency_s=1e-4)
    fit4 = CollectiveFit(kind="all_reduce", group_size=4, bus_bandwidth=4e9, latency_s=1e-5)
    hw = BASE.model_copy(update=dict(collectives=(fit2, fit4)))
    assert timing.measured_collective(hw, "all_reduce", 3) is fit2
    assert timing.measured_collective(hw, "all_reduce", 8) is fit4
    assert timing.measured_collective(hw, "all_gather", 2) is None
    ring = 2 * 7 * (1e6 / (8 * 4e9) + 1e-5)
    assert timing.collective_time("all_reduce", 1e6, 8, hw, spans_nodes=False) == pytest.approx(ring)
    # Across nodes, and for kinds never measured, the link figures apply.
    plain = BASE.model_copy(update=dict(collectives=()))
    assert timing.collective_time("all_reduce", 1e6, 8, hw, True) == timing.collective_time("all_reduce", 1e6, 8, plain, True)
    assert timing.collective_time("all_gather", 1e6, 2, hw, False) == timing.collective_time("all_gather", 1e6, 2, plain, False)


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
        spawn(2, _fail_on_rank_one, timeout_s=120)


def test_a_job_model_is_probed_at_its_own_depth_up_to_six_layers():
    """Two depths where the model has them, the deeper one the model's own depth up to six layers (a layer
    deep in a stack costs less than one in a one-layer model), the shallower half of it."""
    assert job_probe_layers(30) == (3, 6)
    assert job_probe_layers(6) == (3, 6)
    assert job_probe_layers(4) == (2, 4)
    assert job_probe_layers(2) == (1, 2)
    assert job_probe_layers(1) == (1,)


def test_long_probe_calls_are_timed_only_in_rounds(monkeypatch):
    """A phase whose first call takes LONG_CALL_S or more skips its loop of back-to-back calls; a short one
    runs it. Every phase takes part in the rounds that call them in turn."""
    first = {"long": LONG_CALL_S * 2, "short": LONG_CALL_S / 10}
    monkeypatch.setattr(harness, "timed_once", lambda fn: first[fn()])
    calls = {"long": 0, "short": 0}

    def phase(name):
        def call():
            calls[name] += 1
            return name
        return call

    times = phase_times({"long": phase("long"), "short": phase("short")})
    assert set(times) == {"long", "short"} and all(t >= 0 for t in times.values())
    rounds = 9
    assert calls["long"] == 1 + rounds  # its warm-up, then the rounds only
    assert calls["short"] > 1 + rounds + 5  # also its own loop: a warm-up, the loop's sizing, five timed loops


# -- the machine's speed after a run, against its calibration ---------------------------------------------


def test_machine_speed_times_the_calibrations_largest_matmul_again():
    """The calibration's matmul with the most work per call is timed again as it was measured; its ratio
    compares the calibrated seconds with now's (above 1: faster now). A preset measured nothing: None."""
    from graphrl.calibration import machine_speed

    assert machine_speed(HARDWARE_PRESETS["cpu-local"]) is None
    small = MatmulFit(k=64, n=64, dtype_bytes=4, threads=1, rows=(1, 8), seconds=(1e-6, 2e-6))
    large = MatmulFit(k=128, n=96, dtype_bytes=4, threads=1, rows=(1, 16), seconds=(1e-6, 1.0))  # a very slow past
    speed = machine_speed(CALIBRATED.model_copy(update=dict(matmuls=(small, large))))
    assert speed is not None
    assert (speed["k"], speed["n"], speed["rows"], speed["threads"]) == (128, 96, 16, 1)
    assert speed["calibrated_s"] == 1.0 and 0 < speed["measured_s"] < 1.0
    assert speed["ratio"] == pytest.approx(1.0 / speed["measured_s"]) and speed["ratio"] > 1


def test_a_run_on_a_calibrated_machine_says_and_keeps_its_speed_against_the_calibration(tmp_path, monkeypatch):
    """`graphrl run` on a calibrated machine times one of the calibration's matmuls after the run, says the
    ratio beside the prediction's error and writes it to the run folder, where `graphrl report` shows it;
    a run on the preset writes none, and removes an earlier run's file from the folder."""
    from graphrl.report import MACHINE_SPEED_FILE, build_report

    fit = MatmulFit(k=64, n=64, dtype_bytes=4, threads=1, rows=(1, 8), seconds=(1e-6, 2e-6))
    path = _calibration_file(tmp_path, matmuls=[fit.model_dump()])
    monkeypatch.setenv("GRAPHRL_CALIBRATION", str(path))
    job = str(Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny.yaml")
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["run", job, "--steps", "3", "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert "machine speed" in result.output and "its calibration's" in result.output
    saved = json.loads((out / MACHINE_SPEED_FILE).read_text())
    assert saved["calibrated_s"] == 2e-6 and saved["ratio"] > 0
    report = build_report(out)
    assert report.data["summary"]["machine_speed"] == pytest.approx(saved["ratio"])
    assert "machine speed against its calibration" in CliRunner().invoke(main, ["report", str(out), "--format", "text"]).output
    monkeypatch.setenv("GRAPHRL_CALIBRATION", "none")
    again = CliRunner().invoke(main, ["run", job, "--steps", "2", "--out", str(out), "--overwrite", "-q"])
    assert again.exit_code == 0, again.output
    assert "machine speed" not in again.output and not (out / MACHINE_SPEED_FILE).exists()
    assert build_report(out).data["summary"]["machine_speed"] is None


def test_a_machine_speed_file_that_cannot_be_read_is_a_note(tmp_path):
    from graphrl.report import read_machine_speed

    notes: list[str] = []
    bad = tmp_path / "machine_speed.json"
    bad.write_text("{not json")
    assert read_machine_speed(bad, notes) is None and "cannot be read" in notes[0]
    bad.write_text(json.dumps({"ratio": -1}))
    assert read_machine_speed(bad, notes) is None and len(notes) == 2
    assert read_machine_speed(tmp_path / "absent.json", notes) is None and len(notes) == 2
