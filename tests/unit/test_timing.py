"""The timing model (`graphrl.compiler.cost.timing`): every timing function against a hand computation (the
arithmetic in the comments) on a toy model small enough to count and a toy device with round figures, the
closed forms against the loops they stand for, and the monotonic trends placement relies on."""

from __future__ import annotations

import random

import pytest

from graphrl.compiler.cost import timing
from graphrl.compiler.cost import UnsupportedPrecisionError
from graphrl.errors import GraphRLError
from graphrl.schemas.hardware import (HARDWARE_PRESETS, EngineThroughput, HardwareSpec, HostFit, MatmulFit,
                                      VocabCost)
from graphrl.schemas.model import MODEL_PRESETS, ModelDims

# A toy decoder small enough to count by hand: hidden 8, 2 heads of head_dim 4, one KV head, 2792 parameters
# (test_cost.py counts them). Its block linears y = x W^T as (k, n): q (8, 8), k and v (8, 4), o (8, 8),
# gate and up (8, 16), down (16, 8): 576 weights, and the k + n of the seven add up to 128. The head is (8, 100).
TOY = ModelDims(
    vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
    max_seq_len=64,
)
# Round figures, all efficiencies 1: 1e12 FLOP/s and 1e11 bytes/s, so the ridge is at 10 FLOP per byte and
# every toy linear is memory-bound; links 1e10 bytes/s within a node, 1e9 across, 1 µs per ring step.
TOY_HW = HardwareSpec(
    name="toy", peak_bf16_flops=1e12, peak_fp8_flops=2e12, memory_bytes=1e10, memory_bandwidth=1e11,
    intra_node_bandwidth=1e10, inter_node_bandwidth=1e9, host_link_bandwidth=1e9, link_latency_s=1e-6,
    compute_efficiency=1.0, memory_efficiency=1.0, link_efficiency=1.0,
)
# The toy's times are counted in U = 1e-11 s, a byte at 1e11 bytes/s (a FLOP is 0.1 U). In bf16 (2 bytes):
#   a linear (k, n) over r rows: max(0.2 r k n, 2 k n + 2 r (k + n)) = 2 k n + 2 r (k + n) U, memory-bound;
#     one layer's seven: 2 * 576 + 2 r * 128 = 1152 + 256 r U;
#   elementwise: 20*8 + 11*8 (q) + 13*4 (kv) + 5*16 = 380 elements per token, 760 r U;
#   attention per key: 4 * 2 heads * 4 = 32 FLOP per query, 3.2 r U; reading its cache in decode,
#     K and V of one head, 2 * 4 * 2 = 16 bytes per query, 16 r U;
#   the head: 2 * 800 + 2 r * 108 = 1600 + 216 r U;
#   float32 work over the 100 logits of a row: 14 (generate), 10 (forward), 20 (train) elements of 4 bytes:
#     5600 r, 4000 r, 8000 r U;
#   AdamW over the 2792 parameters: 19 * 4 bytes each, 212,192 U.
U = 1e-11
# Host figures of a CPU-like description, all different, to see which terms count them.
HOST = dict(layer_overhead_s=1e-4, pass_overhead_s=2e-4, decode_token_overhead_s=1e-6, train_layer_overhead_s=1e-3,
            train_pass_overhead_s=1e-2, data_parallel_layer_overhead_s=1e-5)
HOST_HW = TOY_HW.model_copy(update=HOST)
CPU_HW = TOY_HW.model_copy(update=dict(kind="cpu"))

H100 = HARDWARE_PRESETS["h100-sxm-80gb"]
A100 = HARDWARE_PRESETS["a100-sxm-80gb"]
L8B, L70B, L405B = (MODEL_PRESETS[k] for k in ("llama3-8b", "llama3-70b", "llama3-405b"))


# ---------------------------------------------------------------------------------------- matmuls


def test_matmul_roofline_on_both_sides_of_the_ridge() -> None:
    # 1000 x 1000 bf16 weights (2e6 bytes). One row: 2e6 FLOP take 2e-6 s, but the weights and the 2000
    # activations (4000 bytes) take 2.004e6 / 1e11 = 2.004e-5 s: memory-bound.
    assert timing.matmul_seconds(TOY_HW, 1, 1000, 1000, 2) == pytest.approx(2.004e-5)
    # 100 rows: 2e8 FLOP / 1e12 = 2e-4 s against (2e6 + 100 * 2000 * 2) / 1e11 = 2.4e-5 s: compute-bound.
    assert timing.matmul_seconds(TOY_HW, 100, 1000, 1000, 2) == pytest.approx(2e-4)
    # The efficiencies scale the rates: half of each doubles either side.
    half = TOY_HW.model_copy(update=dict(compute_efficiency=0.5, memory_efficiency=0.5))
    assert timing.matmul_seconds(half, 1, 1000, 1000, 2) == pytest.approx(4.008e-5)
    assert timing.matmul_seconds(half, 100, 1000, 1000, 2) == pytest.approx(4e-4)
    # A kernel's fixed time adds to either side; no rows, no kernel.
    launch = TOY_HW.model_copy(update=dict(kernel_overhead_s=5e-6))
    assert timing.matmul_seconds(launch, 1, 1000, 1000, 2) == pytest.approx(2.504e-5)
    assert timing.matmul_seconds(launch, 100, 1000, 1000, 2) == pytest.approx(2.05e-4)
    assert timing.matmul_seconds(launch, 0, 1000, 1000, 2) == 0.0


# A 100 -> 200 bf16 linear measured at 1, 10 and 100 rows, on a device whose roofline would say otherwise.
FIT = MatmulFit(k=100, n=200, dtype_bytes=2, threads=1, rows=(1, 10, 100), seconds=(1e-6, 2e-6, 2e-5))
MEASURED_HW = TOY_HW.model_copy(update=dict(matmuls=(FIT,), kernel_overhead_s=5e-6))


def test_measured_matmul_is_interpolated_by_rows() -> None:
    # A measured row count: its time, without the kernel overhead (the measurement holds it).
    assert timing.matmul_seconds(MEASURED_HW, 10, 100, 200, 2) == pytest.approx(2e-6)
    # Halfway from 10 to 100 rows: 2e-6 + (2e-5 - 2e-6) * 45 / 90 = 1.1e-5.
    assert timing.matmul_seconds(MEASURED_HW, 55, 100, 200, 2) == pytest.approx(1.1e-5)
    # Past the last row, in proportion to the rows: 2e-5 * 400 / 100.
    assert timing.matmul_seconds(MEASURED_HW, 400, 100, 200, 2) == pytest.approx(8e-5)
    # Below the first row, the first row's time (a kernel does not get cheaper than one row).
    assert timing.matmul_seconds(MEASURED_HW, 0.5, 100, 200, 2) == pytest.approx(1e-6)
    assert timing.matmul_seconds(MEASURED_HW, 0, 100, 200, 2) == 0.0


def test_unmeasured_shape_scales_the_nearest_measured_one_by_k_times_n() -> None:
    big = MatmulFit(k=1000, n=1000, dtype_bytes=2, threads=1, rows=(1, 10, 100), seconds=(1e-4, 2e-4, 1e-3))
    hw = MEASURED_HW.model_copy(update=dict(matmuls=(FIT, big)))
    # 150 x 200 = 3e4 weights is nearer 2e4 than 1e6 (on a log scale): FIT's 10 rows, times 3e4 / 2e4.
    assert timing.matmul_seconds(hw, 10, 150, 200, 2) == pytest.approx(3e-6)
    # 500 x 1000 = 5e5 is nearer 1e6: big's 10 rows, halved; and at 55 rows its interpolation, halved:
    # (2e-4 + 8e-4 * 45 / 90) / 2.
    assert timing.matmul_seconds(hw, 10, 500, 1000, 2) == pytest.approx(1e-4)
    assert timing.matmul_seconds(hw, 55, 500, 1000, 2) == pytest.approx(3e-4)
    # Two measured shapes of the same size: the one of the nearer aspect ratio. For 300 -> 100, 400 -> 100
    # (ratio 4/3 off) beats 100 -> 400 (12 off); 3e4 / 4e4 of its time.
    wide = MatmulFit(k=100, n=400, dtype_bytes=2, threads=1, rows=(1,), seconds=(1e-6,))
    tall = MatmulFit(k=400, n=100, dtype_bytes=2, threads=1, rows=(1,), seconds=(4e-6,))
    hw = TOY_HW.model_copy(update=dict(matmuls=(wide, tall)))
    assert timing.matmul_seconds(hw, 1, 300, 100, 2) == pytest.approx(3e-6)


def test_matmul_of_an_unmeasured_dtype_falls_back_to_the_roofline() -> None:
    # FIT is bf16; a float32 matmul of its shape at 10 rows: 2 * 10 * 2e4 = 4e5 FLOP, 4e-7 s, against
    # (2e4 * 4 + 10 * 300 * 4) / 1e11 = 9.2e-7 s; plus the 5e-6 s kernel.
    assert timing.matmul_seconds(MEASURED_HW, 10, 100, 200, 4) == pytest.approx(9.2e-7 + 5e-6)
    assert timing.matmul_seconds(MEASURED_HW, 10, 100, 200, 2) == pytest.approx(2e-6)


def test_fp8_weights_on_a_cpu_are_dequantized_at_use() -> None:
    """A CPU has no fp8 matmul: its fp8 weight is expanded to the compute dtype first, so an fp8 matmul is
    the unquantized one plus that elementwise pass (1 byte read and 2 written per weight), never faster."""
    # Roofline: bf16's 2.004e-5 s, plus 1e6 weights * 3 bytes / 1e11 = 3e-5 s.
    assert timing.matmul_seconds(CPU_HW, 1, 1000, 1000, 2, "fp8") == pytest.approx(2.004e-5 + 3e-5)
    # Measured: FIT's 2e-6 s at 10 rows, plus 2e4 * 3 / 1e11 = 6e-7 s.
    measured_cpu = MEASURED_HW.model_copy(update=dict(kind="cpu"))
    assert timing.matmul_seconds(measured_cpu, 10, 100, 200, 2, "fp8") == pytest.approx(2.6e-6)


def test_fp8_weights_on_fp8_tensor_cores() -> None:
    # The toy GPU: the fp8 peak (2e12) and one-byte weights. 100 rows: 2e8 / 2e12 = 1e-4 s (bf16: 2e-4);
    # 1 row: (1e6 + 4000) / 1e11 = 1.004e-5 s (bf16: 2.004e-5).
    assert timing.matmul_seconds(TOY_HW, 100, 1000, 1000, 2, "fp8") == pytest.approx(1e-4)
    assert timing.matmul_seconds(TOY_HW, 1, 1000, 1000, 2, "fp8") == pytest.approx(1.004e-5)
    # bf16 measurements do not time an fp8 matmul: the roofline, 2 * 10 * 2e4 / 2e12 = 2e-7 s against
    # (2e4 + 10 * 300 * 2) / 1e11 = 2.6e-7 s, plus the kernel.
    assert timing.matmul_seconds(MEASURED_HW, 10, 100, 200, 2, "fp8") == pytest.approx(2.6e-7 + 5e-6)
    # The H100 preset: 1979 TFLOP/s at half efficiency, 3.35 TB/s at 0.7.
    flops = 2 * 4096 * 8192 * 8192
    assert timing.matmul_seconds(H100, 4096, 8192, 8192, 2, "fp8") == pytest.approx(flops / (1979e12 * 0.5))
    weights_and_activations = 8192 * 8192 * 1 + 1 * (8192 + 8192) * 2
    assert timing.matmul_seconds(H100, 1, 8192, 8192, 2, "fp8") == pytest.approx(
        weights_and_activations / (3.35e12 * 0.7))


def test_fp8_on_hardware_without_fp8_is_an_error() -> None:
    for call in (lambda: timing.matmul_seconds(A100, 1, 8192, 8192, 2, "fp8"),
                 lambda: timing.generation_time(L8B, 8, 128, 128, 1, "fp8", A100, True),
                 lambda: timing.forward_time(L8B, tokens=1024, seq_len=128, hw=A100, precision="fp8")):
        with pytest.raises(UnsupportedPrecisionError) as info:
            call()
        assert isinstance(info.value, ValueError) and isinstance(info.value, GraphRLError)
        assert "fix" in str(info.value)


def test_elementwise_seconds_and_rates() -> None:
    # 1e9 bytes at the effective memory bandwidth (1e11), else at the fitted elementwise bandwidth.
    assert timing.elementwise_seconds(TOY_HW, 1e9) == pytest.approx(1e-2)
    fitted = TOY_HW.model_copy(update=dict(elementwise_bandwidth=5e10))
    assert timing.elementwise_seconds(fitted, 1e9) == pytest.approx(2e-2)
    # A backward moves twice a forward's bytes: half the rate, unless fitted.
    assert TOY_HW.backward_elementwise_rate == 5e10 and fitted.backward_elementwise_rate == 2.5e10
    assert fitted.model_copy(update=dict(backward_elementwise_bandwidth=1e10)).backward_elementwise_rate == 1e10


# ---------------------------------------------------------------------------------------- one layer


def test_layer_matmul_shapes_under_tensor_parallelism() -> None:
    """Column-parallel linears (q, k, v, gate, up) split n, row-parallel ones (o, down) split k. A generator
    with more shards than KV heads replicates each KV head (executors/tensor_parallel.py): its k and v
    projections compute whole heads, which the timing model used to split by tp all the same."""
    assert timing.layer_matmul_shapes(TOY, 1) == ((8, 8), (8, 4), (8, 4), (8, 8), (8, 16), (8, 16), (16, 8))
    # tp 2: the one KV head stays whole on both ranks.
    assert timing.layer_matmul_shapes(TOY, 2) == ((8, 4), (8, 4), (8, 4), (4, 8), (8, 8), (8, 8), (8, 8))
    # llama3-8b: 32 heads and 8 KV heads of 128, feed-forward 14336. tp 8: one KV head per rank.
    assert timing.layer_matmul_shapes(L8B, 8) == (
        (4096, 512), (4096, 128), (4096, 128), (512, 4096), (4096, 1792), (4096, 1792), (1792, 4096))
    # tp 16 (generation only): every KV head on two ranks.
    assert timing.layer_matmul_shapes(L8B, 16) == (
        (4096, 256), (4096, 128), (4096, 128), (256, 4096), (4096, 896), (4096, 896), (896, 4096))


def test_layer_linear_seconds_and_elementwise_bytes() -> None:
    # tp 1, 10 rows: 1152 + 256 * 10 = 3712 U.
    assert timing.layer_linear_seconds(TOY, TOY_HW, 10, 1, 2) == pytest.approx(3712 * U)
    # tp 2: k n = 32 + 32 + 32 + 32 + 64 * 3 = 320, k + n = 12 * 4 + 16 * 3 = 96: 640 + 192 * 10 = 2560 U.
    assert timing.layer_linear_seconds(TOY, TOY_HW, 10, 2, 2) == pytest.approx(2560 * U)
    # The sum of the seven matmuls, measured or not.
    assert timing.layer_linear_seconds(TOY, MEASURED_HW, 7, 2, 2) == pytest.approx(
        sum(timing.matmul_seconds(MEASURED_HW, 7, k, n, 2) for k, n in timing.layer_matmul_shapes(TOY, 2)))
    # 10 tokens * 380 elements * 2 bytes; tp 2 halves q and the feed-forward but not the norms, nor the
    # one KV head: 20*8 + 11*4 + 13*4 + 5*8 = 296 elements.
    assert timing.layer_elementwise_bytes(TOY, 10, 1, 2) == 7600
    assert timing.layer_elementwise_bytes(TOY, 10, 2, 2) == 5920
    assert timing.layer_elementwise_bytes(TOY, 10, 1, 4) == 15200


def test_attention_seconds_per_key() -> None:
    # 10 queries: 10 * 32 FLOP / 1e12 per key; reading the cache, 10 * 16 bytes / 1e11 per key.
    assert timing.attention_seconds_per_key(TOY, TOY_HW, 10, 1, 2, read_kv=False) == pytest.approx((3.2e-10, 0.0))
    assert timing.attention_seconds_per_key(TOY, TOY_HW, 10, 1, 2, read_kv=True) == pytest.approx((3.2e-10, 1.6e-9))
    # tp 2: one query head per rank, but the one KV head is read whole by both.
    assert timing.attention_seconds_per_key(TOY, TOY_HW, 10, 2, 2, read_kv=True) == pytest.approx((1.6e-10, 1.6e-9))
    # A one-byte cache reads half.
    assert timing.attention_seconds_per_key(TOY, TOY_HW, 10, 1, 1, read_kv=True)[1] == pytest.approx(8e-10)


# ---------------------------------------------------------------------------------------- vocabulary, head, optimizer


def test_vocab_seconds_measured_or_by_element_count() -> None:
    # No measurement: 10 rows * 100 entries * (14, 10, 20) float32 elements / 1e11.
    assert timing.vocab_seconds(TOY_HW, 10, 100, "generate") == pytest.approx(5.6e-7)
    assert timing.vocab_seconds(TOY_HW, 10, 100, "forward") == pytest.approx(4e-7)
    assert timing.vocab_seconds(TOY_HW, 10, 100, "train") == pytest.approx(8e-7)
    # Measured per entry: the nearest vocabulary on a log scale, 2000 -> 1000 and 50,000 -> 100,000.
    hw = TOY_HW.model_copy(update=dict(vocab=(
        VocabCost(vocab_size=1000, generate=1e-9, forward=2e-9, train=3e-9),
        VocabCost(vocab_size=100_000, generate=1e-8, forward=2e-8, train=3e-8),
    )))
    assert timing.vocab_seconds(hw, 10, 2000, "generate") == pytest.approx(10 * 2000 * 1e-9)
    assert timing.vocab_seconds(hw, 10, 2000, "train") == pytest.approx(10 * 2000 * 3e-9)
    assert timing.vocab_seconds(hw, 10, 50_000, "forward") == pytest.approx(10 * 50_000 * 2e-8)


def test_head_seconds() -> None:
    # 10 rows: the head's matmul 1600 + 2160 U and the forward's log-softmax 40,000 U.
    assert timing.head_seconds(TOY, TOY_HW, 10, 1, 2, "forward") == pytest.approx(43_760 * U)
    # tp 3: 34 of the 100 entries on the first rank (rounded up): (8, 34) is 2 * 272 + 2 * 10 * 42 = 1384 U,
    # and 10 * 34 * 40 = 13,600 U.
    assert timing.head_seconds(TOY, TOY_HW, 10, 3, 2, "forward") == pytest.approx(14_984 * U)


def test_optimizer_seconds_measured_or_by_bytes() -> None:
    # 2792 parameters * 19 float32 elements * 4 bytes / 1e11, or 1 ns each as measured.
    assert timing.optimizer_seconds(TOY_HW, 2792) == pytest.approx(212_192 * U)
    assert timing.optimizer_seconds(TOY_HW.model_copy(update=dict(optimizer_param_s=1e-9)), 2792) == pytest.approx(2.792e-6)


# ---------------------------------------------------------------------------------------- one pass


def _pass(**kw: object) -> float:
    args: dict = dict(tokens=10, keys=10, head_rows=10, tp=1, dtype_bytes=2, use="forward")
    args.update(kw)
    return timing.pass_compute_seconds(TOY, TOY_HW, **args)


def test_forward_pass_by_hand() -> None:
    # 10 tokens over 10 keys, per layer: linears 3712 + attention 3.2 * 10 * 10 + elementwise 7600 = 11,632 U;
    # two layers 23,264; the head over 10 rows 43,760.
    assert _pass() == pytest.approx(67_024 * U)
    # The head over 4 rows: 1600 + 864 + 16,000.
    assert _pass(head_rows=4) == pytest.approx((23_264 + 18_464) * U)
    # One layer (a pipeline stage's share).
    assert _pass(layers=1) == pytest.approx((11_632 + 43_760) * U)


def test_training_pass_by_hand() -> None:
    # Per layer: the forward's 11,632 U, and a backward of twice its matmuls and attention, 2 * (3712 + 320),
    # with its elementwise bytes at half the rate, 2 * 7600: 23,264 U. Two layers: 69,792 U. The head's matmul
    # three times, 3 * 3760, and the training pass's work over the logits, 80,000 U.
    assert _pass(use="train") == pytest.approx(161_072 * U)
    # Recompute runs each layer's forward again: 2 * 11,632 more.
    assert _pass(use="train", recompute=True) == pytest.approx((161_072 + 23_264) * U)


# ---------------------------------------------------------------------------------------- generation


def test_generation_time_by_hand() -> None:
    # batch 1, prompt 9, response 3, tp 1, bf16.
    # prefill over 9 tokens, per layer: linears 1152 + 256 * 9 = 3456, elementwise 6840, attention 3.2 * 9 per
    #   key over 9 keys = 259.2: 10,555.2; two layers 21,110.4; the head over the last position 1816 and
    #   sampling 5600: 28,526.4 U.
    # 2 decode steps (the prefill samples the first token), each: per layer 1152 + 256 + 760 = 2168, two
    #   layers 4336, head and sampling 7416: 11,752 U; their attention reads the cache (16 U per key, more
    #   than its 3.2 U of FLOPs) over 10 and 11 keys in both layers: 2 * 16 * 21 = 672 U.
    expected = (28_526.4 + 2 * 11_752 + 672) * U
    assert timing.generation_time(TOY, 1, 9, 3, 1, "bf16", TOY_HW, True) == pytest.approx(expected)
    # Host: 3 passes * (2 layers * 1e-4 + 2e-4), and 1e-6 per generated token and layer: 3 * 2 * 1e-6.
    assert timing.generation_time(TOY, 1, 9, 3, 1, "bf16", HOST_HW, True) == pytest.approx(expected + 1.2e-3 + 6e-6)


def test_decode_step_by_hand() -> None:
    # batch 1 over 10 keys: per layer 2168 + 16 * 10; two layers and the head with sampling, 7416.
    assert timing.decode_step_cost(TOY, 1, 10, 1, TOY_HW) == pytest.approx(12_072 * U)
    # Host time is generation_time's, not a step's.
    assert timing.decode_step_cost(TOY, 1, 10, 1, HOST_HW) == pytest.approx(12_072 * U)


def test_decode_step_tensor_parallel() -> None:
    # tp 2, batch 2 over 10 keys, per layer: linears 640 + 192 * 2 = 1024, elementwise 296 * 2 * 2 = 1184, the
    #   whole KV head read by both ranks 16 * 2 * 10 = 320: 2528; two layers 5056. The head's 50 entries:
    #   (8, 50) is 800 + 2 * 2 * 58 = 1032, sampling 2 * 50 * 56 = 5600. 11,688 U.
    # comm: the embedding's and 2 layers * 2 all-reduces of batch * H * 2 = 32 bytes over 2 ranks:
    #   2 * (1/2) * 32 / 1e10 + 2 * 1e-6 = 2.0032e-6 each, 5 of them 1.0016e-5; the all-gather of
    #   batch * V * 4 = 800 bytes of logits: (1/2) * 800 / 1e10 + 1e-6 = 1.04e-6.
    compute = 11_688 * U
    assert timing.decode_step_cost(TOY, 2, 10, 2, TOY_HW) == pytest.approx(compute + 1.0016e-5 + 1.04e-6)
    # Across nodes the bandwidth term is 10x: 32 / 1e9 + 2e-6 = 2.032e-6 each, 400 / 1e9 + 1e-6.
    assert timing.decode_step_cost(TOY, 2, 10, 2, TOY_HW, intra_node=False) == pytest.approx(
        compute + 5 * 2.032e-6 + 1.4e-6)


def test_generation_time_matches_looping_over_steps() -> None:
    """The closed form is the prefill (`generation_time` of one token) plus `decode_step_cost` of every
    further step, plus the host time of each further pass and token."""
    cpu = HARDWARE_PRESETS["cpu-local"]
    hosted_h100 = H100.model_copy(update=HOST)
    cases = [(L405B, hosted_h100, 64, 1024, 1024, 8, "fp8"), (L405B, hosted_h100, 512, 16, 4096, 8, "fp8"),
             (TOY, HOST_HW, 1, 100, 50, 1, "bf16"), (L8B, cpu, 4, 16, 32, 2, "bf16")]
    for dims, hw, batch, prompt, response, tp, precision in cases:
        prefill = timing.generation_time(dims, batch, prompt, 1, tp, precision, hw, True)  # type: ignore[arg-type]
        steps = response - 1
        looped = prefill + sum(
            timing.decode_step_cost(dims, batch, prompt + j, tp, hw, precision=precision)  # type: ignore[arg-type]
            for j in range(1, response)
        )
        looped += steps * (dims.num_layers * hw.layer_overhead_s + hw.pass_overhead_s)
        looped += batch * steps * dims.num_layers * hw.decode_token_overhead_s
        closed = timing.generation_time(dims, batch, prompt, response, tp, precision, hw, True)  # type: ignore[arg-type]
        assert closed == pytest.approx(looped, rel=1e-9)


def test_sum_max_linear_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(200):
        a1, b1, a2, b2 = (rng.uniform(-5, 5) for _ in range(4))
        lo = rng.randint(-20, 20)
        hi = lo + rng.randint(-1, 40)
        brute = sum(max(a1 + b1 * c, a2 + b2 * c) for c in range(lo, hi + 1))
        assert timing._sum_max_linear(a1, b1, a2, b2, lo, hi) == pytest.approx(brute, abs=1e-9)


def test_fp8_generation_on_a_cpu_costs_the_dequantization() -> None:
    """fp8 weights on a CPU are dequantized at use: fp8 generation there is never predicted faster than
    unquantized generation (it was when fp8 read 1 byte per weight). On a GPU it is faster."""
    # 5 passes (prefill + 4 steps) * 2 layers * 576 block weights * 3 bytes / 1e11 (the head is not fp8).
    bf16 = timing.generation_time(TOY, 4, 9, 5, 1, "bf16", CPU_HW, True)
    assert timing.generation_time(TOY, 4, 9, 5, 1, "fp8", CPU_HW, True) == pytest.approx(bf16 + 5 * 3456 * U)
    assert timing.generation_time(TOY, 4, 9, 5, 1, "fp8", TOY_HW, True) < timing.generation_time(
        TOY, 4, 9, 5, 1, "bf16", TOY_HW, True)


def test_generation_faster_with_more_tp_and_slower_across_nodes() -> None:
    """Decode reads the weights every step, so tp divides that time, but each step also pays
    2 * layers + 1 tp all-reduces (and a logits all-gather) whose ring latency 2(n-1)*alpha grows with tp:
    with the presets' 10 us per ring step, tp=8 is not faster than tp=4 for 70B; with 1 us it is."""
    times = [timing.generation_time(L70B, 32, 512, 512, tp, "bf16", H100, True) for tp in (1, 2, 4, 8)]
    assert times[0] > times[1] > times[2] < times[3]
    fast_links = H100.model_copy(update={"link_latency_s": 1e-6})
    times = [timing.generation_time(L70B, 32, 512, 512, tp, "bf16", fast_links, True) for tp in (2, 4, 8)]
    assert times[0] > times[1] > times[2]
    assert timing.generation_time(L70B, 32, 512, 512, 8, "bf16", fast_links, False) > times[2]
    assert timing.generation_time(L70B, 32, 512, 512, 8, "fp8", fast_links, True) < times[2]


# ---------------------------------------------------------------------------------------- training


def _toy_step(**kw: object) -> timing.StepCost:
    args: dict = dict(
        tokens=10, seq_len=10, dp=1, fsdp=1, tp=1, pp=1, sharding="none", recompute=False, hw=TOY_HW,
        intra_node_tp=True, dp_spans_nodes=False, microbatches=1,
    )
    args.update(kw)
    return timing.training_step_time(TOY, **args)


def test_training_step_single_device() -> None:
    # The training pass over 10 tokens, 161,072 U, and AdamW over all 2792 parameters, 212,192 U.
    assert _toy_step() == timing.StepCost(373_264 * U, 0.0, 0.0, 0.0, 373_264 * U)
    # The head over 4 of the tokens changes only the head: 3 * (1600 + 216 * 4) + 8000 * 4 = 39,392 U
    # where 10 rows cost 3 * 3760 + 80,000 = 91,280.
    assert _toy_step(head_rows=4).total_s == pytest.approx((373_264 - 91_280 + 39_392) * U)


def test_training_compute_is_the_micro_batches_and_the_optimizer() -> None:
    """compute = m * pass_compute_seconds of one micro-batch + optimizer_seconds of the rank's parameters
    (sharded over the data-parallel group except for DDP)."""
    for sharding, local_params in (("none", 2792), ("zero1", 1396), ("zero2", 1396), ("fsdp", 1396)):
        step = _toy_step(tokens=80, dp=2, microbatches=4, sharding=sharding, recompute=True, head_rows=40)
        micro_batch = timing.pass_compute_seconds(TOY, TOY_HW, tokens=10, keys=10, head_rows=5, tp=1, dtype_bytes=2,
                                                  use="train", recompute=True)
        assert step.compute_s == pytest.approx(4 * micro_batch + timing.optimizer_seconds(TOY_HW, local_params))


def test_training_step_ddp_by_hand() -> None:
    # dp 2, 10 tokens per rank: compute as on one device, 3.73264e-6 s.
    # The grads' all-reduce, 2792 * 2 = 5584 bytes in one bucket over 2: 2 * (1/2) * 5584 / 1e10 + 2e-6
    #   = 2.5584e-6; one layer's share (of 2) is exposed, 1.2792e-6, the rest hides behind the backward
    #   (2/3 of compute = 2.488e-6).
    # The update's all-reduce of its token counts (24 bytes): 24 / 1e10 + 2e-6 = 2.0024e-6, exposed.
    cost = _toy_step(tokens=20, dp=2)
    assert cost.compute_s == pytest.approx(373_264 * U)
    assert cost.comm_s == pytest.approx(2.5584e-6 + 2.0024e-6)
    assert cost.exposed_comm_s == pytest.approx(1.2792e-6 + 2.0024e-6)
    assert cost.total_s == pytest.approx(373_264 * U + 1.2792e-6 + 2.0024e-6)
    # With micro-batches the update also all-reduces their count: a second 2.0024e-6.
    assert _toy_step(tokens=80, dp=2, microbatches=4).comm_s == pytest.approx(2.5584e-6 + 2 * 2.0024e-6)


def test_training_host_time() -> None:
    # Per micro-batch: 2 layers * 1e-3 + 1e-2; recompute adds each layer's forward host time (1e-4); a
    # data-parallel rank its 1e-5 per layer. None of it on the GPU presets.
    def host(**kw: object) -> float:
        return _toy_step(hw=HOST_HW, **kw).total_s - _toy_step(**kw).total_s

    assert host() == pytest.approx(1.2e-2)
    assert host(microbatches=4, tokens=40) == pytest.approx(4 * 1.2e-2)
    assert host(recompute=True) == pytest.approx(1.22e-2)
    assert host(dp=2, tokens=20) == pytest.approx(1.202e-2)
    assert _toy_step(hw=HOST_HW).compute_s == pytest.approx(373_264 * U + 1.2e-2)


def test_fsdp_moves_one_and_a_half_times_ddp_bytes() -> None:
    # all-gather twice + reduce-scatter = 3 (n-1) steps of b/n vs all-reduce's 2 (n-1); the update's two
    # all-reduces of its counts (4 micro-batches) are the same for both.
    no_latency = TOY_HW.model_copy(update={"link_latency_s": 0.0})
    counts = 2 * timing.collective_time("all_reduce", 24, 8, no_latency, False)
    kw: dict = dict(dp=8, tokens=320, microbatches=4, hw=no_latency)
    ddp = _toy_step(**kw).comm_s - counts
    assert _toy_step(**kw, sharding="fsdp").comm_s - counts == pytest.approx(1.5 * ddp)
    assert _toy_step(**kw, sharding="zero2").comm_s - counts == pytest.approx(ddp)


def test_fsdp_pays_latency_per_unit() -> None:
    """FSDP2 gathers and reduces a unit at a time (`fsdp_layer_units`), so each of its three collectives per
    step pays (n-1) latency steps per unit; DDP's one bucket pays 2 (n-1) once. Both pay the update's two
    small all-reduces, 2 (n-1) each. TOY is smaller than one unit; a wide model's layers (over
    FSDP_UNIT_BYTES each) are a unit each, with the root."""
    no_latency = TOY_HW.model_copy(update={"link_latency_s": 0.0})
    alpha, n = TOY_HW.link_latency_s, 8
    kw: dict = dict(dp=n, tokens=320, microbatches=4)
    fsdp = _toy_step(**kw, sharding="fsdp").comm_s - _toy_step(**kw, sharding="fsdp", hw=no_latency).comm_s
    ddp = _toy_step(**kw).comm_s - _toy_step(**kw, hw=no_latency).comm_s
    assert fsdp == pytest.approx((3 * 1 + 4) * (n - 1) * alpha)
    assert ddp == pytest.approx((2 + 4) * (n - 1) * alpha)
    wide = ModelDims(vocab_size=1000, hidden_size=2048, intermediate_size=4096, num_layers=3, num_heads=16,
                     num_kv_heads=16, max_seq_len=64)  # 84 MB a layer in bf16
    args: dict = dict(tokens=320, seq_len=10, dp=n, fsdp=1, tp=1, pp=1, sharding="fsdp", recompute=False,
                      intra_node_tp=True, dp_spans_nodes=False, microbatches=4)
    wide_fsdp = (timing.training_step_time(wide, hw=TOY_HW, **args).comm_s
                 - timing.training_step_time(wide, hw=no_latency, **args).comm_s)
    assert wide_fsdp == pytest.approx((3 * (3 + 1) + 4) * (n - 1) * alpha)


def test_zero_weight_gather_after_the_step_is_exposed() -> None:
    gather = timing.collective_time("all_gather", 2792 * 2, 8, TOY_HW, False)
    assert _toy_step(dp=8, tokens=80, sharding="zero1").exposed_comm_s >= gather


def test_training_step_pipeline_by_hand() -> None:
    # pp 2, 2 micro-batches of 10 tokens. A stage runs one layer, 34,896 U, and is charged the head's 91,280
    #   (the last stage's); twice: 252,352 U. AdamW over its half of the parameters, 106,096 U: 358,448 U.
    # Its sends, activations forward and gradients back, per micro-batch: 10 * 8 * 2 = 160 bytes,
    #   160 / 1e9 + 1e-6 = 1.16e-6 across nodes, 4 of them, on the critical path.
    # The bubble: (pp - 1) / m of the critical path, (3.58448e-6 + 4.64e-6) / 2.
    cost = _toy_step(tokens=20, pp=2, microbatches=2)
    assert cost.compute_s == pytest.approx(358_448 * U)
    assert cost.comm_s == cost.exposed_comm_s == pytest.approx(4.64e-6)
    assert cost.bubble_s == pytest.approx((3.58448e-6 + 4.64e-6) / 2)
    assert cost.total_s == pytest.approx(3.58448e-6 + 4.64e-6 + 4.11224e-6)
    # Within a node: 160 / 1e10 + 1e-6 per send.
    assert _toy_step(tokens=20, pp=2, microbatches=2, pp_spans_nodes=False).comm_s == pytest.approx(4 * 1.016e-6)


def test_pipeline_bubble_fraction() -> None:
    # everything on the critical path stretches by (m + pp - 1)/m: bubble / total = 3/19 for pp=4, m=16
    kw: dict = dict(tokens=2**20, seq_len=4096, dp=1, fsdp=1, tp=1, pp=4, sharding="none", recompute=True,
                    hw=H100, intra_node_tp=True, dp_spans_nodes=False)
    cost = timing.training_step_time(L70B, **kw)
    assert cost.bubble_s / cost.total_s == pytest.approx(3 / 19)
    fewer = timing.training_step_time(L70B, **kw, microbatches=4)
    assert fewer.bubble_s / fewer.total_s == pytest.approx(3 / 7)


def test_training_step_tensor_parallel_by_hand() -> None:
    # tp 2: 2 all-reduces per layer in forward and 2 in backward of 10 * 8 * 2 = 160 bytes over 2 ranks,
    # 160 / 1e10 + 2e-6 = 2.016e-6 each, 8 for the two layers, on the critical path; recompute reruns the
    # forward's 2 per layer: 12.
    split = _toy_step(tp=2)
    assert split.comm_s == split.exposed_comm_s == pytest.approx(8 * 2.016e-6)
    assert _toy_step(tp=2, recompute=True).comm_s == pytest.approx(12 * 2.016e-6)
    # Across nodes: 160 / 1e9 + 2e-6.
    assert _toy_step(tp=2, intra_node_tp=False).comm_s == pytest.approx(8 * 2.16e-6)
    # The rank's compute: its half of the layers' work, and AdamW over half the parameters.
    assert split.compute_s == pytest.approx(
        timing.pass_compute_seconds(TOY, TOY_HW, tokens=10, keys=10, head_rows=10, tp=2, dtype_bytes=2, use="train")
        + timing.optimizer_seconds(TOY_HW, 1396))


def test_tp_across_nodes_is_much_slower() -> None:
    kw: dict = dict(tokens=2**21, seq_len=4096, dp=1, fsdp=8, tp=16, pp=1, sharding="fsdp", recompute=True, hw=H100,
                    dp_spans_nodes=True)
    inside = timing.training_step_time(L405B, **kw, intra_node_tp=True)
    across = timing.training_step_time(L405B, **kw, intra_node_tp=False)
    assert across.total_s > 2 * inside.total_s
    assert across.compute_s == inside.compute_s


def test_more_devices_less_compute_per_device() -> None:
    kw: dict = dict(tokens=2**20, seq_len=4096, fsdp=1, pp=1, sharding="fsdp", recompute=False, hw=H100,
                    intra_node_tp=True, dp_spans_nodes=True)
    small = timing.training_step_time(L8B, dp=8, tp=1, **kw)
    big = timing.training_step_time(L8B, dp=16, tp=1, **kw)
    assert big.compute_s == pytest.approx(small.compute_s / 2)
    assert big.total_s < small.total_s


# ---------------------------------------------------------------------------------------- forward passes


def test_forward_time_by_hand() -> None:
    # One micro-batch: the forward pass over 10 tokens, 67,024 U; no communication.
    one = timing.forward_time(TOY, tokens=10, seq_len=10, hw=TOY_HW, microbatches=1)
    assert one == timing.StepCost(67_024 * U, 0.0, 0.0, 0.0, 67_024 * U)
    # 4 micro-batches of 2.5 tokens, each: per layer 1152 + 640 + 3.2 * 2.5 * 10 + 1900 = 3772, two layers 7544,
    # head 1600 + 540 and its log-softmax 10,000: 19,684 U. Every micro-batch reads the weights again.
    assert timing.forward_time(TOY, tokens=10, seq_len=10, hw=TOY_HW).total_s == pytest.approx(4 * 19_684 * U)
    # The head over 4 rows changes only the head: 41,728 U.
    assert timing.forward_time(TOY, tokens=10, seq_len=10, hw=TOY_HW, microbatches=1, head_rows=4).total_s == (
        pytest.approx(41_728 * U))
    # Host: 2 layers * 1e-4 + 2e-4 per micro-batch.
    hosted = timing.forward_time(TOY, tokens=10, seq_len=10, hw=HOST_HW, microbatches=1)
    assert hosted.total_s == pytest.approx(67_024 * U + 4e-4)


def test_forward_time_communication() -> None:
    # fsdp 2: a frozen model's bf16 weights (5584 bytes) gathered layer by layer (its 2 layers, each an FSDP2
    # root) over 2 ranks: 2 * ((1/2) * (5584/2) / 1e10 + 1e-6) = 2.2792e-6. One layer's share (1.1396e-6) is
    # exposed and the rest hides behind the 67,024 U of compute only in part: exposed 1.1396e-6 +
    # (1.1396e-6 - 6.7024e-7), so the step takes the gather's time.
    sharded = timing.forward_time(TOY, tokens=20, seq_len=10, hw=TOY_HW, fsdp=2, microbatches=1)
    assert sharded.comm_s == pytest.approx(2.2792e-6)
    assert sharded.exposed_comm_s == pytest.approx(2.2792e-6 - 67_024 * U)
    assert sharded.total_s == pytest.approx(2.2792e-6)
    # The trained model's own forward: one unit, embedding and head with it (smaller than one unit).
    own = timing.forward_time(TOY, tokens=20, seq_len=10, hw=TOY_HW, fsdp=2, microbatches=1, trained=True)
    assert own.comm_s == pytest.approx(1.2792e-6)
    # dp alone gathers nothing; nor does a trainer's own forward under DDP on an fsdp axis (not sharded),
    # while a frozen model sharded over data-parallel ranks does, and pays FSDP2's host time per unit.
    assert timing.forward_time(TOY, tokens=20, seq_len=10, hw=TOY_HW, dp=2, microbatches=1).comm_s == 0.0
    ddp = timing.forward_time(TOY, tokens=20, seq_len=10, hw=TOY_HW, fsdp=2, microbatches=1, sharded=False)
    assert ddp.comm_s == 0.0
    frozen = timing.forward_time(TOY, tokens=20, seq_len=10, hw=TOY_HW, dp=2, microbatches=1, sharded=True)
    assert frozen.comm_s == pytest.approx(2.2792e-6)
    hooks = TOY_HW.model_copy(update=dict(sharded_forward_unit_overhead_s=1e-3))
    assert (timing.forward_time(TOY, tokens=20, seq_len=10, hw=hooks, dp=2, microbatches=2, sharded=True).total_s
            - timing.forward_time(TOY, tokens=20, seq_len=10, hw=TOY_HW, dp=2, microbatches=2, sharded=True).total_s
            == pytest.approx(2 * 2 * 1e-3))  # 2 micro-batches x 2 units (a frozen model's layers)
    # tp 2: 2 all-reduces per layer of 10 * 8 * 2 = 160 bytes: 4 * (160 / 1e10 + 2e-6), on the critical path.
    split = timing.forward_time(TOY, tokens=10, seq_len=10, hw=TOY_HW, tp=2, microbatches=1)
    assert split.comm_s == split.exposed_comm_s == pytest.approx(4 * 2.016e-6)
    assert split.compute_s == pytest.approx(timing.pass_compute_seconds(
        TOY, TOY_HW, tokens=10, keys=10, head_rows=10, tp=2, dtype_bytes=2, use="forward"))


def test_forward_cheaper_than_training() -> None:
    kw: dict = dict(tokens=2**20, seq_len=4096, hw=H100, dp=8, tp=1, pp=1)
    fwd = timing.forward_time(L8B, **kw)
    train = timing.training_step_time(L8B, **kw, fsdp=1, sharding="none", recompute=False, intra_node_tp=True,
                                      dp_spans_nodes=False)
    assert fwd.compute_s == pytest.approx(train.compute_s / 3, rel=0.01)


# ---------------------------------------------------------------------------------------- collectives and copies


def test_collective_time_ring_formulas() -> None:
    b = 1e8
    # n=4, one node: bw 1e10, alpha 1e-6
    assert timing.collective_time("all_gather", b, 4, TOY_HW, False) == pytest.approx(3 / 4 * 1e-2 + 3e-6)
    assert timing.collective_time("reduce_scatter", b, 4, TOY_HW, False) == pytest.approx(3 / 4 * 1e-2 + 3e-6)
    assert timing.collective_time("all_reduce", b, 4, TOY_HW, False) == pytest.approx(2 * 3 / 4 * 1e-2 + 6e-6)
    assert timing.collective_time("broadcast", b, 4, TOY_HW, False) == pytest.approx(1e-2 + 3e-6)
    assert timing.collective_time("p2p", b, 2, TOY_HW, False) == pytest.approx(1e-2 + 1e-6)
    # across nodes: bw 1e9 -> 2 * 3/4 * 0.1 + 6e-6
    assert timing.collective_time("all_reduce", b, 4, TOY_HW, True) == pytest.approx(0.15 + 6e-6)
    # link_efficiency 0.5 halves the bandwidth: 3/4 * 1e8 / 5e9 + 3e-6
    slow = TOY_HW.model_copy(update={"link_efficiency": 0.5})
    assert timing.collective_time("all_gather", b, 4, slow, False) == pytest.approx(0.015 + 3e-6)
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "p2p"):
        assert timing.collective_time(kind, b, 1, TOY_HW, True) == 0.0  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        timing.collective_time("all_to_all", b, 4, TOY_HW, False)  # type: ignore[arg-type]


def test_chunked_collective_pays_latency_per_call() -> None:
    # 3 all-gathers of a third each over 4: the same 3/4 * 1e-2 of bytes, 3 * 3e-6 of latency.
    assert timing.chunked_collective_time("all_gather", 1e8, 3, 4, TOY_HW, False) == pytest.approx(7.5e-3 + 9e-6)
    assert timing.chunked_collective_time("all_gather", 1e8, 0, 4, TOY_HW, False) == pytest.approx(7.5e-3 + 3e-6)


def test_group_spans_nodes() -> None:
    assert not timing.group_spans_nodes([0, 1, 2, 3], 4)
    assert timing.group_spans_nodes([3, 4], 4)
    assert not timing.group_spans_nodes([8, 9, 15], 8)
    assert not timing.group_spans_nodes([], 8)


def test_offload_time() -> None:
    assert timing.offload_time(2e9, TOY_HW) == pytest.approx(2.0)  # 2e9 bytes / 1e9 bytes/s


def test_point_to_point_and_weight_copies() -> None:
    # bytes / link + latency: 1e8 / 1e10 + 1e-6 within a node, 1e8 / 1e9 + 1e-6 across.
    assert timing.p2p_seconds(TOY_HW, 1e8, False) == pytest.approx(1e-2 + 1e-6)
    assert timing.p2p_seconds(TOY_HW, 1e8, True) == pytest.approx(1e-1 + 1e-6)
    # A copy in two rounds, each its largest bucket: 1e-2 + 1e-6 and 5e-3 + 1e-6.
    assert timing.weight_copy_seconds(TOY_HW, [1e8, 5e7], False) == pytest.approx(1.5e-2 + 2e-6)
    assert timing.weight_copy_seconds(TOY_HW, [], False) == 0.0


def test_engine_time_factor() -> None:
    measured = EngineThroughput(engine="vllm", tokens_per_s=400.0, native_tokens_per_s=100.0, probe="test")
    hw = TOY_HW.model_copy(update=dict(engines=(measured,)))
    assert timing.engine_time_factor(hw, "vllm") == 0.25
    assert timing.engine_time_factor(hw, "native") == 1.0 and timing.engine_time_factor(TOY_HW, "vllm") == 1.0


# ---------------------------------------------------------------------------------------- a rank's description


def _host_fit(hidden_size: int, threads: int, layer_overhead_s: float) -> HostFit:
    return HostFit(hidden_size=hidden_size, threads=threads, layer_overhead_s=layer_overhead_s, pass_overhead_s=2e-4,
                   decode_token_overhead_s=3e-6, train_layer_overhead_s=4e-4, train_pass_overhead_s=5e-4,
                   data_parallel_layer_overhead_s=6e-5, sharded_unit_overhead_s=0.0, tensor_parallel_layer_overhead_s=0.0,
                   elementwise_bandwidth=7e9, backward_elementwise_bandwidth=8e9)


def test_for_rank_picks_the_fits_of_its_threads_and_width() -> None:
    one = MatmulFit(k=8, n=8, dtype_bytes=2, threads=1, rows=(1,), seconds=(1e-6,))
    two = MatmulFit(k=8, n=8, dtype_bytes=2, threads=2, rows=(1,), seconds=(6e-7,))
    narrow, wide, wide_one = _host_fit(64, 2, 1e-4), _host_fit(1024, 2, 2e-4), _host_fit(1024, 1, 3e-4)
    hw = HOST_HW.model_copy(update=dict(matmuls=(one, two), host_fits=(narrow, wide, wide_one)))
    # Two threads, width 100: the two-thread matmuls; 64 is nearer 100 than 1024 is (on a log scale).
    rank = hw.for_rank(2, 100)
    assert rank.matmuls == (two,)
    assert (rank.layer_overhead_s, rank.pass_overhead_s, rank.decode_token_overhead_s) == (1e-4, 2e-4, 3e-6)
    assert (rank.train_layer_overhead_s, rank.train_pass_overhead_s, rank.data_parallel_layer_overhead_s) == (
        4e-4, 5e-4, 6e-5)
    assert (rank.elementwise_rate, rank.backward_elementwise_rate) == (7e9, 8e9)
    assert rank.model_copy(update=dict(matmuls=hw.matmuls, **HOST, elementwise_bandwidth=0.0,
                                       backward_elementwise_bandwidth=0.0)) == hw
    # Width 512 is nearer 1024; one thread has one fit of its own.
    assert hw.for_rank(2, 512).layer_overhead_s == 2e-4
    assert hw.for_rank(1, 64).matmuls == (one,) and hw.for_rank(1, 64).layer_overhead_s == 3e-4
    # Four threads were never measured: the matmuls of the nearest thread count measured (two) and the
    # general host figures; the vocabulary costs likewise by their threads.
    vocab = (VocabCost(vocab_size=1000, threads=1, generate=1e-9, forward=2e-9, train=3e-9),
             VocabCost(vocab_size=1000, threads=2, generate=5e-10, forward=1e-9, train=2e-9))
    four = hw.model_copy(update=dict(vocab=vocab)).for_rank(4, 64)
    assert four.matmuls == (two,) and four.vocab == vocab[1:] and four.layer_overhead_s == hw.layer_overhead_s
    assert hw.model_copy(update=dict(vocab=vocab)).for_rank(1, 64).vocab == vocab[:1]
    assert TOY_HW.for_rank(1, 8) is TOY_HW


def test_layout_overheads_are_charged_only_where_the_layout_runs() -> None:
    """FSDP2's per-unit host time only on a sharded data-parallel trainer; the tensor-parallel one only on
    passes of a tp > 1 replica, once per layer and pass."""
    hw = TOY_HW.model_copy(update=dict(sharded_unit_overhead_s=1e-3, tensor_parallel_layer_overhead_s=1e-4))
    plain = TOY_HW
    common = dict(tokens=64, seq_len=8, pp=1, tp=1, recompute=False, intra_node_tp=True, dp_spans_nodes=False,
                  microbatches=2)
    for sharding, extra in (("fsdp", True), ("zero2", True), ("zero1", False), ("none", False)):
        with_it = timing.training_step_time(TOY, dp=2, fsdp=1, sharding=sharding, hw=hw, **common).total_s
        without = timing.training_step_time(TOY, dp=2, fsdp=1, sharding=sharding, hw=plain, **common).total_s
        # 2 micro-batches x 1 unit (the toy model is smaller than one) x 1 ms
        assert with_it - without == pytest.approx(2e-3 if extra else 0.0)
    alone = dict(common, dp=1, fsdp=1, sharding="fsdp")
    assert timing.training_step_time(TOY, hw=hw, **alone).total_s == timing.training_step_time(TOY, hw=plain, **alone).total_s
    # ZeRO-1's own host time: once per optimizer step (not per micro-batch), on a data-parallel rank only.
    zero1_hw = TOY_HW.model_copy(update=dict(zero1_step_overhead_s=5e-3))
    for sharding, dp, extra in (("zero1", 2, 5e-3), ("none", 2, 0.0), ("zero1", 1, 0.0), ("fsdp", 2, 0.0)):
        args = dict(common, dp=dp, fsdp=1, sharding=sharding)
        assert (timing.training_step_time(TOY, hw=zero1_hw, **args).total_s
                - timing.training_step_time(TOY, hw=plain, **args).total_s) == pytest.approx(extra)
    # Generation: 1 prefill + 3 decode passes, 2 layers each, 0.1 ms per layer and pass at tp 2.
    tp2 = timing.generation_time(TOY, 4, 5, 4, 2, "bf16", hw) - timing.generation_time(TOY, 4, 5, 4, 2, "bf16", plain)
    assert tp2 == pytest.approx(4 * 2 * 1e-4)
    assert timing.generation_time(TOY, 4, 5, 4, 1, "bf16", hw) == timing.generation_time(TOY, 4, 5, 4, 1, "bf16", plain)
    # A forward at tp 2 over 2 micro-batches: 2 x 2 layers.
    fwd = dict(tokens=64, seq_len=8, microbatches=2, tp=2)
    assert (timing.forward_time(TOY, hw=hw, **fwd).total_s - timing.forward_time(TOY, hw=plain, **fwd).total_s
            == pytest.approx(4 * 1e-4))
