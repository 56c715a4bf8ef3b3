"""Time: the seconds of every kind of work a plan runs on one device, one function each (a model pass,
a collective, a generation, an engine's reload).

The phase table (`phases.py`) adds these up per candidate: the placement search ranks candidates with it,
the simulator takes its instruction durations from it (the lowered `CostKey` table), and so the
preview's phases, which the simulator's steady state adds up, are these functions too. Everything is
closed form in the job's sizes (no loop over layers, and decode steps summed exactly), because the search
times thousands of layouts.

Each model pass is a sum of rooflines, one per operation, as the executors run them:

- a linear layer's matmul y[m, n] = x[m, k] W[n, k]^T takes `matmul_seconds`: the time measured for that
  weight shape on this machine (`graphrl calibrate JOB`), interpolated by rows, or the roofline
  max(2mkn / (peak * compute_efficiency), (mk + kn + mn) * bytes / effective memory bandwidth) plus a
  kernel overhead where nothing was measured. Small row counts (decode) are memory-bound that way.
- attention's score and value products: max(FLOPs, the K/V bytes read) over the keys each query sees;
  the executors pass an explicit mask, so every key of the row is computed (no causal block skipping);
- elementwise work (norms, rotary embedding, SwiGLU, residuals, the KV-cache append, the softmax and
  log-softmax over the vocabulary, the optimizer update) by the bytes it moves, at the elementwise
  bandwidth `graphrl calibrate` fits (the effective memory bandwidth without a calibration);
- host time per layer and per pass (kernel launches, Python), per generated token, fitted from the
  executor's own model code on this machine (zero on the GPU presets, which carry `kernel_overhead_s`).

Collectives follow ring algorithms with an alpha-beta model (Thakur, Rabenseifner & Gropp 2005), or the
calibrated fit of the measured group size. Units: bytes, FLOPs, seconds, tokens.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Literal, Sequence

from graphrl.compiler.cost.model import (
    BF16_BYTES,
    DDP_BUCKET_BYTES,
    FP32_BYTES,
    UnsupportedPrecisionError,
    fp8_dequantizes,
    fsdp_units,
    kv_shards,
    param_count,
    param_tensor_count,
    weight_bytes,
)
from graphrl.compiler.lengths import Lengths
from graphrl.schemas.hardware import CollectiveFit, HardwareSpec, MatmulFit
from graphrl.schemas.job import PRECISION_BYTES, SHARDINGS, Precision, Sharding
from graphrl.schemas.model import LoraSpec, ModelDims
from graphrl.schemas.sharding import TpStyle, layer_modules, lora_modules, lora_param_count

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce", "broadcast", "p2p"]

# Elements each token moves through elementwise kernels in one transformer layer's forward, as the
# executor's Llama runs it (executors/models/llama.py), per hidden (H), query (Hq = heads*head_dim),
# key/value (Hkv = kv_heads*head_dim) and feed-forward (I) feature: two RMSNorms in float32 (read, square,
# mean, scale, weight: ~7 elements per feature each), two residual adds (3), the rotary embedding of q and k
# (rotate-half concatenation, two products and a sum: ~9), the attention output's transpose copy (2), the
# KV-cache append (2 per K and V element), SwiGLU (silu and the product: 5). A backward moves about twice
# a forward's.
ELEMENTWISE_PER_H = 20
ELEMENTWISE_PER_HQ = 11
ELEMENTWISE_PER_HKV = 13
ELEMENTWISE_PER_I = 5
# Elements per vocabulary entry and row of the head's output: sampling (temperature scale, softmax, the
# cumulative sum it inverts) and the sampled token's log-softmax in generation; the log-softmax and the
# entropy of a log-prob pass; a training pass, that forward and its backward.
VOCAB_ELEMENTS = {"generate": 14, "forward": 10, "train": 20}
# AdamW (decoupled decay, both moments, the bias-corrected update) and gradient-norm clipping, per
# parameter, in float32 elements read and written.
OPTIMIZER_ELEMENTS_PER_PARAM = 19
# The token counts a data-parallel update all-reduces before its loss (float64 sums and the group size).
UPDATE_COUNTS_BYTES = 3 * 8


def _peak(hw: HardwareSpec, precision: str) -> float:
    """Peak matmul FLOP/s at `precision` ('bf16': the model's compute dtype; 'fp8': fp8 tensor cores)."""
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
# Kernels


def _fit_seconds(fit: MatmulFit, rows: float) -> float:
    """`fit`'s seconds at `rows` input rows: linear between measured rows, the first row's time below
    them, proportional to the rows past the last (large matmuls run at a steady rate)."""
    measured, seconds = fit.rows, fit.seconds
    if rows <= measured[0]:
        return seconds[0]
    i = bisect.bisect_left(measured, rows)
    if i == len(measured):
        return seconds[-1] * rows / measured[-1]
    lo, hi = measured[i - 1], measured[i]
    return seconds[i - 1] + (seconds[i] - seconds[i - 1]) * (rows - lo) / (hi - lo)


@functools.lru_cache(maxsize=4096)
def _nearest_fit(fits: tuple[MatmulFit, ...], k: int, n: int, dtype_bytes: int) -> MatmulFit | None:
    """The measured shape of `dtype_bytes` elements closest to k x n: the same shape, else the one whose
    weight size k*n is nearest on a log scale (ties to the nearer aspect ratio)."""
    same = [f for f in fits if f.dtype_bytes == dtype_bytes]
    for f in same:
        if f.k == k and f.n == n:
            return f
    if not same:
        return None
    return min(same, key=lambda f: (abs(math.log(f.k * f.n / (k * n))), abs(math.log(f.k * n / (k * f.n)))))


def matmul_seconds(hw: HardwareSpec, rows: float, k: int, n: int, dtype_bytes: float,
                   precision: Precision = "bf16") -> float:
    """Seconds of y[rows, n] = x[rows, k] @ W[n, k]^T on one device.

    Measured (`hw.matmuls`, `dtype_bytes` elements): interpolated by rows; a shape that was not measured
    takes the nearest measured shape's time scaled by k*n (the FLOPs and weight bytes both scale so).
    Otherwise the roofline: max(2*rows*k*n / (peak * compute_efficiency), (k*n weight bytes + (rows*k + rows*n)
    activation bytes) / (memory_bandwidth * memory_efficiency)) + kernel_overhead_s, with fp8 weights at one
    byte and the fp8 peak where the hardware multiplies in fp8. Where fp8 weights are dequantized at use
    (CPUs), the matmul is the unquantized one plus the dequantization's elementwise bytes (1 read, one
    compute-dtype element written, per weight).
    """
    if rows <= 0:
        return 0.0
    dequantize = precision == "fp8" and fp8_dequantizes(hw)
    extra = k * n * (1 + dtype_bytes) / hw.elementwise_rate if dequantize else 0.0
    if dequantize:
        precision = "bf16"
    if hw.matmuls and precision == "bf16":
        fit = _nearest_fit(hw.matmuls, k, n, int(dtype_bytes))
        if fit is not None:
            return _fit_seconds(fit, rows) * (k * n) / (fit.k * fit.n) + extra
    weight = PRECISION_BYTES["fp8"] if precision == "fp8" else dtype_bytes
    compute = 2 * rows * k * n / (_peak(hw, precision) * hw.compute_efficiency)
    memory = (k * n * weight + rows * (k + n) * dtype_bytes) / (hw.memory_bandwidth * hw.memory_efficiency)
    return max(compute, memory) + hw.kernel_overhead_s + extra


def elementwise_seconds(hw: HardwareSpec, num_bytes: float) -> float:
    """Seconds of elementwise kernels that move `num_bytes` (read plus written)."""
    return num_bytes / hw.elementwise_rate


# --------------------------------------------------------------------------------------------------
# One model pass on one tensor-parallel rank


# Experts shared out over ranks do not receive equal shares of the tokens; a step waits for the busiest rank.
# Its share over the mean is charged as the capacity factor Switch Transformer and GShard provision per
# expert (1.25: Fedus et al. 2021, Lepikhin et al. 2020).
EXPERT_LOAD_IMBALANCE = 1.25

# The block linears whose output rows are KV heads.
KV_PROJECTIONS = ("self_attn.k_proj", "self_attn.v_proj")


@functools.lru_cache(maxsize=256)
def layer_matmul_shapes(dims: ModelDims, tp: int) -> tuple[tuple[int, int], ...]:
    """(k, n) of each block linear on one rank of a tp group (the inventory's tp styles: column-parallel
    linears split n, row-parallel ones split k; `torch.chunk` rounds the first shards up). The k and v
    projections split over `kv_shards`: a generator with more ranks than KV heads replicates each head."""
    shapes = []
    for module in layer_modules(dims):
        shape = module.shape(dims)
        if module.tp is TpStyle.EXPERT:
            # A token passes through top-k of the experts, which a tp group shares out (ep = tp): per token
            # and rank, the FLOPs of top_k / tp experts' matmuls, on the busiest rank of the group
            # (`EXPERT_LOAD_IMBALANCE` times the mean).
            _, n, k = shape
            imbalance = EXPERT_LOAD_IMBALANCE if tp > 1 else 1.0
            shapes.append((k, math.ceil(n * dims.experts_per_token / tp * imbalance)))
            continue
        if len(shape) != 2:
            continue
        n, k = shape
        if module.tp is TpStyle.COLWISE:
            n = math.ceil(n / (kv_shards(dims, tp) if module.name in KV_PROJECTIONS else tp))
        elif module.tp is TpStyle.ROWWISE:
            k = math.ceil(k / tp)
        shapes.append((k, n))
    return tuple(shapes)


def layer_linear_seconds(dims: ModelDims, hw: HardwareSpec, rows: float, tp: int, dtype_bytes: float,
                         precision: Precision = "bf16") -> float:
    """Seconds of one layer's seven linears over `rows` tokens on one tp rank."""
    return sum(matmul_seconds(hw, rows, k, n, dtype_bytes, precision) for k, n in layer_matmul_shapes(dims, tp))


def layer_elementwise_bytes(dims: ModelDims, tokens: float, tp: int, dtype_bytes: float) -> float:
    """Bytes one layer's forward moves through elementwise kernels for `tokens` tokens on one tp rank
    (the per-feature element counts above; the norms and residuals are replicated over tp)."""
    q = dims.num_heads * dims.head_dim / tp
    kv = dims.num_kv_heads * dims.head_dim / kv_shards(dims, tp)
    elements = (ELEMENTWISE_PER_H * dims.hidden_size + ELEMENTWISE_PER_HQ * q + ELEMENTWISE_PER_HKV * kv
                + ELEMENTWISE_PER_I * dims.intermediate_size / tp)
    return tokens * elements * dtype_bytes


def attention_seconds_per_key(dims: ModelDims, hw: HardwareSpec, queries: float, tp: int,
                              kv_bytes_per_elem: float, read_kv: bool) -> tuple[float, float]:
    """One layer's attention over `queries` queries as (compute, memory) seconds per key each query sees:
    4 * heads/tp * head_dim FLOPs per query and key (the score and value products) at the peak rate, and
    with `read_kv` (decode: each step reads its sequence's cache) the key's K and V bytes per query."""
    heads = math.ceil(dims.num_heads / tp)
    compute = queries * 4 * heads * dims.head_dim / (_peak(hw, "bf16") * hw.compute_efficiency)
    memory = 0.0
    if read_kv:
        per_key = 2 * dims.num_kv_heads * dims.head_dim * kv_bytes_per_elem / kv_shards(dims, tp)
        memory = queries * per_key / (hw.memory_bandwidth * hw.memory_efficiency)
    return compute, memory


VocabUse = Literal["generate", "forward", "train"]


def vocab_seconds(hw: HardwareSpec, rows: float, vocab: int, use: VocabUse) -> float:
    """The float32 work over `rows` x `vocab` logits that `use` does: measured per entry for the nearest
    measured vocabulary size (`hw.vocab`), else `VOCAB_ELEMENTS` elements per entry at the elementwise
    bandwidth."""
    if hw.vocab:
        measured = min(hw.vocab, key=lambda v: abs(math.log(v.vocab_size / vocab)))
        return rows * vocab * getattr(measured, use)
    return elementwise_seconds(hw, rows * vocab * VOCAB_ELEMENTS[use] * FP32_BYTES)


def head_seconds(dims: ModelDims, hw: HardwareSpec, rows: float, tp: int, dtype_bytes: float, use: VocabUse) -> float:
    """The output head over `rows` positions on one tp rank (vocabulary-parallel: V/tp columns) and the
    work over those logits that `use` does (`vocab_seconds`)."""
    vocab = math.ceil(dims.vocab_size / tp)
    return matmul_seconds(hw, rows, dims.hidden_size, vocab, dtype_bytes) + vocab_seconds(hw, rows, vocab, use)


def adapter_linear_seconds(dims: ModelDims, hw: HardwareSpec, rows: float, tp: int, dtype_bytes: float,
                           lora: LoraSpec) -> float:
    """Seconds of one layer's LoRA adapters over `rows` tokens on one tp rank: per adapted projection, x A^T
    (in -> rank) and then B (rank -> out), each cut as the adapter's tp style cuts it."""
    total = 0.0
    for name, layer, cols, rows_out in lora_modules(dims, lora):
        if layer != 0:
            break
        row_parallel = name.endswith(("o_proj", "down_proj"))
        k, n = (math.ceil(cols / tp), rows_out) if row_parallel else (cols, math.ceil(rows_out / tp))
        total += matmul_seconds(hw, rows, k, lora.rank, dtype_bytes) + matmul_seconds(hw, rows, lora.rank, n, dtype_bytes)
    return total


def pass_compute_seconds(dims: ModelDims, hw: HardwareSpec, *, tokens: float, keys: float, head_rows: float,
                         tp: int, dtype_bytes: float, use: VocabUse, layers: float | None = None,
                         recompute: bool = False, lora: LoraSpec | None = None) -> float:
    """Compute seconds of one forward (`use="forward"`) or forward + backward (`"train"`) over `tokens`
    tokens that each attend to `keys` keys, with the head on `head_rows` of them, through `layers` layers
    (all by default) on one tp rank. A backward costs twice the forward's matmuls and attention (gradients
    of the inputs and of the weights) and its elementwise work at the backward elementwise rate;
    `recompute` runs the forward again. With `lora` the base is frozen: a backward computes the gradients of
    the inputs but of no base weight (one forward's linears and head fewer), and the adapters' own matmuls
    run forward and backward (`adapter_linear_seconds`)."""
    layers = dims.num_layers if layers is None else layers
    attention, _ = attention_seconds_per_key(dims, hw, tokens, tp, dtype_bytes, read_kv=False)
    linears = layer_linear_seconds(dims, hw, tokens, tp, dtype_bytes)
    adapters = adapter_linear_seconds(dims, hw, tokens, tp, dtype_bytes, lora) if lora is not None else 0.0
    matmuls = linears + adapters + attention * keys
    elementwise = layer_elementwise_bytes(dims, tokens, tp, dtype_bytes)
    forward = matmuls + elementwise_seconds(hw, elementwise)
    vocab_size = math.ceil(dims.vocab_size / tp)
    head = matmul_seconds(hw, head_rows, dims.hidden_size, vocab_size, dtype_bytes)
    vocab = vocab_seconds(hw, head_rows, vocab_size, use)
    if use == "forward":
        return layers * forward + head + vocab
    frozen = lora is not None  # no weight gradients of the base's linears and head
    backward = 2 * matmuls - (linears if frozen else 0.0) + elementwise / hw.backward_elementwise_rate
    return layers * ((2 if recompute else 1) * forward + backward) + (2 if frozen else 3) * head + vocab


def optimizer_seconds(hw: HardwareSpec, params: float) -> float:
    """AdamW and gradient clipping over `params` float32 parameters: the measured seconds per parameter,
    else `OPTIMIZER_ELEMENTS_PER_PARAM` float32 elements each at the elementwise bandwidth."""
    if hw.optimizer_param_s > 0:
        return params * hw.optimizer_param_s
    return elementwise_seconds(hw, params * OPTIMIZER_ELEMENTS_PER_PARAM * FP32_BYTES)


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



def engine_reload_seconds(dims: ModelDims, hw: HardwareSpec, tp: int, dtype_bytes: float) -> float:
    """Seconds for a serving engine to take new weights it was handed in place (a refit): its loader
    visits every weight tensor (`engine_reload_tensor_s` each) and copies this rank's share of the
    weights into its own parameters (read and written at the effective memory bandwidth)."""
    copied = 2 * weight_bytes(dims, dtype_bytes) / tp
    return (param_tensor_count(dims) * hw.engine_reload_tensor_s
            + copied / (hw.memory_bandwidth * hw.memory_efficiency))


def engine_refit_seconds(dims: ModelDims, hw: HardwareSpec, tp: int, dtype_bytes: float, tp_spans_nodes: bool) -> float:
    """Seconds for a serving engine to take a sync's weights: a tensor-parallel replica first gathers its
    shards whole on its first rank, one all-gather per tensor (its engine's workers cut their own shards),
    then the engine reloads them (`engine_reload_seconds`). One formula for the search, the plan's
    operations and the programs."""
    reload = engine_reload_seconds(dims, hw, tp, dtype_bytes)
    if tp == 1:
        return reload
    return reload + chunked_collective_time("all_gather", weight_bytes(dims, dtype_bytes), param_tensor_count(dims),
                                            tp, hw, tp_spans_nodes)


def engine_time_factor(hw: HardwareSpec, engine: str) -> float:
    """How much longer (< 1: shorter) a generator on `engine` takes than the native sampler the roofline
    models: the ratio `graphrl calibrate` measured on this machine, or 1 where it measured none (the
    native sampler itself; a GPU preset, whose engine throughput is not modelled separately)."""
    for measured in hw.engines:
        if measured.engine == engine:
            return measured.native_tokens_per_s / measured.tokens_per_s
    return 1.0



# --------------------------------------------------------------------------------------------------
# Generation (prefill + decode)


def _layer_without_attention(dims: ModelDims, hw: HardwareSpec, rows: float, tp: int, dtype_bytes: float,
                             precision: Precision) -> float:
    """One layer's linears and elementwise work over `rows` tokens on one tp rank."""
    return (layer_linear_seconds(dims, hw, rows, tp, dtype_bytes, precision)
            + elementwise_seconds(hw, layer_elementwise_bytes(dims, rows, tp, dtype_bytes)))


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
    dtype_bytes: float = BF16_BYTES,
    kv_bytes_per_elem: float | None = None,
    lengths: Lengths | None = None,
    continuous: bool = False,
    lora: LoraSpec | None = None,
) -> float:
    """Seconds for one generator replica (a tp group) to answer `batch` prompts: a prefill forward over the
    prompts, then one forward per further token (with `lora`, every pass also runs the adapters' matmuls:
    they are applied beside the base weights, not merged into them).

    - lengths: the responses' length distribution (default: every response `response_len` long). The
      native sampler decodes its batch in lockstep until its longest response ends
      (`Lengths.longest(batch)` steps, every row computed); a continuous-batching engine (`continuous`)
      decodes only the responses still running, its batch shrinking along `Lengths.survival`;
    - prefill: every layer's linears, attention (each prompt token over the whole prompt) and elementwise
      work over batch*prompt_len tokens, the head and sampling over the batch's last positions;
    - a decode step over b running rows emitting token t (feeding position prompt_len + t - 2): the
      linears, elementwise work, head and sampling over b rows (`matmul_seconds` makes them memory-bound
      at small b), and attention over the prompt_len + t - 1 cached keys: max(its FLOPs, the K/V bytes it
      reads), summed over the steps in closed form;
    - tensor parallel (tp > 1): `_tp_comm_per_pass` per pass;
    - an engine's decode step takes at least `serving_step_floor_s` (its host side, overlapped);
    - host: `layer_overhead_s` per layer (plus `tensor_parallel_layer_overhead_s` on a tp rank) and
      `pass_overhead_s` per pass, `decode_token_overhead_s` per generated token and layer.
    `precision` 'fp8' stores block linears at one byte (`matmul_seconds`); the KV cache holds
    `kv_bytes_per_elem` (default: the compute dtype).
    """
    _peak(hw, precision)  # fp8 on hardware without it is refused here, whatever the matmul source
    kv = dtype_bytes if kv_bytes_per_elem is None else kv_bytes_per_elem
    layers = dims.num_layers
    spans_nodes = not intra_node
    lengths = lengths if lengths is not None else Lengths.fixed(response_len)

    prompt_tokens = batch * prompt_len
    att_prompt, _ = attention_seconds_per_key(dims, hw, prompt_tokens, tp, kv, read_kv=False)
    prefill = layers * (_layer_without_attention(dims, hw, prompt_tokens, tp, dtype_bytes, precision)
                        + att_prompt * prompt_len)
    if lora is not None:
        prefill += layers * adapter_linear_seconds(dims, hw, prompt_tokens, tp, dtype_bytes, lora)
    prefill += head_seconds(dims, hw, batch, tp, dtype_bytes, "generate")
    prefill += _tp_comm_per_pass(dims, prompt_tokens, batch, tp, hw, spans_nodes)

    per_layer = hw.layer_overhead_s + (hw.tensor_parallel_layer_overhead_s if tp > 1 else 0.0)
    per_pass_host = layers * per_layer + hw.pass_overhead_s
    spans = lengths.survival(batch) if continuous else [(0.0, lengths.longest(batch), float(batch))]
    decode, host = 0.0, per_pass_host
    for first, last, rows in spans:
        host += rows * (last - first) * layers * hw.decode_token_overhead_s
        steps = last - max(first, 1.0)  # token 1 comes from the prefill's logits
        if steps <= 0:
            continue
        # Every decode step but its attention, which grows with the context: keys sum to
        # steps * (prompt_len + mean t - 1) over the span's tokens t.
        per_step = decode_step_cost(dims, math.ceil(rows), 0, tp, hw, precision=precision, dtype_bytes=dtype_bytes,
                                    kv_bytes_per_elem=kv, intra_node=intra_node)
        if lora is not None:
            per_step += layers * adapter_linear_seconds(dims, hw, math.ceil(rows), tp, dtype_bytes, lora)
        att_compute, att_memory = attention_seconds_per_key(dims, hw, rows, tp, kv, read_kv=True)
        keys = steps * (prompt_len + (max(first, 1.0) + 1 + last) / 2 - 1)
        device = steps * per_step + layers * max(att_compute, att_memory) * keys
        if continuous:  # an engine's host side overlaps the device's work: the slower sets the pace
            device = max(device, steps * hw.serving_step_floor_s)
        decode += device + steps * per_pass_host
    return prefill + decode + host


def decode_step_cost(
    dims: ModelDims,
    batch: int,
    context_len: float,
    tp: int,
    hw: HardwareSpec,
    *,
    precision: Precision = "bf16",
    dtype_bytes: float = BF16_BYTES,
    kv_bytes_per_elem: float | None = None,
    intra_node: bool = True,
) -> float:
    """Seconds of one decode step without host time: `batch` sequences each emit one token attending to
    `context_len` keys (one term of `generation_time`'s sum)."""
    kv = dtype_bytes if kv_bytes_per_elem is None else kv_bytes_per_elem
    compute, memory = attention_seconds_per_key(dims, hw, batch, tp, kv, read_kv=True)
    layer = _layer_without_attention(dims, hw, batch, tp, dtype_bytes, precision) + max(compute, memory) * context_len
    return (dims.num_layers * layer + head_seconds(dims, hw, batch, tp, dtype_bytes, "generate")
            + _tp_comm_per_pass(dims, batch, batch, tp, hw, not intra_node))


# --------------------------------------------------------------------------------------------------
# Training and forward passes


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
    dims: ModelDims, sharding: str, d: int, tp: int, pp: int, hw: HardwareSpec, spans_nodes: bool, units: int,
    gathered: bool = False, lora: LoraSpec | None = None,
) -> tuple[float, float]:
    """Per-step data-parallel collectives of a training role: (overlappable_s, not_overlappable_s).

    Buffers are the bf16 weights/grads of one model-parallel slice, 2*P/(tp*pp) bytes, moved as the
    executors move them (`graphrl.schemas.capabilities`):
      none (DDP): all-reduce grads, bucketed during backward;
      zero1 (DDP + ZeroRedundancyOptimizer): the same all-reduce, then every rank's updated share of
        the weights is broadcast to the others after the optimizer step (an all-gather, not overlapped);
      zero2 (FSDP2, weights kept from forward through backward): all-gather the weights once, unit by
        unit in forward (`units`, as `fsdp_units` counts them), and reduce-scatter grads during backward;
      fsdp: all-gather weights for forward and again for backward (resharded after forward), and
        reduce-scatter grads, all prefetched unit by unit.
    `gathered`: the weights are whole when forward starts (a colocated generator's weight sync gathered
    them, `generator_reads_trainer`): forward gathers nothing. With `lora` the gradients and the updated
    shares are the adapters' alone (FSDP2 still gathers the frozen base with them).
    """
    if d <= 1:
        return 0.0, 0.0
    buffer = param_count(dims) / (tp * pp) * BF16_BYTES
    trained = buffer if lora is None else lora_param_count(dims, lora) / (tp * pp) * BF16_BYTES
    buckets = math.ceil(trained / DDP_BUCKET_BYTES)
    all_reduce = chunked_collective_time("all_reduce", trained, buckets, d, hw, spans_nodes)
    if sharding == "none":
        return all_reduce, 0.0
    if sharding == "zero1":
        return all_reduce, chunked_collective_time("all_gather", trained, buckets, d, hw, spans_nodes)
    held = buffer if lora is None else buffer + trained  # the weights FSDP2 gathers: the base and the adapters
    gather = chunked_collective_time("all_gather", held, units, d, hw, spans_nodes)
    scatter = chunked_collective_time("reduce_scatter", trained, units, d, hw, spans_nodes)
    forward_gather = 0.0 if gathered else gather
    if sharding == "fsdp":
        return forward_gather + gather + scatter, 0.0
    if sharding == "zero2":
        return forward_gather + scatter, 0.0
    raise ValueError(f"unknown sharding {sharding!r}; expected one of {SHARDINGS}")


def _overlap(comm_s: float, window_s: float, pieces: float) -> float:
    """Exposed part of communication in `pieces` (FSDP2 units, or layers for DDP's buckets) that runs on
    its own stream beside compute.

    Overlap assumption: one piece's share (the first gather before forward starts, the last
    reduce after backward ends) is always exposed; the rest hides behind up to `window_s` of compute.
    """
    if comm_s <= 0.0:
        return 0.0
    edge = comm_s / max(pieces, 1.0)
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



def _micro_batches_compute(dims: ModelDims, hw: HardwareSpec, *, tokens: float, head_rows: float | None, seq_len: int,
                           d: int, m: int, tp: int, pp: int, dtype_bytes: float, use: VocabUse,
                           recompute: bool = False, lora: LoraSpec | None = None) -> tuple[float, float, float]:
    """(tokens per micro-batch, layers per stage, compute seconds) of `m` micro-batches of one data-parallel
    rank's share of `tokens` (the head on its share of `head_rows`, all tokens by default), each a
    `pass_compute_seconds` through one pipeline stage."""
    tokens_per_micro_batch = tokens / (d * m)
    rows_per_micro_batch = (tokens if head_rows is None else head_rows) / (d * m)
    layers_per_stage = dims.num_layers / pp
    compute = m * pass_compute_seconds(dims, hw, tokens=tokens_per_micro_batch, keys=seq_len,
                                       head_rows=rows_per_micro_batch, tp=tp, dtype_bytes=dtype_bytes, use=use,
                                       layers=layers_per_stage, recompute=recompute, lora=lora)
    return tokens_per_micro_batch, layers_per_stage, compute


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
    dtype_bytes: float = BF16_BYTES,
    head_rows: float | None = None,
    weights_gathered: bool = False,
    lora: LoraSpec | None = None,
) -> StepCost:
    """Seconds of one optimizer step over `tokens` tokens (the global batch, all data-parallel ranks) in
    sequences of `seq_len`, with the output head on `head_rows` of them (all by default; the executors
    take log-probs of the response positions only).

    - compute, per micro-batch of tokens/(dp*fsdp*m) tokens on one rank: `pass_compute_seconds`
      (forward + backward, a second forward with `recompute`) through this stage's L/pp layers and the
      head; then AdamW and clipping over this rank's parameters (`optimizer_seconds`; sharded over the
      data-parallel group for zero1, zero2 and fsdp);
    - tensor parallel: per layer and micro-batch, 2 all-reduces in forward and 2 in backward (2 more
      when recompute reruns the forward) of the micro-batch's bf16 activations (tokens_mb*H*2 bytes),
      on the critical path; a tp group that spans nodes pays inter-node bandwidth.
    - pipeline: forward and backward sends between stages per micro-batch (`_pipeline_p2p`), and the
      1F1B bubble: the ideal time stretches by (m+pp-1)/m, i.e. a bubble fraction (pp-1)/(m+pp-1) of
      the total, with m = `microbatches` (default 4*pp).
    - data parallel (`_data_parallel_comm`): overlapped with compute as `_overlap` assumes, within
      the backward compute for DDP and ZeRO-1 (2/3 of compute, 3/4 with recompute) and within forward +
      backward for the FSDP2 shardings (zero2, fsdp); ZeRO-1's weight broadcast after the optimizer
      step is fully exposed, and so are the update's small all-reduces before its loss (the batch's
      token counts, and with micro-batches their count). `weights_gathered`: forward finds the weights
      gathered (by a colocated generator's weight sync) and gathers nothing.
    - host: per micro-batch, `train_layer_overhead_s` per layer (plus `layer_overhead_s` with recompute,
      and `data_parallel_layer_overhead_s` on a data-parallel rank) and `train_pass_overhead_s`, plus
      `sharded_unit_overhead_s` per FSDP2 unit where FSDP2 shards the model; and per step
      `zero1_step_overhead_s` on a ZeRO-1 rank.
    - `lora`: adapters train on a frozen base: the backward without the base's weight gradients
      (`pass_compute_seconds`), AdamW over the adapters, the adapters' gradients reduced.
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; expected one of {SHARDINGS}")
    d = dp * fsdp
    m = microbatches if microbatches is not None else 4 * pp
    tokens_per_micro_batch, layers_per_stage, compute = _micro_batches_compute(
        dims, hw, tokens=tokens, head_rows=head_rows, seq_len=seq_len, d=d, m=m, tp=tp, pp=pp,
        dtype_bytes=dtype_bytes, use="train", recompute=recompute, lora=lora)
    trained = param_count(dims) if lora is None else lora_param_count(dims, lora)
    local_params = trained / (tp * pp) / (d if sharding != "none" else 1)
    compute += optimizer_seconds(hw, local_params)

    tp_comm = 0.0
    if tp > 1:
        calls_per_layer = 6 if recompute else 4
        activation = tokens_per_micro_batch * dims.hidden_size * BF16_BYTES
        per_call = collective_time("all_reduce", activation, tp, hw, not intra_node_tp)
        tp_comm = calls_per_layer * layers_per_stage * m * per_call
    pp_comm = _pipeline_p2p(dims, tokens_per_micro_batch, tp, pp, m, 2, hw, pp_spans_nodes)

    units = fsdp_units(dims, tp=tp, dtype_bytes=dtype_bytes, pp=pp)
    overlappable, not_overlappable = _data_parallel_comm(dims, sharding, d, tp, pp, hw, dp_spans_nodes, units,
                                                         gathered=weights_gathered, lora=lora)
    if d > 1:  # the update's own all-reduces: the batch's token counts, and the micro-batch count
        not_overlappable += (1 + (m > 1)) * collective_time("all_reduce", UPDATE_COUNTS_BYTES, d, hw, dp_spans_nodes)
    if sharding in ("fsdp", "zero2"):  # the first gather and the last reduction are one unit's
        window, pieces = compute, float(units)
    else:
        window, pieces = compute * (3 / 4 if recompute else 2 / 3), layers_per_stage
    exposed_dp = not_overlappable + _overlap(overlappable, window, pieces)

    critical = compute + tp_comm + pp_comm
    bubble = critical * (pp - 1) / m
    exposed = tp_comm + pp_comm + exposed_dp
    per_layer = hw.train_layer_overhead_s + (hw.layer_overhead_s if recompute else 0.0)
    per_pass = hw.train_pass_overhead_s
    if d > 1:
        per_layer += hw.data_parallel_layer_overhead_s
        if sharding in ("zero2", "fsdp"):
            per_pass += units * hw.sharded_unit_overhead_s
    host = m * (layers_per_stage * per_layer + per_pass)
    if d > 1 and sharding == "zero1":
        host += hw.zero1_step_overhead_s
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
    dtype_bytes: float = BF16_BYTES,
    head_rows: float | None = None,
    trained: bool = False,
    sharded: bool | None = None,
) -> StepCost:
    """Seconds of a forward-only pass (logprob, value or reward) over `tokens` tokens in sequences of
    `seq_len`, spread over dp*fsdp data-parallel ranks, the head on `head_rows` of them (all by default).

    - compute per micro-batch: `pass_compute_seconds` (forward) through this stage's layers and the head;
    - tensor parallel: 2 all-reduces per layer and micro-batch (critical path).
    - `sharded` (FSDP2 holds the weights as shards over the D = dp*fsdp ranks; default: when fsdp > 1):
      one all-gather of the bf16 weights over them, a collective per FSDP2 unit (`fsdp_units`: a frozen
      model's are its layers), overlapped with compute as in `_overlap`, and
      `sharded_forward_unit_overhead_s` of host time per unit and micro-batch.
    - pipeline: forward sends and the bubble (pp-1)/m of the ideal time, m = `microbatches`
      (default 4*pp).
    - host: `layer_overhead_s` per layer (plus `tensor_parallel_layer_overhead_s` on a tp rank) and
      `pass_overhead_s` per micro-batch.
    """
    _peak(hw, precision)
    d = dp * fsdp
    m = microbatches if microbatches is not None else 4 * pp
    tokens_per_micro_batch, layers_per_stage, compute = _micro_batches_compute(
        dims, hw, tokens=tokens, head_rows=head_rows, seq_len=seq_len, d=d, m=m, tp=tp, pp=pp,
        dtype_bytes=dtype_bytes, use="forward")

    tp_comm = 0.0
    if tp > 1:
        activation = tokens_per_micro_batch * dims.hidden_size * BF16_BYTES
        per_call = collective_time("all_reduce", activation, tp, hw, not intra_node_tp)
        tp_comm = 2 * layers_per_stage * m * per_call
    pp_comm = _pipeline_p2p(dims, tokens_per_micro_batch, tp, pp, m, 1, hw, pp_spans_nodes)

    gather = 0.0
    units = fsdp_units(dims, tp=tp, dtype_bytes=dtype_bytes, pp=pp, trained=trained)
    sharded = (fsdp > 1 if sharded is None else sharded) and d > 1
    if sharded:
        buffer = param_count(dims) / (tp * pp) * BF16_BYTES
        gather = chunked_collective_time("all_gather", buffer, units, d, hw, dp_spans_nodes)
    exposed_gather = _overlap(gather, compute, units)

    critical = compute + tp_comm + pp_comm
    bubble = critical * (pp - 1) / m
    exposed = tp_comm + pp_comm + exposed_gather
    per_layer = hw.layer_overhead_s + (hw.tensor_parallel_layer_overhead_s if tp > 1 else 0.0)
    per_pass = hw.pass_overhead_s + (units * hw.sharded_forward_unit_overhead_s if sharded else 0.0)
    host = m * (layers_per_stage * per_layer + per_pass)
    return StepCost(
        compute_s=compute + host, comm_s=tp_comm + pp_comm + gather, exposed_comm_s=exposed, bubble_s=bubble,
        total_s=compute + host + exposed + bubble,
    )


def weight_copy_seconds(hw: HardwareSpec, bucket_bytes: Sequence[float], spans_nodes: bool) -> float:
    """Seconds of a weight copy in rounds of point-to-point transfers (DDMA), each round as long as its
    largest bucket over the link it crosses (`p2p_seconds`)."""
    return sum(p2p_seconds(hw, b, spans_nodes) for b in bucket_bytes)


def p2p_seconds(hw: HardwareSpec, num_bytes: float, spans_nodes: bool) -> float:
    """One point-to-point transfer (a rollout `Send`/`Recv`, a DDMA bucket): bytes / link bandwidth +
    the link latency (`collective_time`'s p2p row, without a calibrated fit: gloo p2p was measured as the
    link figures themselves)."""
    bw = (hw.inter_node_bandwidth if spans_nodes else hw.intra_node_bandwidth) * hw.link_efficiency
    return num_bytes / bw + hw.link_latency_s
