"""`graphrl calibrate` writes a hardware file that the cpu-local preset then uses."""

from __future__ import annotations

from click.testing import CliRunner

from graphrl.calibrate import p2p_bandwidth_latency
from graphrl.cli import main
from graphrl.compiler.hardware import resolve_hardware
from graphrl.schemas.cluster import CLUSTER_PRESETS
from graphrl.schemas.hardware import HARDWARE_PRESETS, HardwareSpec


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
