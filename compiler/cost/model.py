"""The model's sizes: parameter counts, FLOPs and bytes of a Llama model and its state, before any device is
used (the cost model's base: memory (`memory.py`) and time (`timing.py`) are built on these counts).

Placement searches thousands of candidate layouts, so everything here is a pure function of a
`ModelDims`, a `HardwareSpec` and a few integers, answered in closed form (no loops over layers or
decode steps). Each formula's docstring says where it comes from:

- parameter counts follow Hugging Face `LlamaForCausalLM` exactly;
- FLOPs follow standard transformer accounting (2 FLOPs per matmul weight per token, plus the
  attention score/value products; training = forward + 2x backward, Kaplan et al. 2020,
  Narayanan et al. 2021);
- bytes per parameter follow mixed-precision Adam accounting (ZeRO, Rajbhandari et al. 2020).

Units: bytes, FLOPs, seconds, tokens. Bandwidths are bytes/s, one direction, per device.
"""

from __future__ import annotations

import functools
import math

from graphrl.schemas.hardware import HardwareSpec
from graphrl.schemas.model import ModelDims
from graphrl.schemas.sharding import (
    fsdp_layer_units,
    layer_modules,
    layer_tensor_count,
    llama_layer_param_count,
    llama_param_count,
)

from graphrl.errors import GraphRLError

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
    """Matmul weights of one transformer block (not their biases): q, k, v, o, gate, up, down."""
    return llama_layer_param_count(dims, matmuls_only=True)


def layer_params(dims: ModelDims) -> int:
    """All weights of one transformer block: its matmuls, their biases (Qwen2's q/k/v) and its norms (2*H,
    and a Qwen3's two per-head norms)."""
    return llama_layer_param_count(dims)


def param_count(dims: ModelDims) -> int:
    """Parameters of a Hugging Face `LlamaForCausalLM` with these dims, exactly, from the model's
    parameter inventory (`schemas/sharding.py`). llama3-8b: 8,030,261,248; 70b: 70,553,706,496; 405b:
    405,853,388,800."""
    return llama_param_count(dims)


def param_tensor_count(dims: ModelDims) -> int:
    """Parameter tensors of the model: one per weight and bias of the inventory (9 per Llama block, 12 per
    Qwen2 block, 11 per Qwen3 block; the embedding, the final norm, and the output head unless it is tied)."""
    return layer_tensor_count(dims) * dims.num_layers + 2 + (0 if dims.tie_embeddings else 1)


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
    return sum(shape[0] for m in layer_modules(dims) if len(shape := m.shape(dims)) == 2)


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


def active_param_count(dims: ModelDims) -> int:
    """Parameters one token's forward multiplies by: all of a dense model's, a mixture of experts' with only
    the top-k of its experts (`param_count` less the experts a token is not routed to)."""
    return param_count(dims) - dims.num_layers * (llama_layer_param_count(dims) -
                                                  llama_layer_param_count(dims, active=True))


def expert_combine_bytes(dims: ModelDims, tokens: float, ep: int, dtype_bytes: float = BF16_BYTES) -> float:
    """Bytes each rank of a generator's tp group sends per step to combine the experts' shares of `tokens`
    tokens when its `ep` ranks share the experts out: one ring all-reduce of [tokens, hidden] per MoE
    layer, 2 (ep - 1) / ep of the tensor per rank."""
    if not dims.is_moe or ep <= 1:
        return 0.0
    return dims.num_layers * tokens * dims.hidden_size * dtype_bytes * 2 * (ep - 1) / ep
