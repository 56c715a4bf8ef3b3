"""The analytical cost model: hand-computed values (arithmetic in the comments), published parameter
counts, and the monotonic trends placement relies on."""

from __future__ import annotations

import random

import pytest

from graphrl.compiler.cost import (
    MemoryBreakdown,
    StepCost,
    UnsupportedPrecisionError,
    _sum_max_linear,
    collective_time,
    decode_step_cost,
    forward_flops_per_token,
    forward_time,
    generation_time,
    group_spans_nodes,
    inference_memory,
    kv_cache_bytes_per_token,
    offload_time,
    param_count,
    prefill_flops,
    train_flops,
    training_memory,
    training_step_time,
    weight_bytes,
)
from graphrl.errors import GraphRLError
from graphrl.schemas.hardware import HARDWARE_PRESETS, HardwareSpec
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
# Round figures, all efficiencies 1, so times are plain divisions.
TOY_HW = HardwareSpec(
    name="toy", peak_bf16_flops=1e12, peak_fp8_flops=2e12, memory_bytes=1e10, memory_bandwidth=1e11,
    intra_node_bandwidth=1e10, inter_node_bandwidth=1e9, host_link_bandwidth=1e9, link_latency_s=1e-6,
    compute_efficiency=1.0, memory_efficiency=1.0, link_efficiency=1.0,
)
# Exactly 1e9 parameters (tied head): 839979*1000 + 10*(4*1000^2 + 3*1000*4000 + 2*1000) + 1000
#   = 839,979,000 + 10*16,002,000 + 1000 = 1,000,000,000. One layer: 16,002,000 params.
BILLION = ModelDims(
    vocab_size=839979, hidden_size=1000, intermediate_size=4000, num_layers=10, num_heads=10,
    num_kv_heads=10, tie_embeddings=True,
)
BILLION_LAYER = 16_002_000

H100 = HARDWARE_PRESETS["h100-sxm-80gb"]
A100 = HARDWARE_PRESETS["a100-sxm-80gb"]
L8B, L70B, L405B = (MODEL_PRESETS[k] for k in ("llama3-8b", "llama3-70b", "llama3-405b"))


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


# ---------------------------------------------------------------------------------------- collectives


def test_collective_time_ring_formulas() -> None:
    b = 1e8
    # n=4, one node: bw 1e10, alpha 1e-6
    assert collective_time("all_gather", b, 4, TOY_HW, False) == pytest.approx(3 / 4 * 1e-2 + 3e-6)
    assert collective_time("reduce_scatter", b, 4, TOY_HW, False) == pytest.approx(3 / 4 * 1e-2 + 3e-6)
    assert collective_time("all_reduce", b, 4, TOY_HW, False) == pytest.approx(2 * 3 / 4 * 1e-2 + 6e-6)
    assert collective_time("broadcast", b, 4, TOY_HW, False) == pytest.approx(1e-2 + 3e-6)
    assert collective_time("p2p", b, 2, TOY_HW, False) == pytest.approx(1e-2 + 1e-6)
    # across nodes: bw 1e9 -> 2 * 3/4 * 0.1 + 6e-6
    assert collective_time("all_reduce", b, 4, TOY_HW, True) == pytest.approx(0.15 + 6e-6)
    # link_efficiency 0.5 halves the bandwidth: 3/4 * 1e8 / 5e9 + 3e-6
    slow = TOY_HW.model_copy(update={"link_efficiency": 0.5})
    assert collective_time("all_gather", b, 4, slow, False) == pytest.approx(0.015 + 3e-6)
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "p2p"):
        assert collective_time(kind, b, 1, TOY_HW, True) == 0.0
    with pytest.raises(ValueError):
        collective_time("all_to_all", b, 4, TOY_HW, False)  # type: ignore[arg-type]


def test_group_spans_nodes() -> None:
    assert not group_spans_nodes([0, 1, 2, 3], 4)
    assert group_spans_nodes([3, 4], 4)
    assert not group_spans_nodes([8, 9, 15], 8)
    assert not group_spans_nodes([], 8)


def test_offload_time() -> None:
    assert offload_time(2e9, TOY_HW) == pytest.approx(2.0)  # 2e9 bytes / 1e9 bytes/s


# ---------------------------------------------------------------------------------------- decode


def test_decode_step_memory_bound() -> None:
    # compute: 2 * 4544 / 1e12 = 9.088e-9
    # memory: weights read = all weights 2792*2 - embedding 800*2 = 3984; KV 2*10*32 = 640
    #   (3984 + 640) / 1e11 = 4.624e-8  -> memory bound
    assert decode_step_cost(TOY, 2, 10, 1, 2, 2, TOY_HW) == pytest.approx(4.624e-8)


def test_decode_step_compute_bound() -> None:
    # batch 1000: compute 1000*4544/1e12 = 4.544e-6; memory (3984 + 1000*10*32)/1e11 = 3.23984e-6
    assert decode_step_cost(TOY, 1000, 10, 1, 2, 2, TOY_HW) == pytest.approx(4.544e-6)


def test_decode_step_tensor_parallel() -> None:
    # tp=2: memory (3984/2 + 640 / min(2, kv_heads=1)) / 1e11 = 2.632e-8 (the single KV head is
    # replicated, not split); compute 9.088e-9/2.
    # comm: the embedding's and 2 layers * 2 all-reduces of batch*H*2 = 32 bytes over 2 devices:
    #   2*(2-1)*(32/(2*1e10) + 1e-6) = 2.0032e-6 each, 5 of them -> 1.0016e-5;
    #   the all-gather of batch*V*4 = 2*100*4 = 800 bytes of logits: (1/2)*800/1e10 + 1e-6 = 1.04e-6
    assert decode_step_cost(TOY, 2, 10, 2, 2, 2, TOY_HW) == pytest.approx(2.632e-8 + 1.0016e-5 + 1.04e-6)
    # across nodes the bandwidth term is 10x: 2*(32/(2*1e9) + 1e-6) = 2.032e-6 each, 800/(2*1e9) + 1e-6
    assert decode_step_cost(TOY, 2, 10, 2, 2, 2, TOY_HW, intra_node=False) == pytest.approx(
        2.632e-8 + 5 * 2.032e-6 + 1.4e-6
    )


def test_generation_time_by_hand() -> None:
    # batch 1, prompt 9, response 3, tp 1, bf16.
    # prefill: max(9*4224/1e12 = 3.8016e-8, weights 3984/1e11 = 3.984e-8) = 3.984e-8
    # decode steps attend to 10 and 11 keys:
    #   c=10: max((3904+640)/1e12, (3984+320)/1e11) = 4.304e-8
    #   c=11: max((3904+704)/1e12, (3984+352)/1e11) = 4.336e-8
    expected = 3.984e-8 + 4.304e-8 + 4.336e-8
    assert generation_time(TOY, 1, 9, 3, 1, "bf16", TOY_HW, True) == pytest.approx(expected)


def test_generation_time_fp8() -> None:
    # fp8: block linears 1152 at 1 byte, their float32 scales (2 layers x 64 output rows x 4 = 512), the
    # rest (2792-1152 = 1640) at 2 bytes, minus the 1600-byte embedding -> 1152 + 512 + 3280 - 1600 = 3344
    # bytes read per step.
    # prefill: max(38016/2e12, 3344/1e11 = 3.344e-8); steps: (3344 + 32c)/1e11 for c = 10, 11
    expected = 3.344e-8 + 3.664e-8 + 3.696e-8
    assert generation_time(TOY, 1, 9, 3, 1, "fp8", TOY_HW, True) == pytest.approx(expected)


def test_generation_time_matches_looping_over_steps() -> None:
    """The closed-form sum over decode steps equals the step-by-step sum, including batches whose
    steps switch from compute-bound to memory-bound mid-generation."""
    for batch, prompt, response, tp in [(64, 1024, 1024, 8), (512, 16, 4096, 8), (1, 100, 50, 1)]:
        prefill = generation_time(L405B, batch, prompt, 1, tp, "fp8", H100, True)
        looped = prefill + sum(
            decode_step_cost(L405B, batch, prompt + j, tp, 1, 2, H100, precision="fp8")
            for j in range(1, response)
        )
        assert generation_time(L405B, batch, prompt, response, tp, "fp8", H100, True) == pytest.approx(
            looped, rel=1e-9
        )


def test_sum_max_linear_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(200):
        a1, b1, a2, b2 = (rng.uniform(-5, 5) for _ in range(4))
        lo = rng.randint(-20, 20)
        hi = lo + rng.randint(-1, 40)
        brute = sum(max(a1 + b1 * c, a2 + b2 * c) for c in range(lo, hi + 1))
        assert _sum_max_linear(a1, b1, a2, b2, lo, hi) == pytest.approx(brute, abs=1e-9)


def test_fp8_on_hardware_without_fp8_is_an_error() -> None:
    with pytest.raises(UnsupportedPrecisionError) as info:
        generation_time(L8B, 8, 128, 128, 1, "fp8", A100, True)
    assert isinstance(info.value, ValueError) and isinstance(info.value, GraphRLError)
    assert "fix" in str(info.value)


def test_generation_faster_with_more_tp_and_slower_across_nodes() -> None:
    """Decode reads the weights every step, so tp divides that time, but each step also pays
    2 * layers + 1 tp all-reduces (and a logits all-gather) whose ring latency 2(n-1)*alpha grows with tp: with the presets'
    10 us per ring step, tp=8 is not faster than tp=4 for 70B; with 1 us it is."""
    times = [generation_time(L70B, 32, 512, 512, tp, "bf16", H100, True) for tp in (1, 2, 4)]
    assert times[0] > times[1] > times[2]
    fast_links = H100.model_copy(update={"link_latency_s": 1e-6})
    times = [generation_time(L70B, 32, 512, 512, tp, "bf16", fast_links, True) for tp in (2, 4, 8)]
    assert times[0] > times[1] > times[2]
    assert generation_time(L70B, 32, 512, 512, 8, "bf16", fast_links, False) > times[2]
    assert generation_time(L70B, 32, 512, 512, 8, "fp8", fast_links, True) < times[2]


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
    a = MemoryBreakdown(params=1, grads=2, optimizer=3, activations=4, kv_cache=5)
    b = MemoryBreakdown(params=10)
    assert (a + b).params == 11 and (a + b).total == 25
    assert sum([a, b]) == a + b
    assert a.as_dict() == {
        "params": 1, "grads": 2, "optimizer": 3, "activations": 4, "kv_cache": 5, "gathered": 0.0, "total": 15,
    }


# ---------------------------------------------------------------------------------------- step time


def _toy_step(**kw: object) -> StepCost:
    args: dict = dict(
        tokens=100, seq_len=9, dp=1, fsdp=1, tp=1, pp=1, sharding="none", recompute=False, hw=TOY_HW,
        intra_node_tp=True, dp_spans_nodes=False,
    )
    args.update(kw)
    return training_step_time(TOY, **args)


def test_training_step_single_device() -> None:
    # 1,267,200 FLOPs / 1e12
    cost = _toy_step()
    assert cost == StepCost(1.2672e-6, 0.0, 0.0, 0.0, 1.2672e-6)


def test_training_step_ddp_overlap_by_hand() -> None:
    # dp=2: compute 1.2672e-6 / 2 = 6.336e-7.
    # grads all-reduce of 2792*2 = 5584 bytes over 2: 2*(5584/(2*1e10) + 1e-6) = 2.5584e-6
    # one layer's share (of 2) exposed: 1.2792e-6; the rest hides behind backward (2/3 of compute
    # = 4.224e-7): 1.2792e-6 - 4.224e-7 = 8.568e-7 exposed -> 2.136e-6
    cost = _toy_step(dp=2)
    assert cost.compute_s == pytest.approx(6.336e-7)
    assert cost.comm_s == pytest.approx(2.5584e-6)
    assert cost.exposed_comm_s == pytest.approx(2.136e-6)
    assert cost.total_s == pytest.approx(6.336e-7 + 2.136e-6)


def test_fsdp_moves_one_and_a_half_times_ddp_bytes() -> None:
    # all-gather twice + reduce-scatter = 3 (n-1) steps of b/n vs all-reduce's 2 (n-1)
    no_latency = TOY_HW.model_copy(update={"link_latency_s": 0.0})
    ddp = _toy_step(dp=8, hw=no_latency).comm_s
    assert _toy_step(dp=8, sharding="fsdp", hw=no_latency).comm_s == pytest.approx(1.5 * ddp)
    assert _toy_step(dp=8, sharding="zero2", hw=no_latency).comm_s == pytest.approx(ddp)


def test_fsdp_pays_latency_per_unit() -> None:
    """FSDP gathers and reduces block by block (TOY: 2 blocks + the root = 3 units), so each of its three
    collectives per step pays (n-1) latency steps per unit; DDP's one bucket pays 2 (n-1) once. A model
    that charged FSDP's latency once made it look as cheap as DDP where latency dominates (gloo)."""
    no_latency = TOY_HW.model_copy(update={"link_latency_s": 0.0})
    alpha, n, units = TOY_HW.link_latency_s, 8, TOY.num_layers + 1
    fsdp = _toy_step(dp=n, sharding="fsdp").comm_s - _toy_step(dp=n, sharding="fsdp", hw=no_latency).comm_s
    ddp = _toy_step(dp=n).comm_s - _toy_step(dp=n, hw=no_latency).comm_s
    assert fsdp == pytest.approx(3 * units * (n - 1) * alpha)
    assert ddp == pytest.approx(2 * (n - 1) * alpha)


def test_zero_weight_gather_after_the_step_is_exposed() -> None:
    gather = collective_time("all_gather", 2792 * 2, 8, TOY_HW, False)
    assert _toy_step(dp=8, sharding="zero1").exposed_comm_s >= gather


def test_pipeline_bubble_fraction() -> None:
    # everything on the critical path stretches by (m + pp - 1)/m: bubble / total = 3/19 for pp=4, m=16
    cost = training_step_time(
        L70B, tokens=2**20, seq_len=4096, dp=1, fsdp=1, tp=1, pp=4, sharding="none", recompute=True,
        hw=H100, intra_node_tp=True, dp_spans_nodes=False,
    )
    assert cost.bubble_s / cost.total_s == pytest.approx(3 / 19)
    fewer = training_step_time(
        L70B, tokens=2**20, seq_len=4096, dp=1, fsdp=1, tp=1, pp=4, sharding="none", recompute=True,
        hw=H100, intra_node_tp=True, dp_spans_nodes=False, microbatches=4,
    )
    assert fewer.bubble_s / fewer.total_s == pytest.approx(3 / 7)


def test_tp_across_nodes_is_much_slower() -> None:
    kw = dict(
        tokens=2**21, seq_len=4096, dp=1, fsdp=8, tp=16, pp=1, sharding="fsdp", recompute=True, hw=H100,
        dp_spans_nodes=True,
    )
    inside = training_step_time(L405B, **kw, intra_node_tp=True)
    across = training_step_time(L405B, **kw, intra_node_tp=False)
    assert across.total_s > 2 * inside.total_s
    assert across.compute_s == inside.compute_s


def test_more_devices_less_compute_per_device() -> None:
    kw = dict(tokens=2**20, seq_len=4096, fsdp=1, pp=1, sharding="fsdp", recompute=False, hw=H100,
              intra_node_tp=True, dp_spans_nodes=True)
    small = training_step_time(L8B, dp=8, tp=1, **kw)
    big = training_step_time(L8B, dp=16, tp=1, **kw)
    assert big.compute_s == pytest.approx(small.compute_s / 2)
    assert big.total_s < small.total_s


def test_forward_time_by_hand() -> None:
    # 4 micro-batches of 25 tokens: max(25*4224/1e12 = 1.056e-7, weights 3984/1e11) each -> 4.224e-7
    cost = forward_time(TOY, tokens=100, seq_len=9, hw=TOY_HW)
    assert cost.total_s == pytest.approx(4.224e-7) and cost.comm_s == 0
    # one micro-batch of 1 token is memory-bound: 3984/1e11
    one = forward_time(TOY, tokens=1, seq_len=1, hw=TOY_HW, microbatches=1)
    assert one.total_s == pytest.approx(3.984e-8)


def test_forward_cheaper_than_training() -> None:
    kw = dict(tokens=2**20, seq_len=4096, hw=H100, dp=8, tp=1, pp=1)
    fwd = forward_time(L8B, **kw)
    train = training_step_time(L8B, **kw, fsdp=1, sharding="none", recompute=False, intra_node_tp=True,
                               dp_spans_nodes=False)
    assert fwd.compute_s == pytest.approx(train.compute_s / 3, rel=0.01)


def test_fp8_on_a_cpu_is_charged_at_the_unquantized_rate() -> None:
    """fp8 weights on a CPU are dequantized at use: the cost model must not predict fp8 generation there
    faster than unquantized generation (it did when fp8 read 1 byte per weight), only smaller."""
    cpu = TOY_HW.model_copy(update=dict(kind="cpu", peak_fp8_flops=TOY_HW.peak_bf16_flops))
    assert generation_time(TOY, 4, 9, 5, 1, "fp8", cpu, True) == pytest.approx(
        generation_time(TOY, 4, 9, 5, 1, "bf16", cpu, True))
    assert generation_time(TOY, 4, 9, 5, 1, "fp8", TOY_HW, True) < generation_time(TOY, 4, 9, 5, 1, "bf16", TOY_HW, True)
    fp8 = inference_memory(TOY, tp=1, pp=1, precision="fp8", batch=2, context_len=10).params
    assert fp8 < inference_memory(TOY, tp=1, pp=1, precision="bf16", batch=2, context_len=10).params


def test_weight_bytes_keeps_the_rest_at_the_model_dtype() -> None:
    """A float32 model's fp8 generator keeps embedding, head and norms at 4 bytes (as the executors hold
    them), its block linears at 1 byte plus a float32 scale per output row."""
    block = TOY.num_layers * 576  # 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16 per layer
    rest = 2792 - block
    assert weight_bytes(TOY, 1, 4) == block + TOY.num_layers * 64 * 4 + rest * 4
    assert weight_bytes(TOY, 4) == 2792 * 4
