"""Every family graphrl runs (Llama, Qwen2, Qwen3) against its `transformers` implementation, loaded with
the same random weights: the same logits (float32, relative difference at most 1e-5), the same greedy
continuation of left-padded prompts, and a saved model that `transformers` loads back as its own class.

Every weight is drawn (biases and norm weights too, std 0.15), so a bias or a q/k norm that our model
skipped or applied in the wrong place moves the logits far past the tolerance.
"""

from __future__ import annotations

import json

import pytest
import torch

from graphrl.errors import GraphRLError
from graphrl.executors.models.hf_checkpoint import dims_from_hf_config
from graphrl.executors.models.llama import Llama, PackedSequences
from graphrl.executors.models.sampling import generate
from graphrl.models import from_pretrained, save_pretrained
from graphrl.schemas.model import MODEL_PRESETS, ModelDims
from graphrl.schemas.sharding import llama_params
from test_models import assert_greedy_as_transformers

transformers = pytest.importorskip("transformers")

VOCAB = 48
REL_TOL = 1e-5


def _config(family: str, tie: bool):  # noqa: ANN202
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        return transformers.LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
    # Qwen3: heads wider than hidden / heads (32 x 4 = 128 > 64), as the released Qwen3 models have them.
    return transformers.Qwen3Config(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                    **common)


def hf_model(family: str, tie: bool = False, seed: int = 0):  # noqa: ANN202
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, tie))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.15
            param.copy_(noise if param.dim() == 2 else 1.0 + noise)  # norms near 1, biases near 1 too
    return model.eval()


FAMILIES = [("llama", False), ("qwen2", True), ("qwen2", False), ("qwen3", False), ("qwen3", True)]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(("family", "tie"), FAMILIES)
def test_logits_match_transformers(tmp_path, family: str, tie: bool) -> None:
    hf = hf_model(family, tie)
    hf.save_pretrained(tmp_path)
    ours, _ = from_pretrained(tmp_path)
    assert ours.dims.family == family and ours.dims.tie_embeddings is tie
    assert sorted(ours.state_dict()) == sorted(k for k in hf.state_dict() if not (tie and k == "lm_head.weight"))
    ids = torch.randint(3, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits.float()
        got = ours(ids)
        packed = ours.logits(ours.packed_hidden_states(PackedSequences.of(ids, torch.ones_like(ids, dtype=torch.bool))))
    assert _relative(got, want) <= REL_TOL
    assert _relative(packed, want.reshape(-1, VOCAB)) <= REL_TOL


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_greedy_continuation_matches_transformers_with_left_padding(tmp_path, family: str) -> None:
    hf = hf_model(family, tie=family == "qwen2")
    hf.save_pretrained(tmp_path)
    ours, _ = from_pretrained(tmp_path)
    assert_greedy_as_transformers(hf, ours, VOCAB)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_saved_model_loads_back_into_transformers_as_its_family(tmp_path, family: str) -> None:
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    ours, _ = from_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["model_type"] == family and config["architectures"] == [type(hf).__name__]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(again) is type(hf)
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert _relative(again(input_ids=ids).logits, hf(input_ids=ids).logits) <= REL_TOL


def test_inventory_names_every_parameter_of_each_family() -> None:
    for name in ("tiny-digits", "tiny-digits-qwen2", "tiny-digits-qwen3"):
        dims = MODEL_PRESETS[name]
        model = Llama(dims)
        assert [(p.name, p.shape) for p in llama_params(dims)] == [(k, tuple(v.shape)) for k, v in
                                                                   model.state_dict().items()]


def test_qwen_presets_have_the_published_sizes() -> None:
    # Parameter counts of the released checkpoints (their safetensors, a tied head counted once).
    from graphrl.compiler.cost.model import param_count

    published = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512, "qwen3-0.6b": 596_049_920,
                 "qwen3-8b": 8_190_735_360}
    assert {name: param_count(MODEL_PRESETS[name]) for name in published} == published


def test_unknown_family_and_unsupported_variants_are_refused_by_name() -> None:
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96,
            "vocab_size": 48}
    with pytest.raises(GraphRLError, match="model_type 'gemma2'.*llama, qwen2, qwen3"):
        dims_from_hf_config({**base, "model_type": "gemma2"})
    with pytest.raises(GraphRLError, match="use_sliding_window"):
        dims_from_hf_config({**base, "model_type": "qwen2", "use_sliding_window": True})
    with pytest.raises(GraphRLError, match="attention_bias"):
        dims_from_hf_config({**base, "model_type": "qwen3", "attention_bias": True})
    dims = dims_from_hf_config({**base, "model_type": "qwen3", "head_dim": 32})
    assert (dims.head_dim, dims.q_width, dims.qk_norm, dims.qkv_bias) == (32, 128, True, False)


def test_family_switches_default_from_the_family_and_can_be_set() -> None:
    tiny = dict(vocab_size=16, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2)
    assert ModelDims(family="qwen2", **tiny).qkv_bias is True
    assert ModelDims(family="qwen2", qkv_bias=False, **tiny).qkv_bias is False
    assert ModelDims(**tiny).head_dim == 16
    with pytest.raises(ValueError, match="give head_dim"):
        ModelDims(**{**tiny, "hidden_size": 66})
    assert ModelDims(**{**tiny, "hidden_size": 66}, head_dim=16).q_width == 64


def test_a_checkpoint_whose_tensors_differ_from_its_config_names_the_first(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    hf = hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(7)
    del state["model.layers.1.self_attn.q_proj.bias"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(GraphRLError, match=r"model.layers.0.self_attn.k_proj.bias has shape \(7,\).*\(and 1 more\)"):
        from_pretrained(tmp_path)


# -- mixture of experts ----------------------------------------------------------------------------------


def _moe_config(family: str, norm_topk: bool):  # noqa: ANN202
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=40, num_experts=6,
                  num_experts_per_tok=2, norm_topk_prob=norm_topk, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(shared_expert_intermediate_size=56, **common)
    return transformers.Qwen3MoeConfig(head_dim=32, **common)


def hf_moe(family: str, norm_topk: bool = True, seed: int = 0):  # noqa: ANN202
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_moe_config(family, norm_topk))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.15
            # routers drawn wider, so that top-k choices are not near-ties a float32 reordering could flip
            param.copy_(noise * 8 if name.endswith("mlp.gate.weight") else noise if param.dim() >= 2 else 1.0 + noise)
    return model.eval()


@pytest.mark.parametrize(("family", "norm_topk"), [("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", False)])
def test_moe_logits_match_transformers(tmp_path, family: str, norm_topk: bool) -> None:
    hf = hf_moe(family, norm_topk)
    hf.save_pretrained(tmp_path)  # one tensor per expert on disk, as released checkpoints hold them
    ours, _ = from_pretrained(tmp_path)
    assert ours.dims.family == family and ours.dims.num_experts == 6 and ours.dims.norm_topk_prob is norm_topk
    ids = torch.randint(3, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits.float()
        got = ours(ids)
    assert _relative(got, want) <= REL_TOL


def test_moe_greedy_continuation_matches_transformers(tmp_path) -> None:
    hf = hf_moe("qwen3_moe")
    hf.save_pretrained(tmp_path)
    ours, _ = from_pretrained(tmp_path)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        want = hf.generate(input_ids=ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)[:, 9:]
    got = generate(ours, ids, mask, 16, temperature=0.0, eos_id=None, pad_id=0)
    assert torch.equal(got.response_ids, want)


def test_moe_saved_model_loads_back_into_transformers(tmp_path) -> None:
    hf = hf_moe("qwen2_moe")
    hf.save_pretrained(tmp_path / "hf")
    ours, _ = from_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(again) is type(hf)
    ids = torch.randint(3, VOCAB, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert _relative(again(input_ids=ids).logits, hf(input_ids=ids).logits) <= REL_TOL


def test_load_balancing_loss_is_transformers(tmp_path) -> None:
    from graphrl.executors.models.llama import load_balancing_loss, routing

    hf = hf_moe("qwen3_moe")
    hf.save_pretrained(tmp_path)
    ours, _ = from_pretrained(tmp_path)
    ids = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
        with routing(ours, keep_logits=True) as log:
            ours(ids, mask.bool())
    assert len(log.router_logits) == 2 and [c.shape for c in log.chosen] == [(60, 2)] * 2
    torch.testing.assert_close(load_balancing_loss(log.router_logits, 6, 2, mask.bool()), want.float(), rtol=1e-5, atol=0)


def test_replayed_routes_are_used_and_the_router_still_gets_gradients() -> None:
    from graphrl.executors.models.llama import routing

    torch.manual_seed(0)
    model = Llama(MODEL_PRESETS["tiny-digits-moe"])
    ids = torch.randint(0, 16, (2, 7))
    with torch.no_grad(), routing(model) as first:
        own = model(ids)
    recorded = torch.stack(first.chosen)  # [layers, tokens, k]
    with torch.no_grad(), routing(model, replay=recorded):
        same = model(ids)
    torch.testing.assert_close(same, own, rtol=0, atol=0)
    other = (recorded + 1) % 4  # every token sent to other experts
    other[:, :3] = -1  # the first tokens left to the router
    with routing(model, replay=other) as forced:
        changed = model(ids)
    assert torch.equal(torch.stack(forced.chosen)[:, 3:], other[:, 3:])
    assert torch.equal(torch.stack(forced.chosen)[:, :3], recorded[:, :3])
    assert not torch.allclose(changed, own)
    changed.sum().backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_generation_records_each_tokens_routes_and_scoring_replays_them() -> None:
    """The routes a generation records are those of the forwards that fed each token (prompt and response,
    -1 for pads and the last, never fed, response token); a teacher-forced scoring that replays them routes
    every real token as the generator did, even with weights moved enough to route otherwise."""
    from graphrl.executors.models.llama import routing
    from graphrl.executors.models.sampling import replay_of, routes_of, token_logprobs

    torch.manual_seed(0)
    model = Llama(MODEL_PRESETS["tiny-digits-moe"])
    ids = torch.randint(1, 16, (3, 6))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :2] = False
    out = generate(model, ids, mask, 5, temperature=1.0, generator=torch.Generator().manual_seed(1), eos_id=None,
                   record_routes=True)
    assert out.routes is not None and out.routes.shape == (3, 11, 2, 2)
    assert (out.routes[0, :2] == -1).all() and (out.routes[:, -1] == -1).all() and (out.routes[1, :10] >= 0).all()
    routes = routes_of(out.routes)  # as the rollouts carry them
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    with torch.no_grad(), routing(model) as own:
        token_logprobs(model, ids, mask, out.response_ids, out.response_mask)
    with torch.no_grad(), routing(model, impose_given=True) as log:
        token_logprobs(model, ids, mask, out.response_ids, out.response_mask, routes=routes)
    given = replay_of(routes.reshape(-1, routes.shape[-1]), 2)
    chosen, theirs = torch.stack(log.chosen), torch.stack(own.chosen)
    real = given[0, :, 0] >= 0
    assert torch.equal(chosen[:, real], given[:, real])  # every fed real token routed as the generator did
    assert not torch.equal(theirs[:, real], given[:, real])  # which its own router no longer would
    assert 0 < float(log.differing) / float(log.decisions) < 1


def test_the_cost_model_charges_active_experts_their_memory_and_the_busiest_rank() -> None:
    """Memory counts every expert, FLOPs the top-k a token is routed to; a tp group that shares the experts
    out (ep = tp) waits for its busiest rank, charged at the capacity factor."""
    from graphrl.compiler.cost.model import active_param_count, param_count
    from graphrl.compiler.cost.timing import EXPERT_LOAD_IMBALANCE, layer_matmul_shapes

    dims = MODEL_PRESETS["qwen3-30b-a3b"]
    assert 30e9 < param_count(dims) < 31e9 and 3.2e9 < active_param_count(dims) < 3.5e9  # "30B-A3B"
    one, two = layer_matmul_shapes(dims, 1), layer_matmul_shapes(dims, 2)
    experts = [(2048, 768 * 8), (2048, 768 * 8), (768, 2048 * 8)]  # gate, up, down of top-8 experts: (k, n * 8)
    assert [s for s in one if s in experts] == experts
    shared_out = [(k, round(n / 2 * EXPERT_LOAD_IMBALANCE)) for k, n in experts]  # half the experts, the busier rank
    assert [s for s in two if s in shared_out] == shared_out and not any(s in experts for s in two)
    dense = MODEL_PRESETS["qwen3-8b"]
    assert active_param_count(dense) == param_count(dense)
