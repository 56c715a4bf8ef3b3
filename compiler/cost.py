"""The analytical cost model: parameters, FLOPs, memory and time of every role, before any device is used.

Placement searches thousands of candidate layouts, so everything here is a pure function of a
`ModelDims`, a `HardwareSpec` and a few integers, answered in closed form (no loops over layers or
decode steps). Each formula's docstring says where it comes from:

- parameter counts follow Hugging Face `LlamaForCausalLM` exactly;
- FLOPs follow standard transformer accounting (2 FLOPs per matmul weight per token, plus the
  attention score/value products; training = forward + 2x backward, Kaplan et al. 2020,
  Narayanan et al. 2021);
- memory follows mixed-precision Adam accounting (ZeRO, Rajbhandari et al. 2020) and the activation
  accounting of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
  Models");
- collectives follow ring algorithms with an alpha-beta model (Thakur, Rabenseifner & Gropp 2005).

Units: bytes, FLOPs, seconds, tokens. Bandwidths are bytes/s, one direction, per device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

from graphrl.errors import GraphRLError
from graphrl.schemas.hardware import CollectiveFit, HardwareSpec
from graphrl.schemas.job import PRECISION_BYTES
from graphrl.schemas.model import ModelDims
from graphrl.schemas.sharding import LLAMA_LAYER, llama_layer_param_count, llama_param_count

Precision = Literal["bf16", "fp8"]
Sharding = Literal["none", "zero1", "zero2", "fsdp"]
CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce", "broadcast", "p2p"]

BF16_BYTES = 2
FP32_BYTES = 4
# Mixed-precision Adam (ZeRO paper, section 3.1): bf16 weights and grads, fp32 master + m + v.
WEIGHT_BYTES_PER_PARAM = 2
GRAD_BYTES_PER_PARAM = 2
ADAM_BYTES_PER_PARAM = 12
# An fp8 block linear keeps one float32 scale per output channel (executors/fp8.py).
FP8_SCALE_BYTES = 4
# AdamW's two fp32 moments; a float32 model needs no master copy (4 + 4 + 8 bytes per parameter).
ADAM_MOMENT_BYTES_PER_PARAM = 8
# Logits for the loss / log-softmax: the bf16 matmul output plus its fp32 upcast.
LOGIT_BYTES = BF16_BYTES + FP32_BYTES
SHARDINGS: tuple[str, ...] = ("none", "zero1", "zero2", "fsdp")


class UnsupportedPrecisionError(GraphRLError, ValueError):
    """A precision the hardware cannot run (fp8 on a device without fp8 tensor cores)."""


# --------------------------------------------------------------------------------------------------
# Model size


def embedding_params(dims: ModelDims) -> int:
    """Input embedding table: vocab_size * hidden_size."""
    return dims.vocab_size * dims.hidden_size


def layer_linear_params(dims: ModelDims) -> int:
    """Matmul weights of one transformer block (no biases in Llama): q, k, v, o, gate, up, down."""
    return llama_layer_param_count(dims, matmuls_only=True)


def layer_params(dims: ModelDims) -> int:
    """All weights of one transformer block: its matmuls plus two RMSNorm weights (2*H)."""
    return llama_layer_param_count(dims)


def param_count(dims: ModelDims) -> int:
    """Parameters of a Hugging Face `LlamaForCausalLM` with these dims, exactly, from the model's
    parameter inventory (`schemas/sharding.py`). llama3-8b: 8,030,261,248; 70b: 70,553,706,496; 405b:
    405,853,388,800."""
    return llama_param_count(dims)


def param_tensor_count(dims: ModelDims) -> int:
    """Weight tensors of the model: one per module of the inventory (9 per block, the embedding, the final
    norm, and the output head unless it is tied)."""
    return len(LLAMA_LAYER) * dims.num_layers + 2 + (0 if dims.tie_embeddings else 1)


def fsdp_units(dims: ModelDims, pp: int = 1) -> int:
    """Units that FSDP gathers and reduces one at a time on one pipeline stage: each transformer block,
    plus the root (embedding, final norm, head)."""
    return max(1, math.ceil(dims.num_layers / pp)) + 1


# DDP's default gradient bucket (torch.nn.parallel.DistributedDataParallel bucket_cap_mb=25).
DDP_BUCKET_BYTES = 25 * 2**20


def matmul_params(dims: ModelDims) -> int:
    """Weights that take part in a matmul for every token: all block linears plus the output head.

    The embedding is a lookup (no FLOPs); with tied embeddings the head still does its matmul.
    """
    return dims.num_layers * layer_linear_params(dims) + embedding_params(dims)


def block_linear_rows(dims: ModelDims) -> int:
    """Output channels of one block's linears: q (heads*hd), k and v (kv_heads*hd each), o (H), gate
    and up (I each), down (H); an fp8 weight holds one scale per such row."""
    return sum(shape[0] for m in LLAMA_LAYER if len(shape := m.shape(dims)) == 2)


def weight_bytes(dims: ModelDims, bytes_per_param: float, rest_bytes_per_param: float | None = None) -> float:
    """Bytes of all weights when the block linears are stored at `bytes_per_param`.

    Embedding, output head and norms are never quantized (fp8 serving stacks quantize only the
    transformer-block linears, and so do the executors): they stay at `rest_bytes_per_param`, by default
    the larger of `bytes_per_param` and bf16 (a float32 model passes 4). Block linears stored below bf16
    (fp8) also hold a float32 scale per output channel (`block_linear_rows`). So fp8 roughly, not
    exactly, halves the weight bytes.
    """
    block_linear = dims.num_layers * layer_linear_params(dims)
    rest = param_count(dims) - block_linear
    rest_bytes = max(bytes_per_param, BF16_BYTES) if rest_bytes_per_param is None else rest_bytes_per_param
    scales = dims.num_layers * block_linear_rows(dims) * FP8_SCALE_BYTES if bytes_per_param < BF16_BYTES else 0
    return block_linear * bytes_per_param + scales + rest * rest_bytes


def fp8_dequantizes(hw: HardwareSpec) -> bool:
    """Whether fp8 weights on `hw` are expanded to the activations' dtype at use (CPU ranks: no fp8
    matmul units) rather than multiplied in fp8 (`torch._scaled_mm` on fp8 tensor cores)."""
    return hw.kind == "cpu"


def read_bytes_per_param(hw: HardwareSpec, precision: str) -> float:
    """Bytes per block-linear weight that a forward pass streams for its matmuls: the stored width, or
    for fp8 weights that are dequantized at use, the unquantized width (the matmul reads the expanded
    weight), so fp8 on such hardware saves memory but is never charged as faster."""
    if precision == "fp8" and fp8_dequantizes(hw):
        return BF16_BYTES
    return PRECISION_BYTES[precision]


def decode_weight_bytes_read(dims: ModelDims, bytes_per_param: float) -> float:
    """Weight bytes a forward step streams from memory: all weights except the untied input embedding
    (a lookup reads only the batch's rows, which is negligible)."""
    skipped = 0 if dims.tie_embeddings else embedding_params(dims)
    return weight_bytes(dims, bytes_per_param) - skipped * max(bytes_per_param, BF16_BYTES)


# --------------------------------------------------------------------------------------------------
# FLOPs


def causal_mean_context(seq_len: float) -> float:
    """Mean number of keys a token attends to in a causal sequence of `seq_len` tokens: (S+1)/2.

    Token t (1-based) attends to t keys; flash-style kernels skip fully masked blocks, so the work
    really is about half of the full S*S score matrix.
    """
    return (seq_len + 1) / 2


def forward_flops_per_token(dims: ModelDims, context_len: float) -> float:
    """FLOPs of one token's forward pass when it attends to `context_len` keys.

    2 * (block matmul weights + lm_head) for the matmuls (one multiply-add per weight), plus
    4 * layers * context * heads * head_dim for the attention products (QK^T and AV, 2 FLOPs per
    multiply-add each). `context_len` is the number of keys this token sees (full, not halved): callers
    with a causal sequence pass `causal_mean_context(S)`; a decode step passes the current length.
    """
    attention = 4 * dims.num_layers * context_len * dims.num_heads * dims.head_dim
    return 2 * matmul_params(dims) + attention


def train_flops(dims: ModelDims, tokens: float, seq_len: int, recompute: bool) -> float:
    """FLOPs of forward + backward over `tokens` tokens packed in causal sequences of `seq_len`.

    Backward costs twice the forward (gradients w.r.t. inputs and weights), so 3x forward; full
    activation recompute runs the forward again in backward: 4x (Narayanan et al. 2021, the
    Megatron-LM FLOP count with its recompute factor 4).
    """
    multiplier = 4 if recompute else 3
    return multiplier * tokens * forward_flops_per_token(dims, causal_mean_context(seq_len))


def prefill_flops(dims: ModelDims, batch: int, prompt_len: int) -> float:
    """FLOPs of a forward over `batch` causal prompts of `prompt_len` tokens each."""
    return batch * prompt_len * forward_flops_per_token(dims, causal_mean_context(prompt_len))


def kv_cache_bytes_per_token(dims: ModelDims, bytes_per_elem: float) -> float:
    """KV-cache bytes one token adds: K and V, per layer, per KV head: 2*layers*kv_heads*head_dim*bytes."""
    return 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * bytes_per_elem


def kv_shards(dims: ModelDims, tp: int) -> int:
    """Ways the KV cache splits over a tensor-parallel group: min(tp, kv_heads).

    With tp > kv_heads each KV head is replicated on tp/kv_heads devices (Megatron/vLLM GQA sharding).
    """
    return min(tp, dims.num_kv_heads)


def _peak_flops(hw: HardwareSpec, precision: str) -> float:
    if precision == "bf16":
        return hw.peak_bf16_flops
    if precision == "fp8":
        if hw.peak_fp8_flops <= 0:
            raise UnsupportedPrecisionError(
                f"hardware {hw.name!r} has no fp8 support (peak_fp8_flops is 0)",
                fix="use precision 'bf16', or hardware with fp8 tensor cores (e.g. h100-sxm-80gb)",
            )
        return hw.peak_fp8_flops
    raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(PRECISION_BYTES)}")


# --------------------------------------------------------------------------------------------------
# Collectives


def collective_time(
    kind: CollectiveKind, num_bytes: float, group_size: int, hw: HardwareSpec, spans_nodes: bool
) -> float:
    """Seconds for one collective over `group_size` devices, ring algorithms, alpha-beta model.

    `num_bytes` is the full buffer: the gathered output of an all-gather, the unreduced input of a
    reduce-scatter, the buffer of an all-reduce / broadcast / p2p send. With n devices, link bandwidth
    bw = (inter_node_bandwidth if the group spans nodes else intra_node_bandwidth) * link_efficiency,
    and alpha = link_latency_s per ring step (Thakur et al. 2005; NCCL's ring):

    - all_gather, reduce_scatter: (n-1) steps of bytes/n:     (n-1)/n * bytes/bw + (n-1)*alpha
    - all_reduce = reduce_scatter + all_gather:              2(n-1)/n * bytes/bw + 2(n-1)*alpha
    - broadcast, pipelined along a chain in small chunks:    bytes/bw + (n-1)*alpha
    - p2p:                                                   bytes/bw + alpha
    A group of one device costs nothing. Within a node, a calibrated `hw.collectives` fit of this kind
    (`measured_collective`) replaces bw and alpha.
    """
    n = group_size
    if n <= 1:
        return 0.0
    fit = None if spans_nodes else measured_collective(hw, kind, n)
    if fit is not None:
        bw, alpha = fit.bus_bandwidth, fit.latency_s
    else:
        bw = (hw.inter_node_bandwidth if spans_nodes else hw.intra_node_bandwidth) * hw.link_efficiency
        alpha = hw.link_latency_s
    factor, steps = ring_shape(kind, n)
    return factor * num_bytes / bw + steps * alpha


def ring_shape(kind: str, n: int) -> tuple[float, int]:
    """(bandwidth factor, latency steps) of `kind` over n > 1 ranks in the ring model, so that seconds =
    factor * bytes / bw + steps * alpha (the table in `collective_time`)."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n, 2 * (n - 1)
    if kind == "all_gather" or kind == "reduce_scatter":
        return (n - 1) / n, n - 1
    if kind == "broadcast":
        return 1.0, n - 1
    if kind == "p2p":
        return 1.0, 1
    raise ValueError(
        f"unknown collective {kind!r}; expected all_gather, reduce_scatter, all_reduce, broadcast or p2p"
    )


def measured_collective(hw: HardwareSpec, kind: str, group_size: int) -> CollectiveFit | None:
    """The calibrated fit of `kind` for `group_size` ranks: the exact size, else the largest measured
    size below it, else the smallest above it; None when `kind` was not measured."""
    fits = [f for f in hw.collectives if f.kind == kind]
    if not fits:
        return None
    below = [f for f in fits if f.group_size <= group_size]
    if below:
        return max(below, key=lambda f: f.group_size)
    return min(fits, key=lambda f: f.group_size)


def chunked_collective_time(
    kind: CollectiveKind, num_bytes: float, calls: int, group_size: int, hw: HardwareSpec, spans_nodes: bool
) -> float:
    """Seconds for `num_bytes` moved as `calls` equal collectives one after another (FSDP units, DDP
    buckets, per-tensor gathers): the bytes cost the same, the latency is paid per call."""
    calls = max(1, calls)
    return calls * collective_time(kind, num_bytes / calls, group_size, hw, spans_nodes)


def group_spans_nodes(devices: Sequence[int], devices_per_node: int) -> bool:
    """Whether global device indices `devices` sit on more than one node (node = index // per_node)."""
    it = iter(devices)
    first = next(it, None)
    if first is None:
        return False
    node = first // devices_per_node
    return any(d // devices_per_node != node for d in it)


def offload_time(num_bytes: float, hw: HardwareSpec) -> float:
    """Seconds to move `num_bytes` between device and host memory: bytes / host_link_bandwidth."""
    return num_bytes / hw.host_link_bandwidth


# --------------------------------------------------------------------------------------------------
# Generation (prefill + decode)


def _decode_coefficients(
    dims: ModelDims,
    batch: float,
    tp: int,
    bytes_per_param: float,
    kv_bytes_per_elem: float,
    hw: HardwareSpec,
    peak_flops: float,
) -> tuple[float, float, float, float]:
    """A decode step's compute and memory times as linear functions of the context length c.

    Returns (a_compute, b_compute, a_memory, b_memory) with t_compute = a_c + b_c*c and
    t_memory = a_m + b_m*c, so that a sum over decode steps has a closed form.
    """
    flops_rate = peak_flops * hw.compute_efficiency * tp
    a_compute = batch * 2 * matmul_params(dims) / flops_rate
    b_compute = batch * 4 * dims.num_layers * dims.num_heads * dims.head_dim / flops_rate
    mem_rate = hw.memory_bandwidth * hw.memory_efficiency
    a_memory = decode_weight_bytes_read(dims, bytes_per_param) / tp / mem_rate
    b_memory = batch * kv_cache_bytes_per_token(dims, kv_bytes_per_elem) / kv_shards(dims, tp) / mem_rate
    return a_compute, b_compute, a_memory, b_memory


def _tp_comm_per_pass(
    dims: ModelDims, tokens: float, rows: float, tp: int, hw: HardwareSpec, spans_nodes: bool
) -> float:
    """Tensor-parallel communication of one forward pass as the generator runs it, on the critical path:
    an all-reduce after the vocabulary-parallel embedding and 2 per layer (after attention and after the
    MLP, Shoeybi et al. 2019), each of the `tokens`' bf16 activations (tokens*H*2 bytes), then an
    all-gather of the `rows` sampled positions' float32 logits (rows*V*4 bytes) so every rank samples
    from the full vocabulary."""
    if tp <= 1:
        return 0.0
    per_call = collective_time("all_reduce", tokens * dims.hidden_size * BF16_BYTES, tp, hw, spans_nodes)
    logits = collective_time("all_gather", rows * dims.vocab_size * FP32_BYTES, tp, hw, spans_nodes)
    return (2 * dims.num_layers + 1) * per_call + logits


def decode_step_cost(
    dims: ModelDims,
    batch: int,
    context_len: float,
    tp: int,
    bytes_per_param: float,
    kv_bytes_per_elem: float,
    hw: HardwareSpec,
    *,
    precision: Precision = "bf16",
    intra_node: bool = True,
) -> float:
    """Seconds of one decode step: `batch` sequences each emit one token attending to `context_len` keys.

    Roofline: max(compute, memory) + tensor-parallel communication, where
    - compute = batch * forward_flops_per_token(context_len) / tp / (peak * compute_efficiency),
      peak = peak_fp8_flops for precision 'fp8', else peak_bf16_flops;
    - memory = (weights read / tp + batch * context_len * kv_cache_bytes_per_token / min(tp, kv_heads))
      / (memory_bandwidth * memory_efficiency); weights read = `decode_weight_bytes_read` with block
      linears at `bytes_per_param`; KV heads cannot split below one per device (see `kv_shards`);
    - communication (tp > 1) = `_tp_comm_per_pass`: the embedding's and 2 per layer all-reduces of
      batch*H bf16 activations and the all-gather of batch*V float32 logits, over NVLink if
      `intra_node`, else the inter-node network.
    """
    a_c, b_c, a_m, b_m = _decode_coefficients(
        dims, batch, tp, bytes_per_param, kv_bytes_per_elem, hw, _peak_flops(hw, precision)
    )
    compute = a_c + b_c * context_len
    memory = a_m + b_m * context_len
    return max(compute, memory) + _tp_comm_per_pass(dims, batch, batch, tp, hw, not intra_node)


def _sum_linear(a: float, b: float, lo: int, hi: int) -> float:
    """sum_{c=lo}^{hi} (a + b*c), 0 for an empty range."""
    n = hi - lo + 1
    if n <= 0:
        return 0.0
    return n * a + b * (lo + hi) * n / 2


def _sum_max_linear(a1: float, b1: float, a2: float, b2: float, lo: int, hi: int) -> float:
    """sum_{c=lo}^{hi} max(a1 + b1*c, a2 + b2*c), exactly, in O(1).

    Two lines cross at most once, at c* = (a2-a1)/(b1-b2); past it the steeper line is the larger.
    """
    if hi < lo:
        return 0.0
    if b1 == b2:
        return _sum_linear(max(a1, a2), b1, lo, hi)
    cross = (a2 - a1) / (b1 - b2)
    split = min(max(math.floor(cross), lo - 1), hi)  # [lo, split] before, [split+1, hi] after c*
    if b1 > b2:
        return _sum_linear(a2, b2, lo, split) + _sum_linear(a1, b1, split + 1, hi)
    return _sum_linear(a1, b1, lo, split) + _sum_linear(a2, b2, split + 1, hi)


def engine_time_factor(hw: HardwareSpec, engine: str) -> float:
    """How much longer (< 1: shorter) a generator on `engine` takes than the native sampler the roofline
    models: the ratio `graphrl calibrate` measured on this machine, or 1 where it measured none (the
    native sampler itself; a GPU preset, whose engine throughput is not modelled separately)."""
    for measured in hw.engines:
        if measured.engine == engine:
            return measured.native_tokens_per_s / measured.tokens_per_s
    return 1.0


def generation_time(
    dims: ModelDims,
    batch: int,
    prompt_len: int,
    response_len: int,
    tp: int,
    precision: Precision,
    hw: HardwareSpec,
    intra_node: bool = True,
    *,
    kv_bytes_per_elem: float = BF16_BYTES,
) -> float:
    """Seconds for one generator replica (a tp group) to answer `batch` prompts: prefill + decode.

    - prefill: max(prefill_flops / tp / (peak * compute_efficiency), weights read / tp / effective
      memory bandwidth) + the tensor-parallel communication of one pass over batch*prompt_len tokens
      (`_tp_comm_per_pass`). Prefill also yields the first response token.
    - decode: the remaining response_len - 1 steps; step j (1-based) feeds the token at position
      prompt_len + j - 1 and attends to prompt_len + j keys. Each step is `decode_step_cost`; the sum
      over steps of max(linear, linear) in the context is computed exactly in closed form.
    All sequences run in lockstep to the full response_len (no early stop, no continuous batching).
    fp8 stores the block linears in 1 byte and uses peak_fp8_flops (UnsupportedPrecisionError, a
    ValueError, if the hardware has none); where fp8 is dequantized at use (`read_bytes_per_param`) the
    weights read are the unquantized ones. The KV cache stays at `kv_bytes_per_elem` (bf16).
    """
    peak = _peak_flops(hw, precision)
    bytes_per_param = read_bytes_per_param(hw, precision)
    spans_nodes = not intra_node
    mem_rate = hw.memory_bandwidth * hw.memory_efficiency
    weights_read = decode_weight_bytes_read(dims, bytes_per_param) / tp

    prefill_compute = prefill_flops(dims, batch, prompt_len) / (tp * peak * hw.compute_efficiency)
    prefill = max(prefill_compute, weights_read / mem_rate)
    prefill += _tp_comm_per_pass(dims, batch * prompt_len, batch, tp, hw, spans_nodes)

    steps = response_len - 1
    per_pass_host = dims.num_layers * hw.layer_overhead_s + hw.pass_overhead_s
    if steps <= 0:
        return prefill + per_pass_host + batch * dims.num_layers * hw.decode_token_overhead_s
    a_c, b_c, a_m, b_m = _decode_coefficients(
        dims, batch, tp, bytes_per_param, kv_bytes_per_elem, hw, peak
    )
    decode = _sum_max_linear(a_c, b_c, a_m, b_m, prompt_len + 1, prompt_len + steps)
    decode += steps * _tp_comm_per_pass(dims, batch, batch, tp, hw, spans_nodes)
    # Host time: one pass through the model for the prefill and for each decode step, and the
    # per-token work of every generated token in every layer.
    per_token_host = batch * response_len * dims.num_layers * hw.decode_token_overhead_s
    return prefill + decode + (1 + steps) * per_pass_host + per_token_host


# --------------------------------------------------------------------------------------------------
# Memory


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes held on one device (or in one host's memory for that device), by kind."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    gathered: float = 0.0
    """Of `params` and `grads`: the unsharded copies a sharded role holds only while it computes
    (FSDP2's all-gathered weights and unreduced gradients); the rest is its resting state."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.kv_cache

    @property
    def resting_state(self) -> float:
        """Weights, gradients and optimizer state held between steps (what a run's ledger measures)."""
        return self.params + self.grads + self.optimizer - self.gathered

    def as_dict(self) -> dict[str, float]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "kv_cache": self.kv_cache,
            "gathered": self.gathered,
            "total": self.total,
        }

    def __add__(self, other: "MemoryBreakdown") -> "MemoryBreakdown":
        if not isinstance(other, MemoryBreakdown):
            return NotImplemented
        return MemoryBreakdown(
            self.params + other.params,
            self.grads + other.grads,
            self.optimizer + other.optimizer,
            self.activations + other.activations,
            self.kv_cache + other.kv_cache,
            self.gathered + other.gathered,
        )

    def __radd__(self, other: object) -> "MemoryBreakdown":
        # Lets `sum(breakdowns)` start from 0.
        if other == 0:
            return self
        return NotImplemented


ZERO_MEMORY = MemoryBreakdown()


def activation_bytes_per_token_per_layer(
    dims: ModelDims, seq_len: int, tp: int, flash_attention: bool = True
) -> float:
    """Activation bytes one token leaves in one layer for the backward pass (bf16, no recompute).

    Korthikanti et al. 2022, section 4: s*b*h*(34 + 5*a*s/h) per layer, i.e. 34*H + 5*heads*seq per
    token, all of it divided by tp (tensor + sequence parallelism). The 5*heads*seq term is the
    stored softmax scores, dropout mask and dropped-out scores; flash attention (torch SDPA on GPUs)
    stores none of them, only an fp32 log-sum-exp per head: 4*heads bytes. The 34*H term assumes a 4H
    GELU MLP; it is kept as published for the SwiGLU MLP.
    """
    attention = 4 * dims.num_heads if flash_attention else 5 * dims.num_heads * seq_len
    return (34 * dims.hidden_size + attention) / tp


def training_memory(
    dims: ModelDims,
    *,
    dp: int,
    fsdp: int,
    tp: int,
    pp: int,
    sharding: Sharding,
    micro_batch_tokens: int,
    seq_len: int,
    recompute: bool,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    flash_attention: bool = True,
    compute_bytes: int = BF16_BYTES,
) -> tuple[MemoryBreakdown, MemoryBreakdown]:
    """Bytes a training role holds per device, and per device in host memory: (device, host).

    State is charged as the executors hold it (`graphrl.schemas.capabilities`). `compute_bytes` is the
    model's dtype: 2 (bfloat16) trains in mixed precision, bf16 weights and gradients with fp32 master
    weights and AdamW moments (2 + 2 + 12 bytes per parameter, ZeRO paper section 3.1); 4 (float32)
    holds 4 + 4 + 8. Per device, parameters are first divided by tp*pp (model parallel, balanced
    stages), then over the data-parallel group D = dp*fsdp as the sharding runs:
      none (DDP): nothing sharded;
      zero1 (DDP + ZeroRedundancyOptimizer): the optimizer state (fp32 master and moments) / D;
      zero2, fsdp (FSDP2): weights, gradients and optimizer state rest as shards (/ D). The unsharded
        copies are `gathered`: zero2 (`reshard_after_forward=False`) keeps every layer's weights from
        forward through backward, fsdp the current and the prefetched layer's; both hold one layer's
        unreduced gradient.
    offload_optimizer moves the optimizer state to host; offload_params moves the weight and gradient
    shards to host (FSDP2 CPUOffloadPolicy), leaving only the gathered buffers on the device.

    Activations for one micro-batch of `micro_batch_tokens` tokens on one data-parallel rank, with
    L/pp layers per stage, per token per layer:
      no recompute: `activation_bytes_per_token_per_layer` (Korthikanti et al. 2022);
      full recompute: only the layer input 2*H/tp, plus one layer's full working set for the
      micro-batch being recomputed.
    With pipeline parallelism (1F1B), the first stage keeps pp micro-batches in flight (Korthikanti
    et al. 2022, pipeline parallelism), so it holds about L layers' worth regardless of pp; the last
    stage keeps one micro-batch plus the logits. Logits: micro_batch_tokens * vocab * (2 + 4) / tp
    (bf16 output and its fp32 upcast for the loss). The larger of the two stages is returned.
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; expected one of {SHARDINGS}")
    d = dp * fsdp
    params_per_device = param_count(dims) / (tp * pp)
    mixed = compute_bytes < FP32_BYTES
    master = FP32_BYTES if mixed else 0  # an fp32 copy of the weights beside the compute-dtype ones
    layer_bytes = layer_params(dims) / tp * compute_bytes
    gathered_weights = gathered_grads = 0.0
    weights = params_per_device * compute_bytes
    grads = params_per_device * compute_bytes
    optimizer = params_per_device * (ADAM_MOMENT_BYTES_PER_PARAM + master)
    if sharding in ("zero1", "zero2", "fsdp"):
        optimizer /= d
    if sharding in ("zero2", "fsdp") and d > 1:
        gathered_weights = params_per_device * compute_bytes if sharding == "zero2" else 2 * layer_bytes
        gathered_grads = layer_bytes
        weights = weights / d + gathered_weights
        grads = grads / d + gathered_grads

    host_weights = host_grads = host_optimizer = 0.0
    if offload_optimizer:
        host_optimizer, optimizer = optimizer, 0.0
    if offload_params:  # only the buffers a layer is computed with stay on the device
        host_weights, host_grads = weights - gathered_weights, grads - gathered_grads
        gathered_weights, gathered_grads = 2 * layer_bytes, layer_bytes
        weights, grads = gathered_weights, gathered_grads
    gathered = gathered_weights + gathered_grads

    layers_per_stage = dims.num_layers / pp
    per_token = activation_bytes_per_token_per_layer(dims, seq_len, tp, flash_attention)
    full_layer = micro_batch_tokens * per_token
    if recompute:
        per_micro_batch = micro_batch_tokens * layers_per_stage * BF16_BYTES * dims.hidden_size / tp
        working = full_layer
    else:
        per_micro_batch = full_layer * layers_per_stage
        working = 0.0
    logits = micro_batch_tokens * dims.vocab_size * LOGIT_BYTES / tp
    first_stage = pp * per_micro_batch + working + (logits if pp == 1 else 0.0)
    last_stage = per_micro_batch + working + logits
    activations = max(first_stage, last_stage)

    device = MemoryBreakdown(params=weights, grads=grads, optimizer=optimizer, activations=activations,
                             gathered=gathered)
    host = MemoryBreakdown(params=host_weights, grads=host_grads, optimizer=host_optimizer)
    return device, host


def inference_memory(
    dims: ModelDims,
    *,
    tp: int,
    pp: int,
    precision: Precision,
    batch: int,
    context_len: int,
    kv_bytes_per_elem: float = BF16_BYTES,
    generator: bool = True,
) -> MemoryBreakdown:
    """Bytes per device of a generator (`generator=True`) or a frozen forward-only model (logprob,
    value, reward: `generator=False`).

    params: `weight_bytes(dims, precision bytes)` / (tp*pp).
    kv_cache (generators only): batch * context_len * kv_cache_bytes_per_token / (min(tp, kv_heads)*pp).
    activations: no backward, so only one layer's transient working set is alive, per token
    4*H (residual stream and its normed copy, replicated over tp) + 6*I/tp (SwiGLU gate, up and
    their product, bf16), plus logits vocab*(2+4)/tp (bf16 and fp32, for sampling or log-softmax).
    A generator's decode step processes `batch` tokens; a forward pass batch*context_len tokens
    (pass the micro-batch as `batch`).
    """
    if precision not in PRECISION_BYTES:
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(PRECISION_BYTES)}")
    bytes_per_param = PRECISION_BYTES[precision]
    params = weight_bytes(dims, bytes_per_param) / (tp * pp)
    tokens = batch if generator else batch * context_len
    per_token = (
        2 * dims.hidden_size * BF16_BYTES
        + 3 * dims.intermediate_size * BF16_BYTES / tp
        + dims.vocab_size * LOGIT_BYTES / tp
    )
    activations = tokens * per_token
    kv_cache = 0.0
    if generator:
        kv_cache = batch * context_len * kv_cache_bytes_per_token(dims, kv_bytes_per_elem) / (
            kv_shards(dims, tp) * pp
        )
    return MemoryBreakdown(params=params, activations=activations, kv_cache=kv_cache)


# --------------------------------------------------------------------------------------------------
# Training and forward step time


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds of one step of a role on one device, and how they add up.

    total_s = compute_s + exposed_comm_s + bubble_s. comm_s is all communication time, hidden or not.
    """

    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble_s: float
    total_s: float


def _data_parallel_comm(
    dims: ModelDims, sharding: str, d: int, tp: int, pp: int, hw: HardwareSpec, spans_nodes: bool
) -> tuple[float, float]:
    """Per-step data-parallel collectives of a training role: (overlappable_s, not_overlappable_s).

    Buffers are the bf16 weights/grads of one model-parallel slice, 2*P/(tp*pp) bytes, moved as the
    executors move them (`graphrl.schemas.capabilities`):
      none (DDP): all-reduce grads, bucketed during backward;
      zero1 (DDP + ZeroRedundancyOptimizer): the same all-reduce, then every rank's updated share of
        the weights is broadcast to the others after the optimizer step (an all-gather, not overlapped);
      zero2 (FSDP2, weights kept from forward through backward): all-gather the weights once, layer by
        layer in forward, and reduce-scatter grads during backward;
      fsdp: all-gather weights for forward and again for backward (resharded after forward), and
        reduce-scatter grads, all prefetched layer by layer.
    """
    if d <= 1:
        return 0.0, 0.0
    buffer = param_count(dims) / (tp * pp) * BF16_BYTES
    buckets = math.ceil(buffer / DDP_BUCKET_BYTES)
    all_reduce = chunked_collective_time("all_reduce", buffer, buckets, d, hw, spans_nodes)
    if sharding == "none":
        return all_reduce, 0.0
    if sharding == "zero1":
        return all_reduce, chunked_collective_time("all_gather", buffer, buckets, d, hw, spans_nodes)
    units = fsdp_units(dims, pp)
    gather = chunked_collective_time("all_gather", buffer, units, d, hw, spans_nodes)
    scatter = chunked_collective_time("reduce_scatter", buffer, units, d, hw, spans_nodes)
    if sharding == "fsdp":
        return 2 * gather + scatter, 0.0
    if sharding == "zero2":
        return gather + scatter, 0.0
    raise ValueError(f"unknown sharding {sharding!r}; expected one of {SHARDINGS}")


def _overlap(comm_s: float, window_s: float, layers_per_stage: float) -> float:
    """Exposed part of layer-by-layer communication that runs on its own stream beside compute.

    Overlap assumption: one layer's share (the first gather before forward starts, the last
    reduce after backward ends) is always exposed; the rest hides behind up to `window_s` of compute.
    """
    if comm_s <= 0.0:
        return 0.0
    edge = comm_s / max(layers_per_stage, 1.0)
    return edge + max(0.0, comm_s - edge - window_s)


def _pipeline_p2p(
    dims: ModelDims, tokens_per_micro_batch: float, tp: int, pp: int, microbatches: int,
    passes: int, hw: HardwareSpec, spans_nodes: bool,
) -> float:
    """Stage-boundary sends: per micro-batch and pass (forward activations, backward gradients),
    tokens*H bf16 bytes split over tp (scatter-gather optimisation, Narayanan et al. 2021)."""
    if pp <= 1:
        return 0.0
    send = tokens_per_micro_batch * dims.hidden_size * BF16_BYTES / tp
    return passes * microbatches * collective_time("p2p", send, 2, hw, spans_nodes)


def training_step_time(
    dims: ModelDims,
    *,
    tokens: float,
    seq_len: int,
    dp: int,
    fsdp: int,
    tp: int,
    pp: int,
    sharding: Sharding,
    recompute: bool,
    hw: HardwareSpec,
    intra_node_tp: bool,
    dp_spans_nodes: bool,
    pp_spans_nodes: bool = True,
    microbatches: int | None = None,
) -> StepCost:
    """Seconds of one optimizer step over `tokens` tokens (the global batch, all data-parallel ranks).

    - compute: train_flops(tokens) / (dp*fsdp*tp*pp) / (peak_bf16 * compute_efficiency).
    - tensor parallel: per layer and micro-batch, 2 all-reduces in forward and 2 in backward (2 more
      when recompute reruns the forward) of the micro-batch's bf16 activations (tokens_mb*H*2 bytes),
      on the critical path; a tp group that spans nodes pays inter-node bandwidth.
    - pipeline: forward and backward sends between stages per micro-batch (`_pipeline_p2p`), and the
      1F1B bubble: the ideal time stretches by (m+pp-1)/m, i.e. a bubble fraction (pp-1)/(m+pp-1) of
      the total, with m = `microbatches` (default 4*pp).
    - data parallel (`_data_parallel_comm`): overlapped with compute as `_overlap` assumes, within
      the backward compute for DDP and ZeRO-1 (2/3 of compute, 3/4 with recompute) and within forward +
      backward for the FSDP2 shardings (zero2, fsdp); ZeRO-1's weight broadcast after the optimizer
      step is fully exposed.
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; expected one of {SHARDINGS}")
    d = dp * fsdp
    m = microbatches if microbatches is not None else 4 * pp
    compute = train_flops(dims, tokens, seq_len, recompute) / (d * tp * pp)
    compute /= hw.peak_bf16_flops * hw.compute_efficiency
    tokens_per_micro_batch = tokens / (d * m)
    layers_per_stage = dims.num_layers / pp

    tp_comm = 0.0
    if tp > 1:
        calls_per_layer = 6 if recompute else 4
        activation = tokens_per_micro_batch * dims.hidden_size * BF16_BYTES
        per_call = collective_time("all_reduce", activation, tp, hw, not intra_node_tp)
        tp_comm = calls_per_layer * layers_per_stage * m * per_call
    pp_comm = _pipeline_p2p(dims, tokens_per_micro_batch, tp, pp, m, 2, hw, pp_spans_nodes)

    overlappable, not_overlappable = _data_parallel_comm(dims, sharding, d, tp, pp, hw, dp_spans_nodes)
    if sharding in ("fsdp", "zero2"):
        window = compute
    else:
        window = compute * (3 / 4 if recompute else 2 / 3)
    exposed_dp = not_overlappable + _overlap(overlappable, window, layers_per_stage)

    critical = compute + tp_comm + pp_comm
    bubble = critical * (pp - 1) / m
    exposed = tp_comm + pp_comm + exposed_dp
    # Host time per micro-batch: forward, backward and update of this stage's layers (with recompute,
    # one more forward through them), and the loss and optimizer work outside the layers.
    per_layer = hw.train_layer_overhead_s + (hw.layer_overhead_s if recompute else 0.0)
    host = m * (layers_per_stage * per_layer + hw.train_pass_overhead_s)
    return StepCost(
        compute_s=compute + host, comm_s=tp_comm + pp_comm + overlappable + not_overlappable,
        exposed_comm_s=exposed, bubble_s=bubble, total_s=compute + host + exposed + bubble,
    )


def forward_time(
    dims: ModelDims,
    *,
    tokens: float,
    seq_len: int,
    hw: HardwareSpec,
    dp: int = 1,
    fsdp: int = 1,
    tp: int = 1,
    pp: int = 1,
    precision: Precision = "bf16",
    intra_node_tp: bool = True,
    dp_spans_nodes: bool = False,
    pp_spans_nodes: bool = True,
    microbatches: int | None = None,
) -> StepCost:
    """Seconds of a forward-only pass (logprob, value or reward) over `tokens` tokens in causal
    sequences of `seq_len`, spread over dp*fsdp data-parallel ranks.

    - compute per micro-batch: max(FLOPs / (tp*pp) / (peak * compute_efficiency), the stage's weights
      read once / effective memory bandwidth), so tiny batches are memory-bound.
    - tensor parallel: 2 all-reduces per layer and micro-batch (critical path).
    - fsdp > 1: one all-gather of the bf16 weights over the fsdp group (D = dp*fsdp shards, as in
      `training_memory`), overlapped with compute as in `_overlap`.
    - pipeline: forward sends and the bubble (pp-1)/m of the ideal time, m = `microbatches`
      (default 4*pp).
    """
    d = dp * fsdp
    m = microbatches if microbatches is not None else 4 * pp
    peak = _peak_flops(hw, precision)
    tokens_per_micro_batch = tokens / (d * m)
    layers_per_stage = dims.num_layers / pp
    flops = tokens_per_micro_batch * forward_flops_per_token(dims, causal_mean_context(seq_len))
    flops_time = flops / (tp * pp) / (peak * hw.compute_efficiency)
    read_time = decode_weight_bytes_read(dims, read_bytes_per_param(hw, precision)) / (tp * pp) / (
        hw.memory_bandwidth * hw.memory_efficiency
    )
    compute = m * max(flops_time, read_time)

    tp_comm = 0.0
    if tp > 1:
        activation = tokens_per_micro_batch * dims.hidden_size * BF16_BYTES
        per_call = collective_time("all_reduce", activation, tp, hw, not intra_node_tp)
        tp_comm = 2 * layers_per_stage * m * per_call
    pp_comm = _pipeline_p2p(dims, tokens_per_micro_batch, tp, pp, m, 1, hw, pp_spans_nodes)

    gather = 0.0
    if fsdp > 1:
        buffer = param_count(dims) / (tp * pp) * BF16_BYTES
        gather = chunked_collective_time("all_gather", buffer, fsdp_units(dims, pp), d, hw, dp_spans_nodes)
    exposed_gather = _overlap(gather, compute, layers_per_stage)

    critical = compute + tp_comm + pp_comm
    bubble = critical * (pp - 1) / m
    exposed = tp_comm + pp_comm + exposed_gather
    host = m * (layers_per_stage * hw.layer_overhead_s + hw.pass_overhead_s)
    return StepCost(
        compute_s=compute + host, comm_s=tp_comm + pp_comm + gather, exposed_comm_s=exposed, bubble_s=bubble,
        total_s=compute + host + exposed + bubble,
    )
