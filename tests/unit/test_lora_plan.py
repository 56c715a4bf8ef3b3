"""LoRA in the plan: the reference initialised from a LoRA policy is its base (no role, no weights; its log-probs
run on the policy's trainer), the trainer charges gradients and optimizer state for the adapters alone, a weight
sync moves the adapters alone, the preview sets each figure beside full training, a 70B job fits on fewer
devices than full training needs, the layouts the executors do not run with adapters are refused by field, and a
weight sync that did not deliver the adapters is found by the generator's probe log-probs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from graphrl.compiler.compile import compile_job
from graphrl.compiler.preview import render_html, render_text
from graphrl.errors import GraphRLError, RunError
from graphrl.executors.models.llama import Llama
from graphrl.executors.models.lora import adapt, adapter_state
from graphrl.executors.weightsync import check_delivery
from graphrl.loader import apply_overrides, job_cluster, load_job, parse_override
from graphrl.schemas.capabilities import plan_refusals
from graphrl.schemas.model import MODEL_PRESETS, LoraSpec
from graphrl.schemas.program import Logprob
from graphrl.schemas.sharding import is_adapter, llama_param_count, lora_param_count, lora_params

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _compile(example: str, *sets: str, cluster: str | None = None, target: str = "preview"):  # noqa: ANN202
    job = apply_overrides(load_job(EXAMPLES / example), [parse_override(s) for s in sets])
    return compile_job(job, job_cluster(job, cluster), target=target, steps=2)


def test_the_reference_is_the_base_on_the_policys_trainer() -> None:
    plan = _compile("grpo_lora_tiny.yaml")
    assert [p.role for p in plan.chosen.placements] == ["policy", "policy/generate"]
    assert plan.bindings.bases == {"reference": "policy"}
    logprobs = [ins for rank in range(2) for ins in plan.programs.rank_stream(rank) if isinstance(ins, Logprob)]
    assert logprobs and {ins.role for ins in logprobs} == {"policy"} and {ins.node for ins in logprobs} == {"ref_logprobs"}
    # an explicit separate reference keeps its own copy
    separate = _compile("grpo_lora_tiny.yaml", "models.policy.lora.base_reference=false")
    assert "reference" in [p.role for p in separate.chosen.placements] and separate.bindings.bases == {}


def test_trainer_state_and_sync_are_the_adapters() -> None:
    lora, full = (_compile("grpo_lora_tiny.yaml", "placement.strategy=disaggregated", *extra)
                  for extra in ((), ("models.policy.lora=null",)))
    dims, spec = MODEL_PRESETS["tiny-digits-tied"], LoraSpec(rank=8, alpha=16)
    adapters = lora_param_count(dims, spec)
    train = {p.model: p for p in lora.chosen.placements if p.kind == "train"}["policy"]
    full_train = {p.role: p for p in full.chosen.placements}["policy"]
    assert train.memory_bytes.grads == pytest.approx(adapters * 4)  # float32 gradients of the adapters alone
    assert train.memory_bytes.optimizer == pytest.approx(adapters * 8)  # AdamW's two moments
    assert train.memory_bytes.params == pytest.approx(full_train.memory_bytes.params + adapters * 4)
    record = next(iter(lora.programs.weight_syncs.values()))
    assert sorted(record.params) == sorted(p.name for p in lora_params(dims, spec))
    full_record = next(iter(full.programs.weight_syncs.values()))
    assert record.summary.total_bytes < full_record.summary.total_bytes / 3
    sync = next(op for op in lora.chosen.operations if op.kind == "weight_sync")
    assert sync.num_bytes == record.summary.total_bytes


def test_a_merged_sync_sends_the_weights_to_a_plain_generator_a_staging_group_at_a_time() -> None:
    merged = _compile("grpo_lora_tiny.yaml", "placement.strategy=disaggregated", "models.policy.lora.sync=merged")
    record = next(iter(merged.programs.weight_syncs.values()))
    dims = MODEL_PRESETS["tiny-digits-tied"]
    assert not any(is_adapter(name) for name in record.params) and record.staging_layers >= 1
    generator = next(p for p in merged.chosen.placements if p.kind == "generate")
    assert generator.memory_bytes.params == pytest.approx(llama_param_count(dims) * 4)  # no adapters held
    fp8 = _compile("grpo_lora_tiny.yaml", "models.policy.lora.sync=merged", "placement.roles.policy/generate.precision=fp8")
    assert not plan_refusals(fp8)


def test_merging_adapters_into_weights_gives_the_adapted_model() -> None:
    from graphrl.executors.models.lora import generator_version, merged_shards, merged_state, merged_weights

    dims, lora = MODEL_PRESETS["tiny-digits-qwen2"], LoraSpec(rank=4, sync="merged")
    model = adapt(Llama(dims), dims, lora, seed=2)
    with torch.no_grad():
        for p in adapter_state(model).values():
            p.normal_(0, 0.2)
    want = merged_state(model)
    assert dict(merged_weights(model.state_dict().items(), model)).keys() == want.keys()
    assert all(torch.allclose(t, want[k]) for k, t in merged_weights(model.state_dict().items(), model))
    assert all(torch.allclose(t, want[k]) for k, t in merged_shards(model).items())
    assert all(torch.allclose(t, want[k]) for k, t in generator_version(dict(model.state_dict()), lora).items())
    assert set(generator_version(dict(model.state_dict()), LoraSpec(rank=4))) == set(adapter_state(model))


def test_the_preview_sets_lora_beside_full_training_and_70b_fits_where_full_does_not() -> None:
    lora = _compile("llama3_70b.yaml", "models.policy.lora.rank=32", cluster=str(EXAMPLES / "clusters" / "h100_8.yaml"))
    figures = {f.what: f for f in lora.lora.figures}
    assert figures["trainer optimizer state"].lora < figures["trainer optimizer state"].full / 100
    assert figures["reference weights"].lora == 0 < figures["reference weights"].full
    assert figures["weight sync bytes per step (all replicas)"].lora < figures["weight sync bytes per step (all replicas)"].full / 100
    assert figures["training seconds per step"].lora < figures["training seconds per step"].full
    assert figures["trainer activations"].lora == figures["trainer activations"].full
    assert not lora.lora.full_fits and lora.lora.base_reference == ["reference"]
    text = render_text(lora)
    assert "LoRA rank 32 beside full training" in text and "does not fit" in text
    page = render_html(lora)
    assert "LoRA rank 32 beside full training" in page and "trainer optimizer state" in page
    with pytest.raises(GraphRLError, match="no layout fits"):
        _compile("llama3_70b.yaml", cluster=str(EXAMPLES / "clusters" / "h100_8.yaml"))
    assert _compile("llama3_70b.yaml").lora is None


@pytest.mark.parametrize(("example", "sets", "field", "message"), [
    ("grpo_lora_tiny.yaml", ("models.reference.lora.rank=4",), "models.reference.lora", "no train node trains it"),
    ("ppo_tiny.yaml", ("models.critic.lora.rank=4",), "models.critic.lora", "is a critic"),
    ("grpo_lora_tiny.yaml", ("placement.roles.policy/generate.precision=fp8",), "precision", "adapters wrap"),
])
def test_bad_lora_declarations_are_refused_by_field(example: str, sets: tuple[str, ...], field: str,
                                                    message: str) -> None:
    with pytest.raises(GraphRLError, match=message) as caught:
        _compile(example, *sets)
    assert field in ".".join(caught.value.path)


def test_a_tensor_parallel_lora_trainer_and_a_vllm_generator_are_planned_to_run() -> None:
    plan = _compile("llama3_8b.yaml", "models.policy.lora.rank=16", "placement.roles.policy.tp=2",
                    "placement.roles.policy/generate.engine=vllm")
    policy = next(p for p in plan.chosen.placements if p.role == "policy")
    generator = next(p for p in plan.chosen.placements if p.kind == "generate")
    assert policy.tp == 2 and generator.engine == "vllm" and generator.precision != "fp8"
    assert not plan_refusals(plan)


@pytest.fixture(scope="module")
def one_rank_group():  # noqa: ANN201
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29871", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_sync_that_left_the_adapters_behind_is_an_error(one_rank_group: None) -> None:
    dims, lora = MODEL_PRESETS["tiny-digits-qwen2"], LoraSpec(rank=4)
    torch.manual_seed(0)
    trainer = adapt(Llama(dims), dims, lora, seed=1)
    generator = Llama(dims)
    generator.load_state_dict({k: v for k, v in trainer.state_dict().items() if not is_adapter(k)})
    adapt(generator, dims, lora, seed=1)
    with torch.no_grad():
        for p in adapter_state(trainer).values():
            p.normal_(0, 0.3)
    record = SimpleNamespace(model="policy", src=SimpleNamespace(devices=(0,)), dst=SimpleNamespace(devices=(0,)))
    runtime = SimpleNamespace(comm_device=torch.device("cpu"))
    with pytest.raises(RunError, match="does not sample from the weights the trainer synced"):
        check_delivery(record, 0, trainer, generator, 3, runtime)
    generator.load_state_dict(adapter_state(trainer), strict=False)
    check_delivery(record, 0, trainer, generator, 3, runtime)
