"""Placement search: fits, pins, baseline, determinism and the errors a user gets."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from graphrl.cli import main
from graphrl.compiler.compile import compile_job
from graphrl.errors import PlacementError
from graphrl.loader import apply_overrides, job_cluster, load_job, load_job_text, parse_override

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def compile_example(name: str, cluster: str | None = None, **options):
    """Compile with a short unrolling: these tests look at placement, not at the programs."""
    job = load_job(EXAMPLES / name)
    return compile_job(job, job_cluster(job, cluster), **{"steps": 4, **options})


def test_405b_is_disaggregated_fits_and_beats_colocated_baseline():
    plan = compile_example("llama3_405b.yaml")
    assert plan.chosen.strategy == "disaggregated"
    for dm in plan.chosen.device_memory:
        assert dm.peak_bytes <= dm.capacity_bytes
    assert plan.baseline is not None and plan.baseline.strategy == "colocated"
    assert plan.baseline.estimate.mode == "sync"
    # DeepSpeed-Chat-like baseline generates in bf16.
    gen = [p for p in plan.baseline.placements if p.kind == "generate"]
    assert gen and gen[0].precision == "bf16"
    assert plan.baseline.estimate.step_time_s > plan.chosen.estimate.step_time_s


def test_same_job_same_plan():
    a = compile_example("llama3_8b.yaml")
    b = compile_example("llama3_8b.yaml")
    assert a == b


def test_colocated_memory_includes_every_role_on_the_device():
    plan = compile_example("ppo_tiny.yaml")
    assert plan.chosen.strategy == "colocated"
    (dm,) = plan.chosen.device_memory
    assert set(dm.roles) == {"policy", "critic", "reference", "reward_model", "policy/generate"}


def test_json_preview_has_documented_keys():
    out = CliRunner().invoke(main, ["compile", str(EXAMPLES / "llama3_70b.yaml"), "--plan", "--format", "json", "--steps", "2"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    for key in ("meshes", "placements", "step_time_s", "baseline", "candidates_considered"):
        assert key in data
    assert {"name", "devices", "axes"} <= set(data["meshes"][0])
    placement = data["placements"][0]
    for key in ("model", "role", "mesh", "parallel", "sharding", "precision", "memory_bytes", "capacity_bytes"):
        assert key in placement
    assert set(placement["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "kv_cache", "gathered",
                                            "engine_weights", "total"}
    assert data["baseline"]["step_time_s"] > 0
    assert data["candidates_considered"] > 100


def test_pinned_devices_are_honoured():
    plan = compile_example("aipo_async_tiny.yaml")
    meshes = {m.name: m for m in plan.chosen.meshes}
    assert list(meshes["generator"].devices) == [0]
    assert list(meshes["trainer"].devices) == [1]
    assert plan.chosen.estimate.mode == "async"


def _job_with(placement: str, cluster: str = "local-cpu-2", preset: str = "tiny-digits") -> str:
    text = (EXAMPLES / "grpo_tiny.yaml").read_text()
    text = text.replace("preset: tiny-digits", f"preset: {preset}").replace("cluster: local-cpu-2", f"cluster: {cluster}")
    return text + "\n" + textwrap.dedent(placement)


@pytest.mark.parametrize("placement, field, words", [
    ("placement:\n  roles:\n    policy: {tp: 3}\n", "placement.roles.policy.tp", "does not divide"),
    ("placement:\n  roles:\n    policy: {devices: '0-7'}\n", "placement.roles.policy.devices", "outside the cluster"),
    ("placement:\n  roles:\n    policy: {pp: 5}\n", "placement.roles.policy.pp", "larger than the 2 layers"),
    ("placement:\n  roles:\n    critic: {tp: 1}\n", "placement.roles.critic", "unknown role"),
    ("placement:\n  roles:\n    policy: {precision: fp8}\n", "placement.roles.policy.precision", "only generation"),
])
def test_impossible_pins_name_the_field(tmp_path, placement, field, words):
    path = tmp_path / "job.yaml"
    path.write_text(_job_with(placement))
    out = CliRunner().invoke(main, ["compile", str(path), "--plan"])
    assert out.exit_code == 2
    assert "Traceback" not in out.output
    assert field in out.output and words in out.output
    assert f"{path}:" in out.output  # located in the file


def test_fp8_pin_on_hardware_without_fp8_names_the_field(tmp_path):
    (tmp_path / "a100.yaml").write_text("name: a100-2\nnum_nodes: 1\ndevices_per_node: 2\nhardware: a100-sxm-80gb\n")
    path = tmp_path / "job.yaml"
    path.write_text(_job_with("placement:\n  roles:\n    policy/generate: {precision: fp8}\n", cluster="a100.yaml"))
    out = CliRunner().invoke(main, ["compile", str(path), "--plan"])
    assert out.exit_code == 2, out.output
    assert "placement.roles.policy/generate.precision" in out.output and "no fp8" in out.output


def test_cpu_runs_fp8_generation_only_when_pinned():
    """cpu-local dequantizes fp8 at use, so fp8 saves memory there but no time: the search keeps the
    unquantized generator, and a pin gets an fp8 generator charged less weight memory than a copy at the
    model's dtype. (Colocated beside grpo_tiny's trainer, whose weights are whole on each rank, the unquantized generator samples from the
    trainer's own weights and is charged none of its own.)"""
    plain = compile_example("grpo_tiny.yaml")
    job = apply_overrides(load_job(EXAMPLES / "grpo_tiny.yaml"),
                          [parse_override("placement.roles.policy/generate.precision=fp8")])
    pinned = compile_job(job, job_cluster(job, None), steps=4)
    gen = {p.role: p for p in plain.chosen.placements}["policy/generate"]
    gen_fp8 = {p.role: p for p in pinned.chosen.placements}["policy/generate"]
    assert gen.precision == "bf16" and gen_fp8.precision == "fp8"
    trainer = {p.role: p for p in plain.chosen.placements}["policy"]
    assert plain.chosen.strategy == "colocated" and trainer.sharding in ("none", "zero1")
    assert gen.memory_bytes.params == 0.0
    assert 0 < gen_fp8.memory_bytes.params < 0.6 * trainer.memory_bytes.params
    assert pinned.chosen.estimate.step_time_s >= plain.chosen.estimate.step_time_s


def test_job_that_fits_nowhere_names_role_bytes_and_fix(tmp_path):
    text = (EXAMPLES / "llama3_405b.yaml").read_text().replace("clusters/h100_1024.yaml", "clusters/h100_64.yaml")
    path = tmp_path / "big.yaml"
    path.write_text(text)
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "h100_64.yaml").write_text((EXAMPLES / "clusters" / "h100_64.yaml").read_text())
    out = CliRunner().invoke(main, ["compile", str(path), "--plan"])
    assert out.exit_code == 2, out.output
    assert "no layout fits" in out.output
    assert "GB per device" in out.output and "available" in out.output
    assert "fix: try more devices" in out.output


def test_exhaustive_and_beam_agree_on_small_cluster():
    beam = compile_example("llama3_8b.yaml", str(EXAMPLES / "clusters" / "h200_8.yaml"))
    full = compile_example("llama3_8b.yaml", str(EXAMPLES / "clusters" / "h200_8.yaml"), exhaustive=True)
    assert full.candidates_considered >= beam.candidates_considered
    assert beam.chosen.estimate.step_time_s <= full.chosen.estimate.step_time_s * 1.02


def test_explain_lists_rejections():
    out = CliRunner().invoke(main, ["compile", str(EXAMPLES / "llama3_405b.yaml"), "--plan", "--explain", "--steps", "2"])
    assert out.exit_code == 0, out.output
    assert "rejected:" in out.output and "GB per device" in out.output
    assert "speed-up" in out.output


def test_html_is_self_contained(tmp_path):
    out_file = tmp_path / "plan.html"
    out = CliRunner().invoke(main, ["compile", str(EXAMPLES / "llama3_8b.yaml"), "--format", "html", "-o", str(out_file)])
    assert out.exit_code == 0, out.output
    html = out_file.read_text()
    assert html.startswith("<!doctype html>") and "<svg" in html
    for external in ("<script src", "<link ", "http://", "https://", "@import"):
        assert external not in html


def test_compile_accepts_cluster_override():
    plan = compile_example("grpo_tiny.yaml", "local-cpu-4")
    assert plan.cluster.num_devices == 4
    assert sum(m.num_devices for m in plan.chosen.meshes if m.name != "generator" or plan.chosen.strategy == "disaggregated") >= 4


def test_unknown_cluster_is_a_located_error():
    job = load_job_text((EXAMPLES / "grpo_tiny.yaml").read_text().replace("local-cpu-2", "nowhere-7"), "job.yaml")
    with pytest.raises(Exception) as info:
        job_cluster(job, None)
    assert "nowhere-7" in str(info.value) and "job.yaml" in str(info.value)


def test_placement_error_type():
    assert issubclass(PlacementError, Exception)


def test_an_fsdp_trainer_as_wide_as_its_colocated_tp_generator_gathers_only_the_tensors_cut_differently():
    """fsdp=n beside tp=n on the same n devices: each device already holds its tp shard of every matrix
    (`fsdp_shard_dim`), so the in-place reshard gathers the norms, plus the row-parallel weights whose
    columns do not split evenly; the executor's DDMA plan moves the same tensors and nothing else."""
    from graphrl.compiler.cost import unaligned_tp_shards
    from graphrl.compiler.weight_sync import ddma_record
    from graphrl.schemas.hardware import HARDWARE_PRESETS
    from graphrl.schemas.mesh import Mesh
    from graphrl.schemas.model import ModelDims

    dims = ModelDims(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=4)
    norms = 2 * dims.num_layers + 1
    assert unaligned_tp_shards(dims, 2) == (norms * 64 * 2, norms)
    odd = dims.model_copy(update={"intermediate_size": 90})  # 90 columns of down_proj do not split 4 ways
    assert unaligned_tp_shards(odd, 4) == (norms * 64 * 2 + dims.num_layers * 64 * 23 * 2, norms + dims.num_layers)
    for d, tp in ((dims, 2), (odd, 4)):
        src = Mesh.contiguous([("dp", 1), ("fsdp", tp), ("tp", 1), ("pp", 1)], 0)
        dst = Mesh.contiguous([("dp", 1), ("fsdp", 1), ("tp", tp), ("pp", 1)], 0)
        record, _ = ddma_record(d, "policy", HARDWARE_PRESETS["h100-sxm-80gb"], 8, src, dst, "bf16")
        moved = {s.param.split(".")[-2] for b in record.buckets() for s in b.slices}
        assert moved == {"input_layernorm", "post_attention_layernorm", "norm"} | ({"down_proj"} if tp == 4 else set())


def test_a_colocated_generator_as_wide_as_an_fsdp_trainer_reshards_for_less_than_a_gather():
    from graphrl.compiler.hardware import resolve_hardware
    from graphrl.compiler.typecheck import typecheck
    from graphrl.compiler.candidates import GenCfg, TrainCfg, make_problem
    from graphrl.compiler.cost import reshard_in_place_time, unaligned_tp_shards
    from graphrl.ir import build_graph

    job = load_job(EXAMPLES / "grpo_tiny.yaml")
    cluster = job_cluster(job, "local-cpu-2")
    hw = resolve_hardware(cluster)
    problem = make_problem(typecheck(build_graph(job.spec), cluster), cluster, hw)
    fsdp2 = TrainCfg(0, 2, 1, 2, 1, 1, "fsdp", False, False)
    aligned_s, aligned_bytes = reshard_in_place_time(problem, fsdp2, GenCfg(0, 2, 2, "bf16"))
    assert aligned_bytes == unaligned_tp_shards(problem.policy.dims, 2)[0] > 0
    hsdp = TrainCfg(0, 2, 2, 1, 1, 1, "fsdp", False, False)  # dp2 x fsdp1: no device holds a tp shard
    gather_s, gather_bytes = reshard_in_place_time(problem, hsdp, GenCfg(0, 2, 2, "bf16"))
    assert 0 < aligned_s < gather_s and aligned_bytes < gather_bytes


def test_an_fp8_generators_weight_sync_staging_is_charged():
    """A DDMA sync into an fp8 generator receives its block linears at the trainer's dtype before
    quantizing them (`executors.fp8.staging_tensors`), one staging group of layers at a time: the
    generator mesh's peak holds its weights and one group's staging, and the stored sync runs in those
    groups; a colocated tp-1 generator quantizes tensor by tensor and stages nothing."""
    from graphrl.compiler import cost
    from graphrl.schemas.model import MODEL_PRESETS
    from graphrl.schemas.sharding import staging_layers

    plan = compile_example("llama3_70b.yaml")
    (gen,) = [p for p in plan.chosen.placements if p.kind == "generate"]
    assert plan.chosen.strategy == "disaggregated" and gen.precision == "fp8"
    dims = MODEL_PRESETS["llama3-70b"]
    layers = staging_layers(dims, gen.tp)
    assert 1 <= layers < dims.num_layers
    staging = cost.layer_linear_params(dims) * layers / gen.tp * 2
    (mesh,) = [dm for dm in plan.chosen.device_memory if dm.mesh == "generator"]
    assert gen.memory_bytes.params + staging <= mesh.peak_bytes
    (sync,) = [op for op in plan.chosen.operations if op.kind == "weight_sync"]
    assert f"{staging / 2**30:.2f} GiB staged per device" in sync.detail
    (record,) = plan.programs.weight_syncs.values()
    assert record.staging_layers == layers and len(record.group_rounds) == -(-dims.num_layers // layers)
    job = apply_overrides(load_job(EXAMPLES / "grpo_tiny.yaml"),
                          [parse_override("placement.roles.policy/generate.precision=fp8")])
    tiny = compile_job(job, job_cluster(job, None), steps=4)
    tiny_gen = {p.role: p for p in tiny.chosen.placements}["policy/generate"]
    assert tiny.chosen.strategy == "colocated" and tiny_gen.tp == 1
    (dm,) = tiny.chosen.device_memory
    assert dm.peak_bytes == max(dm.peak_bytes, tiny_gen.memory_bytes.params)  # nothing staged beside it


def test_an_fp8_generator_whose_sync_staging_does_not_fit_is_refused_with_the_reason():
    """405B on 8-way tp: fp8 weights fit an H100, but the bf16 staging of a DDMA sync beside them does not."""
    job = apply_overrides(load_job(EXAMPLES / "llama3_405b.yaml"),
                          [parse_override(s) for s in (
                              "placement.roles.policy/generate.precision=fp8", "placement.roles.policy/generate.tp=8",
                              "placement.strategy=disaggregated", "placement.roles.policy.fsdp=20",
                              "placement.roles.policy.tp=8", "placement.roles.policy.sharding=fsdp")])
    with pytest.raises(PlacementError, match="weight sync stages"):
        compile_job(job, job_cluster(job, None), steps=4)
