"""The analytical size model: parameters, FLOPs and memory of every role, before any device is used (their
time is `graphrl.compiler.timing`).

Placement searches thousands of candidate layouts, so everything here is a pure function of a
`ModelDims`, a `HardwareSpec` and a few integers, answered in closed form (no loops over layers or
decode steps). Each formula's docstring says where it comes from:

- parameter counts follow Hugging Face `LlamaForCausalLM` exactly;
- FLOPs follow standard transformer accounting (2 FLOPs per matmul weight per token, plus the
  attention score/value products; training = forward + 2x backward, Kaplan et al. 2020,
  Narayanan et al. 2021);
- memory follows mixed-precision Adam accounting (ZeRO, Rajbhandari et al. 2020) and the activation
  accounting of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
  Models").

Units: bytes, FLOPs, seconds, tokens. Bandwidths are bytes/s, one direction, per device.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from graphrl.errors import GraphRLError
from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.job import PRECISION_BYTES, SHARDINGS, Precision, Sharding
from graphrl.schemas.model import ModelDims
from graphrl.schemas.sharding import LLAMA_LAYER, fsdp_layer_units, llama_layer_param_count, llama_param_count

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


@functools.cache
def _stage_units(dims: ModelDims, tp: int, pp: int, dtype_bytes: float) -> tuple[int, int, int]:
    """(layers of one pipeline stage, their FSDP2 units, layers in the largest unit; 0 and 0 when they
    make a single unit), a layer holding layer_params / tp weights of `dtype_bytes` on one rank before
    sharding. Cached: the placement search asks for the same few shapes thousands of times."""
    per_stage = max(1, math.ceil(dims.num_layers / pp))
    units = fsdp_layer_units(per_stage, layer_params(dims) / tp * dtype_bytes)
    return per_stage, len(units), len(units[0]) if units else 0


def fsdp_unit_layers(dims: ModelDims, *, tp: int, dtype_bytes: float, pp: int = 1) -> int:
    """Decoder layers in the largest FSDP2 unit of one pipeline stage (`fsdp_layer_units`); all the
    stage's layers when they make a single unit."""
    per_stage, num_units, largest = _stage_units(dims, tp, pp, dtype_bytes)
    return largest if num_units else per_stage


def fsdp_units(dims: ModelDims, *, tp: int, dtype_bytes: float, pp: int = 1, trained: bool = True) -> int:
    """Units that FSDP2 gathers and reduces one at a time on one pipeline stage, as the executors wrap
    them: a trained model's units of decoder layers (`fsdp_layer_units`) plus its root (embedding, final
    norm, head), or a single unit where the layers make one; a frozen model's layers one by one (each is
    its own FSDP2 root, `executors.parallel.shard_frozen`)."""
    per_stage, num_units, _ = _stage_units(dims, tp, pp, dtype_bytes)
    if not trained:
        return per_stage
    return num_units + 1 if num_units else 1


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


@functools.cache  # the placement search asks for the same few precisions of each model thousands of times
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
    engine_weights: float = 0.0
    """A serving engine's own copy of a generator's weights, beside the role's module."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.kv_cache + self.engine_weights

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
            "engine_weights": self.engine_weights,
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
            self.engine_weights + other.engine_weights,
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
        copies are `gathered`: zero2 (`reshard_after_forward=False`) keeps every unit's weights from
        forward through backward, fsdp the current and the prefetched unit's; both hold one unit's
        unreduced gradient. A unit is consecutive layers up to `FSDP_UNIT_BYTES` (`fsdp_layer_units`);
        a model smaller than that is one unit, gathered whole.
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
    unit_bytes = fsdp_unit_layers(dims, tp=tp, dtype_bytes=compute_bytes, pp=pp) * layer_bytes
    whole = unit_bytes >= dims.num_layers / pp * layer_bytes  # one unit: the model with its root
    gathered_weights = gathered_grads = 0.0
    weights = params_per_device * compute_bytes
    grads = params_per_device * compute_bytes
    optimizer = params_per_device * (ADAM_MOMENT_BYTES_PER_PARAM + master)
    if sharding in ("zero1", "zero2", "fsdp"):
        optimizer /= d
    if sharding in ("zero2", "fsdp") and d > 1:
        gathered_weights = params_per_device * compute_bytes if sharding == "zero2" or whole else 2 * unit_bytes
        gathered_grads = params_per_device * compute_bytes if whole else unit_bytes
        weights = weights / d + gathered_weights
        grads = grads / d + gathered_grads

    host_weights = host_grads = host_optimizer = 0.0
    if offload_optimizer:
        host_optimizer, optimizer = optimizer, 0.0
    if offload_params:  # only the buffers a layer is computed with stay on the device
        host_weights, host_grads = weights - gathered_weights, grads - gathered_grads
        gathered_weights, gathered_grads = min(2 * unit_bytes, params_per_device * compute_bytes), unit_bytes
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
