"""LoRA adapters checked against the PEFT library's: the same base and adapter values give the same logits and
the same adapter gradients (fp32), for each family; switching them off gives the base; a merged copy is
the adapted model; the inventory names what the modules hold; bad declarations are refused by field."""

from __future__ import annotations

import pytest
import torch

from graphrl.executors.models.llama import Llama
from graphrl.executors.models.lora import adapter_state, adapters_off, adapt, merged_state
from graphrl.models import from_pretrained
from graphrl.schemas.model import MODEL_PRESETS, LoraSpec, ModelSpec
from graphrl.schemas.sharding import lora_param_count, lora_params
from test_families import REL_TOL, _relative, hf_model

peft = pytest.importorskip("peft")

TARGETS = {"all-linear": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "attention": ["q_proj", "v_proj"]}


def _pair(tmp_path, family: str, lora: LoraSpec, *, seed: int = 0):  # noqa: ANN202
    """(ours, PEFT's) on the same random base, with the same random adapters (B drawn too, not zero)."""
    hf = hf_model(family, tie=family == "qwen2", seed=seed)
    hf.save_pretrained(tmp_path)
    ours, _ = from_pretrained(tmp_path)
    adapt(ours, ours.dims, lora, seed=seed)
    targets = TARGETS["all-linear"] if lora.targets == "all-linear" else list(lora.targets)
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha or 2 * lora.rank, lora_dropout=0.0,
                             target_modules=targets)
    theirs = peft.get_peft_model(hf, config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in adapter_state(ours).items():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            theirs.get_parameter(f"base_model.model.{name.replace('.weight', '.default.weight')}").copy_(p)
    return ours, theirs


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("targets", ["all-linear", "attention"])
def test_forward_and_adapter_gradients_equal_peft(tmp_path, family: str, targets: str) -> None:
    lora = LoraSpec(rank=4, alpha=8.0, targets="all-linear" if targets == "all-linear" else TARGETS[targets])
    ours, theirs = _pair(tmp_path, family, lora)
    ids = torch.randint(3, 48, (2, 24), generator=torch.Generator().manual_seed(3))
    got, want = ours(ids), theirs(input_ids=ids).logits
    assert _relative(got, want) <= REL_TOL
    got.float().logsumexp(-1).sum().backward()
    want.float().logsumexp(-1).sum().backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert sorted(grads) == sorted(p.name for p in lora_params(ours.dims, lora))
    for name, grad in grads.items():
        ref = theirs.get_parameter(f"base_model.model.{name.replace('.weight', '.default.weight')}").grad
        assert _relative(grad, ref) <= REL_TOL, name
    assert all(p.grad is None for n, p in ours.named_parameters() if not p.requires_grad)
    with torch.no_grad(), adapters_off(ours), theirs.disable_adapter():
        assert _relative(ours(ids), theirs(input_ids=ids).logits) <= REL_TOL


def test_a_new_adapter_is_the_base_and_a_merged_copy_is_the_adapted_model() -> None:
    dims = MODEL_PRESETS["tiny-digits-qwen3"]
    torch.manual_seed(0)
    base = Llama(dims)
    model = adapt(Llama(dims), dims, LoraSpec(rank=2), seed=5)
    model.load_state_dict(base.state_dict(), strict=False)
    ids = torch.randint(0, dims.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))  # B starts at zero
        for p in adapter_state(model).values():
            p.normal_(0, 0.2)
        merged = Llama(dims)
        merged.load_state_dict(merged_state(model))
        assert _relative(merged(ids), model(ids)) <= REL_TOL
        assert not torch.equal(model(ids), base(ids))
    again = adapt(Llama(dims), dims, LoraSpec(rank=2), seed=5)
    assert all(torch.equal(again.get_parameter(n), p) for n, p in adapter_state(adapt(Llama(dims), dims,
                                                                                     LoraSpec(rank=2), seed=5)).items())


def test_inventory_counts_what_the_modules_hold() -> None:
    for preset in ("tiny-digits", "tiny-digits-qwen2", "tiny-digits-moe", "llama3-8b"):
        dims = MODEL_PRESETS[preset]
        lora = LoraSpec(rank=8, targets=["q_proj", "down_proj"] if preset == "tiny-digits" else "all-linear")
        if preset == "llama3-8b":  # 83,886,080 adapter parameters at rank 32 on every linear, as published
            assert lora_param_count(dims, LoraSpec(rank=32)) == 83_886_080
            continue
        model = adapt(Llama(dims, device="meta"), dims, lora)
        held = {n: tuple(p.shape) for n, p in adapter_state(model).items()}
        assert held == {p.name: p.shape for p in lora_params(dims, lora)}
        assert lora_param_count(dims, lora) == sum(p.numel() for p in adapter_state(model).values())
        assert all(p.requires_grad == (n in held) for n, p in model.named_parameters())


@pytest.mark.parametrize(("lora", "message"), [
    ({"rank": 0}, "rank"),
    ({"rank": 8, "targets": ["qproj"]}, "unknown LoRA target 'qproj'"),
    ({"rank": 8, "targets": []}, "targets is empty"),
    ({"rank": 8, "dropout": 1.0}, "dropout"),
])
def test_bad_declarations_are_refused_by_field(lora: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelSpec(preset="tiny-digits", lora=lora)
