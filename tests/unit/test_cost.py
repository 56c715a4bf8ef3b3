"""The cost model's sizes and memory (`graphrl.compiler.cost.model`, `.memory`): parameters, FLOPs and memory,
against hand-computed values (arithmetic in the comments), published parameter counts, and the monotonic
trends placement relies on. Time is `graphrl.compiler.cost.timing`, tested in test_timing.py."""

from __future__ import annotations

import pytest

from graphrl.compiler.cost import (
    MemoryBreakdown,
    forward_flops_per_token,
    inference_memory,
    kv_cache_bytes_per_token,
    param_count,
    prefill_flops,
    train_flops,
    training_memory,
    weight_bytes,
)
from graphrl.schemas.model import MODEL_PRESETS, ModelDims

# A toy decoder small enough to count by hand. head_dim = 8 / 2 = 4.
#   embed 100*8 = 800
#   per layer: q 8*8 = 64, k and v 8*(1*4) = 32 each, o 64, gate/up/down 3*8*16 = 384, norms 16
#     linears 64+32+32+64+384 = 576; with norms 592
#   total 800 + 2*592 + 8 (final norm) + 800 (lm_head) = 2792
#   matmul params (block linears + head) 2*576 + 800 = 1952
TOY = ModelDims(
    vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
    max_seq_len=64,
)
# Exactly 1e9 parameters (tied head): 839979*1000 + 10*(4*1000^2 + 3*1000*4000 + 2*1000) + 1000
#   = 839,979,000 + 10*16,002,000 + 1000 = 1,000,000,000. One layer: 16,002,000 params.
BILLION = ModelDims(
    vocab_size=839979, hidden_size=1000, intermediate_size=4000, num_layers=10, num_heads=10,
    num_kv_heads=10, tie_embeddings=True,
)

L8B, L70B = MODEL_PRESETS["llama3-8b"], MODEL_PRESETS["llama3-70b"]


# ---------------------------------------------------------------------------------------- size


@pytest.mark.parametrize(
    ("preset", "expected"),
    [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496), ("llama3-405b", 405_853_388_800)],
)
def test_param_count_matches_published_llama3(preset: str, expected: int) -> None:
    assert param_count(MODEL_PRESETS[preset]) == expected


def test_param_count_toy_and_tied_head() -> None:
    assert param_count(TOY) == 2792
    # A tied head drops the separate V*H = 800 output matrix.
    assert param_count(TOY.model_copy(update={"tie_embeddings": True})) == 1992
    assert param_count(BILLION) == 1_000_000_000


def test_kv_cache_bytes_per_token() -> None:
    # 2 * layers * kv_heads * head_dim * bytes
    assert kv_cache_bytes_per_token(TOY, 2) == 2 * 2 * 1 * 4 * 2 == 32
    assert kv_cache_bytes_per_token(L8B, 2) == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv_cache_bytes_per_token(L70B, 1) == 2 * 80 * 8 * 128 == 163_840


# ---------------------------------------------------------------------------------------- FLOPs


def test_forward_flops_per_token() -> None:
    # 2*1952 + 4 * layers 2 * context 10 * heads 2 * head_dim 4 = 3904 + 640
    assert forward_flops_per_token(TOY, 10) == 4544


def test_train_and_prefill_flops_use_the_causal_mean_context() -> None:
    # seq_len 9 -> mean context (9+1)/2 = 5; per token 3904 + 4*2*5*8 = 4224
    assert train_flops(TOY, 100, 9, recompute=False) == 3 * 100 * 4224 == 1_267_200
    assert train_flops(TOY, 100, 9, recompute=True) == 4 * 100 * 4224 == 1_689_600
    assert prefill_flops(TOY, 2, 9) == 2 * 9 * 4224 == 76_032


def test_train_flops_close_to_six_n_d_for_8b() -> None:
    """At short context the attention term is small: train FLOPs ~ 6 * N * tokens (N without the
    embedding lookup)."""
    flops = train_flops(L8B, 1e6, 128, recompute=False)
    assert flops == pytest.approx(6 * (param_count(L8B) - 128256 * 4096) * 1e6, rel=0.01)


# ---------------------------------------------------------------------------------------- training memory


def _mem(sharding: str, **kw: object) -> tuple[MemoryBreakdown, MemoryBreakdown]:
    args: dict = dict(
        dp=8, fsdp=1, tp=1, pp=1, sharding=sharding, micro_batch_tokens=0, seq_len=1, recompute=False,
    )
    args.update(kw)
    return training_memory(BILLION, **args)


def test_training_memory_none() -> None:
    # 1e9 params * (2 + 2 + 12) bytes, nothing sharded
    dev, host = _mem("none")
    assert (dev.params, dev.grads, dev.optimizer) == (2e9, 2e9, 12e9)
    assert dev.total == 16e9 and host.total == 0


def test_training_memory_zero1() -> None:
    # 2e9 + 2e9 + 12e9/8 = 5.5e9
    dev, _ = _mem("zero1")
    assert (dev.params, dev.grads, dev.optimizer) == (2e9, 2e9, 1.5e9)
    assert dev.total == 5.5e9


def test_training_memory_zero2() -> None:
    """zero2 runs as FSDP2 with reshard_after_forward=False: weights, gradients and optimizer state rest
    as shards (16e9/8 = 2e9), and the whole unsharded bf16 model (2e9) is gathered from forward through
    backward, beside one layer's unreduced gradient (32,004,000 bytes). The plan used to charge a full
    replicated copy and no resting shard, which is not what any rank holds."""
    dev, _ = _mem("zero2")
    assert (dev.params, dev.grads, dev.optimizer) == (0.25e9 + 2e9, 0.25e9 + 32_004_000, 1.5e9)
    assert dev.gathered == 2e9 + 32_004_000
    assert dev.resting_state == 2e9


def test_training_memory_of_a_float32_model() -> None:
    """A float32 model trains without master weights: 4 + 4 + 8 bytes per parameter (AdamW's moments),
    where a bf16 model holds 2 + 2 + 12; the plan used to charge every model as mixed precision."""
    dev, _ = _mem("none", compute_bytes=4)
    assert (dev.params, dev.grads, dev.optimizer) == (4e9, 4e9, 8e9)
    dev, _ = _mem("zero1", compute_bytes=4)
    assert (dev.params, dev.grads, dev.optimizer) == (4e9, 4e9, 1e9)
    dev, _ = _mem("fsdp", compute_bytes=4)
    assert (dev.params, dev.grads, dev.optimizer) == (0.5e9 + 4 * 32_004_000, 0.5e9 + 2 * 32_004_000, 1e9)
    assert dev.resting_state == 2e9


def test_training_memory_fsdp() -> None:
    # 16e9/8 = 2e9 of shards, plus streaming buffers of unsharded bf16 layers (one layer is
    # 16,002,000 params = 32,004,000 bytes): 2 layers of weights, 1 layer of grads.
    dev, _ = _mem("fsdp")
    assert dev.params == 0.25e9 + 2 * 32_004_000
    assert dev.grads == 0.25e9 + 32_004_000
    assert dev.optimizer == 1.5e9
    assert dev.total == 2e9 + 3 * 32_004_000
    assert dev.gathered == 3 * 32_004_000 and dev.resting_state == 2e9
    # the data-parallel group is dp*fsdp: dp=2 x fsdp=4 shards like dp=8
    assert _mem("fsdp", dp=2, fsdp=4)[0] == dev
    # one device: nothing to gather, no buffers
    assert _mem("fsdp", dp=1)[0].total == 16e9


def test_training_memory_model_parallel_divides_first() -> None:
    # tp*pp = 4: 1e9/4 params per device; zero1 over 8: 0.5e9 + 0.5e9 + 3e9/8
    dev, _ = _mem("zero1", tp=2, pp=2)
    assert dev.total == 0.5e9 + 0.5e9 + 0.375e9


def test_offload_optimizer_moves_bytes_to_host() -> None:
    dev, host = _mem("zero1", offload_optimizer=True)
    assert (dev.params, dev.grads, dev.optimizer) == (2e9, 2e9, 0.0)
    assert host == MemoryBreakdown(optimizer=1.5e9)
    assert dev.total + host.total == 5.5e9  # nothing lost, nothing counted twice


def test_offload_params_moves_shards_to_host_and_keeps_buffers() -> None:
    dev, host = _mem("fsdp", offload_params=True, offload_optimizer=True)
    assert host == MemoryBreakdown(params=0.25e9, grads=0.25e9, optimizer=1.5e9)
    assert dev == MemoryBreakdown(params=2 * 32_004_000, grads=32_004_000, gathered=3 * 32_004_000)
    # without sharding the whole replica streams from the host
    dev, host = _mem("none", offload_params=True)
    assert host == MemoryBreakdown(params=2e9, grads=2e9)
    assert (dev.params, dev.grads, dev.optimizer) == (64_008_000, 32_004_000, 12e9)


def test_training_activations_by_hand() -> None:
    toy = dict(dp=1, fsdp=1, tp=1, pp=1, sharding="none", micro_batch_tokens=10, seq_len=10)
    # Korthikanti per token per layer: 34*8 + 5*heads 2*seq 10 = 372; 10 tokens * 2 layers = 7440
    # logits 10 tokens * vocab 100 * (2 + 4) bytes = 6000
    dev, _ = training_memory(TOY, **toy, recompute=False, flash_attention=False)
    assert dev.activations == 7440 + 6000
    # flash attention keeps an fp32 log-sum-exp per head instead: 272 + 4*2 = 280 -> 5600
    dev, _ = training_memory(TOY, **toy, recompute=False)
    assert dev.activations == 5600 + 6000
    # full recompute: layer inputs 10 tokens * 2 layers * 2*8 bytes = 320, one layer's working set
    # 10*372 = 3720, logits 6000
    dev, _ = training_memory(TOY, **toy, recompute=True, flash_attention=False)
    assert dev.activations == 320 + 3720 + 6000
    # tp=2 divides everything: 3720 + 3000
    dev, _ = training_memory(TOY, **{**toy, "tp": 2}, recompute=False, flash_attention=False)
    assert dev.activations == 3720 + 3000
    # pp=2 (1F1B): first stage 2 micro-batches * 1 layer * 3720 = 7440;
    # last stage 1 * 3720 + logits 6000 = 9720 -> the larger
    dev, _ = training_memory(TOY, **{**toy, "pp": 2}, recompute=False, flash_attention=False)
    assert dev.activations == 9720


def test_more_tp_less_training_memory_per_device() -> None:
    totals = [
        training_memory(
            L70B, dp=2, fsdp=4, tp=tp, pp=1, sharding="fsdp", micro_batch_tokens=4096, seq_len=4096,
            recompute=True,
        )[0].total
        for tp in (1, 2, 4, 8)
    ]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


def test_recompute_saves_activation_memory() -> None:
    kw = dict(dp=8, fsdp=1, tp=1, pp=1, sharding="fsdp", micro_batch_tokens=8192, seq_len=8192)
    plain = training_memory(L8B, **kw, recompute=False)[0].activations
    recomputed = training_memory(L8B, **kw, recompute=True)[0].activations
    assert recomputed < plain / 4


# ---------------------------------------------------------------------------------------- inference memory


def test_inference_memory_generator_by_hand() -> None:
    # params 2792 * 2; KV 2 sequences * 10 tokens * 32; activations per decode token
    # 2*8*2 (residual + normed) + 3*16*2 (SwiGLU) + 100*6 (logits) = 728, times 2 tokens
    mem = inference_memory(TOY, tp=1, pp=1, precision="bf16", batch=2, context_len=10)
    assert mem == MemoryBreakdown(params=5584, activations=1456, kv_cache=640)
    # fp8: block linears 1152 * 1 + a float32 scale per output row (2 layers x 64 rows x 4) + the rest 1640 * 2
    assert inference_memory(TOY, tp=1, pp=1, precision="fp8", batch=2, context_len=10).params == 1152 + 512 + 3280
    # tp=2: one KV head cannot split, so the KV cache is replicated, not halved
    assert inference_memory(TOY, tp=2, pp=1, precision="bf16", batch=2, context_len=10).kv_cache == 640


def test_inference_memory_forward_only() -> None:
    # a logprob forward: no KV cache; 2*10 tokens * 728
    mem = inference_memory(TOY, tp=1, pp=1, precision="bf16", batch=2, context_len=10, generator=False)
    assert mem == MemoryBreakdown(params=5584, activations=14560)


def test_more_tp_less_inference_memory() -> None:
    totals = [
        inference_memory(L70B, tp=tp, pp=1, precision="bf16", batch=64, context_len=4096).total
        for tp in (1, 2, 4, 8)
    ]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


def test_memory_breakdown_arithmetic() -> None:
    a = MemoryBreakdown(params=1, grads=2, optimizer=3, activations=4, kv_cache=5, engine_weights=6)
    b = MemoryBreakdown(params=10)
    assert (a + b).params == 11 and (a + b).total == 31 and (a + b).engine_weights == 6
    assert sum([a, b]) == a + b
    assert a.as_dict() == {
        "params": 1, "grads": 2, "optimizer": 3, "activations": 4, "kv_cache": 5, "gathered": 0.0,
        "engine_weights": 6, "total": 21,
    }
    assert a.resting_state == 6  # the engine's copy lives inside the engine, out of the ledger's reach


def test_weight_bytes_keeps_the_rest_at_the_model_dtype() -> None:
    """A float32 model's fp8 generator keeps embedding, head and norms at 4 bytes (as the executors hold
    them), its block linears at 1 byte plus a float32 scale per output row."""
    block = TOY.num_layers * 576  # 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16 per layer
    rest = 2792 - block
    assert weight_bytes(TOY, 1, 4) == block + TOY.num_layers * 64 * 4 + rest * 4
    assert weight_bytes(TOY, 4) == 2792 * 4
