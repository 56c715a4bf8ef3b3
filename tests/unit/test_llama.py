"""The native Llama: padding invariance, KV-cache generation, teacher-forced log-probs, checkpoints.

Weights are re-drawn with std 0.15 (not the 0.02 init) so attention and next-token distributions are
far from uniform (entropy ~2 nats of ln 16 = 2.77) and a wrong mask, position or cache slot moves the
logits by much more than the tolerances, while float32 reduction-order noise stays ~3e-6.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from graphrl.errors import GraphRLError
from graphrl.executors.models.llama import KVCache, Llama, LlamaCritic, count_params, param_shapes
from graphrl.executors.models.sampling import generate, token_logprobs, token_logprobs_and_entropy, token_values
from graphrl.executors.models.hf_checkpoint import dims_from_hf_config, load_hf_checkpoint, save_hf_checkpoint
from graphrl.schemas.model import MODEL_PRESETS, ModelDims

DIMS = MODEL_PRESETS["tiny-digits"]  # hidden 64, 2 layers, 4 query heads over 2 KV heads, vocab 16
EOS_ID, PAD_ID = 2, 0


def _spread(module: nn.Module, seed: int = 0) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    return module.eval()


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return _spread(Llama(DIMS))


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts of 2, 5 and 4 real tokens; pad ids are junk on purpose."""
    ids = torch.tensor([[7, 9, 11, 5, 3], [4, 5, 6, 7, 8], [13, 1, 9, 3, 10]])
    mask = torch.tensor([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    return ids, mask


# ---- shapes


@pytest.mark.parametrize("tie", [False, True])
def test_param_shapes_equal_state_dict_in_order(tie: bool) -> None:
    dims = DIMS.model_copy(update={"tie_embeddings": tie})
    policy = Llama(dims)
    assert list(param_shapes(dims).items()) == [(k, tuple(v.shape)) for k, v in policy.state_dict().items()]
    assert count_params(dims) == sum(p.numel() for p in policy.parameters())
    assert ("lm_head.weight" in param_shapes(dims)) is not tie
    critic = LlamaCritic(dims)
    assert list(param_shapes(dims, "value").items()) == [(k, tuple(v.shape)) for k, v in critic.state_dict().items()]


def test_param_shapes_of_llama3_8b_without_building_it() -> None:
    """The published 8B count (8.03e9) comes out of dims alone."""
    assert count_params(MODEL_PRESETS["llama3-8b"]) == 8_030_261_248
    assert param_shapes(MODEL_PRESETS["llama3-8b"])["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)


# ---- forward


def test_left_padding_does_not_change_real_tokens(model: Llama) -> None:
    ids, mask = _prompts()
    logits = model(ids, mask)
    assert logits.dtype == torch.float32 and logits.shape == (3, 5, DIMS.vocab_size)
    for row in range(3):
        real = mask[row]
        alone = model(ids[row : row + 1, real], torch.ones(1, int(real.sum()), dtype=torch.bool))
        torch.testing.assert_close(logits[row, real], alone[0], atol=1e-5, rtol=0)
    assert torch.isfinite(logits).all(), "pad queries must not produce NaN"


def test_explicit_positions_rope_is_relative(model: Llama) -> None:
    """Shifting every position by 10 leaves logits unchanged (RoPE sees only offsets); the default
    positions are cumsum(mask) - 1, so passing those explicitly changes nothing either."""
    ids, mask = _prompts()
    default_positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    logits = model(ids, mask)
    # Bitwise: RoPE is relative, so a constant offset per row (e.g. arange positions under left
    # padding) would only show up as float noise.
    assert torch.equal(model(ids, mask, positions=default_positions), logits)
    shifted = model(ids, mask, positions=default_positions + 10)
    torch.testing.assert_close(shifted[mask], logits[mask], atol=1e-4, rtol=0)
    scrambled = model(ids, mask, positions=default_positions.flip(1))
    assert (scrambled[mask] - logits[mask]).abs().max() > 1e-2, "positions must reach the attention"


def test_critic_left_padding_and_shape() -> None:
    torch.manual_seed(1)
    critic = _spread(LlamaCritic(DIMS), seed=1)
    ids, mask = _prompts()
    values = critic(ids, mask)
    assert values.shape == (3, 5) and values.dtype == torch.float32
    alone = critic(ids[:1, 3:], torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(values[0, 3:], alone[0], atol=1e-5, rtol=0)
    response_ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    response_mask = torch.tensor([[1, 0], [1, 1], [1, 1]], dtype=torch.bool)
    per_token = token_values(critic, ids, mask, response_ids, response_mask)
    # V before response token 0 is the critic's output at the last prompt column.
    torch.testing.assert_close(per_token[:, 0], values[:, -1], atol=1e-5, rtol=0)
    assert per_token[0, 1] == 0.0


def test_kv_cache_decoding_equals_full_forward(model: Llama) -> None:
    """Prefill, then one token, then a chunk of two: each step's logits equal the full forward's."""
    ids, mask = _prompts()
    extra = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    full = model(torch.cat((ids, extra), 1), torch.cat((mask, torch.ones(3, 3, dtype=torch.bool)), 1))
    cache = KVCache.allocate(DIMS, 3, 8, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        prefill = model(ids, mask, kv_cache=cache)
        step = model(extra[:, :1], torch.ones(3, 1, dtype=torch.bool), kv_cache=cache)
        chunk = model(extra[:, 1:], torch.ones(3, 2, dtype=torch.bool), kv_cache=cache)
    real = mask
    torch.testing.assert_close(prefill[real], full[:, :5][real], atol=1e-5, rtol=0)
    torch.testing.assert_close(step[:, 0], full[:, 5], atol=1e-5, rtol=0)
    torch.testing.assert_close(chunk, full[:, 6:], atol=1e-5, rtol=0)
    assert cache.length == 8 and cache.num_valid_b.tolist() == [5, 8, 7]


# ---- generation


def test_generate_logprobs_equal_token_logprobs(model: Llama) -> None:
    ids, mask = _prompts()
    out = generate(
        model, ids, mask, 10, temperature=1.0, top_p=0.9,
        generator=torch.Generator().manual_seed(0), eos_id=EOS_ID, pad_id=PAD_ID,
    )
    assert out.response_ids.shape == out.response_mask.shape == out.logprobs.shape == (3, 10)
    assert out.logprobs.dtype == torch.float32 and out.response_mask.dtype == torch.bool
    recomputed = token_logprobs(model, ids, mask, out.response_ids, out.response_mask)
    torch.testing.assert_close(out.logprobs, recomputed, atol=1e-5, rtol=0)
    assert (out.logprobs[out.response_mask] < 0).all()
    assert (out.logprobs[~out.response_mask] == 0).all()
    assert (out.response_ids[~out.response_mask] == PAD_ID).all()


def test_eos_ends_each_row_and_pads_the_rest(model: Llama) -> None:
    """Sample once without EOS, then again (same seed) with EOS = a token row 1 drew at step 3.

    Each row must be cut right after its first EOS: same tokens up to it, mask True through it, pads
    (mask False, logprob 0) after it, and rows that never drew it run to the end.
    """
    ids, mask = _prompts()

    def sample(eos_id: int | None):
        return generate(model, ids, mask, 16, generator=torch.Generator().manual_seed(5), eos_id=eos_id, pad_id=PAD_ID)

    free = sample(None)
    assert free.response_mask.all()
    eos = int(free.response_ids[1, 3])
    stopped = sample(eos)
    num_cut = 0
    for row in range(3):
        hits = (free.response_ids[row] == eos).nonzero().flatten().tolist()
        length = hits[0] + 1 if hits else 16
        num_cut += length < 16
        assert stopped.response_mask[row].tolist() == [True] * length + [False] * (16 - length)
        assert torch.equal(stopped.response_ids[row, :length], free.response_ids[row, :length])
        torch.testing.assert_close(stopped.logprobs[row, :length], free.logprobs[row, :length], atol=1e-5, rtol=0)
        assert (stopped.response_ids[row, length:] == PAD_ID).all() and (stopped.logprobs[row, length:] == 0).all()
    assert num_cut >= 1


def test_token_logprobs_and_entropy(model: Llama) -> None:
    ids, mask = _prompts()
    response_ids = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 7, 8]])
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    logprobs, entropy = token_logprobs_and_entropy(model, ids, mask, response_ids, response_mask)
    torch.testing.assert_close(logprobs, token_logprobs(model, ids, mask, response_ids, response_mask))
    # Entropy of the position predicting response token 0 is that of the last prompt column.
    logp = torch.log_softmax(model(ids, mask)[:, -1], -1)
    torch.testing.assert_close(entropy[:, 0], -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=0)
    assert ((entropy[response_mask] > 0) & (entropy[response_mask] < math.log(DIMS.vocab_size))).all()
    assert entropy[0, 2] == 0 and logprobs[0, 2] == 0


def test_token_logprobs_are_differentiable() -> None:
    torch.manual_seed(0)
    policy = Llama(DIMS)
    ids, mask = _prompts()
    logprobs = token_logprobs(policy, ids, mask, torch.tensor([[1], [2], [3]]), torch.ones(3, 1, dtype=torch.bool))
    logprobs.sum().backward()
    grad = policy.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_sampling_is_deterministic_given_generator(model: Llama) -> None:
    ids, mask = _prompts()

    def sample(seed: int) -> torch.Tensor:
        return generate(model, ids, mask, 8, top_p=0.95, generator=torch.Generator().manual_seed(seed)).response_ids

    torch.manual_seed(123)  # the global RNG must not matter
    first = sample(7)
    torch.manual_seed(456)
    assert torch.equal(first, sample(7))
    assert not torch.equal(first, sample(8))


def _greedy_without_cache(model: Llama, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        next_token = model(ids, mask)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat((ids, next_token), 1)
        mask = torch.cat((mask, torch.ones_like(next_token, dtype=torch.bool)), 1)
    return ids[:, -steps:]


def test_greedy_equals_argmax_of_full_forward(model: Llama) -> None:
    ids, mask = _prompts()
    out = generate(model, ids, mask, 6, temperature=0.0)
    with torch.no_grad():
        assert torch.equal(out.response_ids, _greedy_without_cache(model, ids, mask, 6))
    assert out.response_mask.all()


def test_tiny_top_p_is_greedy(model: Llama) -> None:
    ids, mask = _prompts()
    greedy = generate(model, ids, mask, 6, temperature=0.0)
    nucleus = generate(model, ids, mask, 6, temperature=1.0, top_p=1e-6, generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy.response_ids, nucleus.response_ids)
    torch.testing.assert_close(greedy.logprobs, nucleus.logprobs)


def test_left_padded_batch_generates_like_each_prompt_alone(model: Llama) -> None:
    ids, mask = _prompts()
    batch = generate(model, ids, mask, 5, temperature=0.0)
    for row in range(3):
        real = mask[row]
        alone = generate(model, ids[row : row + 1, real], torch.ones(1, int(real.sum()), dtype=torch.bool), 5, temperature=0.0)
        assert torch.equal(batch.response_ids[row], alone.response_ids[0])
        torch.testing.assert_close(batch.logprobs[row], alone.logprobs[0], atol=1e-5, rtol=0)


def test_generation_stops_once_every_row_has_ended(model: Llama) -> None:
    """All rows share a prompt and EOS is their greedy first token: only the prefill forward may run."""
    ids = torch.tensor([[4, 5, 6]] * 2)
    mask = torch.ones(2, 3, dtype=torch.bool)
    eos = int(generate(model, ids, mask, 1, temperature=0.0).response_ids[0, 0])
    trunk_calls = []
    handle = model.model.register_forward_hook(lambda *_: trunk_calls.append(1))
    try:
        out = generate(model, ids, mask, 6, temperature=0.0, eos_id=eos, pad_id=PAD_ID)
    finally:
        handle.remove()
    assert len(trunk_calls) == 1
    assert out.response_ids.shape == (2, 6), "responses keep max_new_tokens columns, padded"
    assert out.response_mask.tolist() == [[True] + [False] * 5] * 2
    assert (out.response_ids[:, 0] == eos).all() and (out.response_ids[:, 1:] == PAD_ID).all()


def test_generate_rejects_right_padded_prompts(model: Llama) -> None:
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, torch.tensor([[1, 2, 0]]), torch.tensor([[True, True, False]]), 2)


# ---- checkpoints


def test_save_and_load_round_trip(tmp_path, model: Llama) -> None:
    save_hf_checkpoint(model, DIMS, tmp_path)
    dims, state_dict = load_hf_checkpoint(tmp_path)
    assert dims == DIMS
    reloaded = Llama(dims)
    reloaded.load_state_dict(state_dict, strict=True)
    ids, mask = _prompts()
    torch.testing.assert_close(reloaded(ids, mask), model(ids, mask), atol=0, rtol=0)


def test_load_sharded_checkpoint(tmp_path, model: Llama) -> None:
    from safetensors.torch import save_file

    save_hf_checkpoint(model, DIMS, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    state_dict = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = list(state_dict)
    shards = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
    for file_name, shard_names in shards.items():
        save_file({k: state_dict[k] for k in shard_names}, str(tmp_path / file_name), metadata={"format": "pt"})
    weight_map = {name: file_name for file_name, shard_names in shards.items() for name in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _, loaded = load_hf_checkpoint(tmp_path)
    assert list(loaded) == names
    assert all(torch.equal(loaded[k], state_dict[k]) for k in names)


def test_load_rejects_missing_weights(tmp_path, model: Llama) -> None:
    from safetensors.torch import save_file

    save_hf_checkpoint(model, DIMS, tmp_path)
    state_dict = {k: v for k, v in model.state_dict().items() if k != "model.norm.weight"}
    save_file(state_dict, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(GraphRLError, match="model.norm.weight"):
        load_hf_checkpoint(tmp_path)


def _hf_config(**overrides: object) -> dict:
    config = {
        "model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    }
    return {**config, **overrides}


def test_dims_from_hf_config_transformers_4_and_5_layouts() -> None:
    v4 = dims_from_hf_config(_hf_config())
    assert v4 == ModelDims(
        vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
        max_seq_len=128, rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=False,
    )
    v5 = _hf_config(num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    del v5["rope_theta"]
    assert dims_from_hf_config(v5).rope_theta == 500000.0 and dims_from_hf_config(v5).num_kv_heads == 2


def test_dims_from_hf_config_warns_or_refuses() -> None:
    with pytest.warns(UserWarning, match="yarn"):
        dims_from_hf_config(_hf_config(rope_scaling={"rope_type": "yarn", "factor": 8.0}))
    with pytest.raises(GraphRLError, match="attention_bias"):
        dims_from_hf_config(_hf_config(attention_bias=True))
    with pytest.raises(GraphRLError, match="mistral"):
        dims_from_hf_config(_hf_config(model_type="mistral"))


@pytest.mark.parametrize("tie", [False, True])
def test_hugging_face_checkpoint_round_trip(tmp_path, tie: bool) -> None:
    """HF LlamaForCausalLM -> our loader gives the same logits, and our saver -> HF loads them back."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    hf_model = _spread(transformers.LlamaForCausalLM(config))
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)

    dims, state_dict = load_hf_checkpoint(tmp_path / "hf")
    assert dims.tie_embeddings is tie and dims.num_kv_heads == 2
    ours = Llama(dims)
    ours.load_state_dict(state_dict, strict=True)
    ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits.float()
    torch.testing.assert_close(ours(ids, torch.ones_like(ids, dtype=torch.bool)), expected, atol=1e-4, rtol=0)

    save_hf_checkpoint(ours, dims, tmp_path / "ours")
    hf_again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf_again(input_ids=ids).logits.float(), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tie", [False, True])
def test_full_weights_are_copied_in_place_and_kept_only_where_asked(tie: bool) -> None:
    """What the executor gathers with (one tensor at a time): `copy_full_weights` fills an existing
    module exactly; `full_state_dict(keep=False)` keeps nothing, `to_host` keeps host tensors."""
    from graphrl.executors.parallel import copy_full_weights, full_state_dict

    dims = DIMS.model_copy(update={"tie_embeddings": tie})
    src, dst = _spread(Llama(dims), seed=1), _spread(Llama(dims), seed=2)
    copy_full_weights(dst, src)
    assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(), src.state_dict().values()))
    assert full_state_dict(src, keep=False) == {}
    kept = full_state_dict(src, to_host=True)
    assert set(kept) == set(src.state_dict()) and all(t.device.type == "cpu" for t in kept.values())
    with pytest.raises(RuntimeError, match="weights differ"):
        copy_full_weights(dst, Llama(dims.model_copy(update={"num_layers": 1})))
