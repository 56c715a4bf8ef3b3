"""Accelerator descriptions: the few figures the cost model needs, with datasheet presets.

Figures are per device. Bandwidths are unidirectional bytes/s. Efficiency factors turn datasheet
peaks into achievable rates (no device reaches its peak FLOP/s on real matmuls, nor its link rate on
real collectives); they are the knobs `graphrl calibrate` fits for the local CPU.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from graphrl.schemas.base import Frozen, Integer, Real

GB = 1e9
GiB = 2**30
TFLOPS = 1e12


MeasuredCollective = Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast"]


class EnvironmentTiming(Frozen):
    """An environment's calls as measured by `graphrl calibrate JOB`: a few of the job's episodes run with its
    model at its initial weights on this machine. The preview charges `seconds_per_call` for a job whose
    environment (class and options) is this one and that gives no estimate of its own."""

    env: str = Field(description="The environment as a job names it ('calculator', 'module:Class').")
    options: str = Field(description="Its options, as canonical JSON.")
    seconds_per_call: Real = Field(ge=0, description="Mean seconds of one call (reset or step).")
    calls: int = Field(ge=0, description="Calls measured.")
    episodes: int = Field(ge=0, description="Episodes they came from.")


class EngineThroughput(Frozen):
    """A generation engine's measured speed next to graphrl's native sampler, on the same probe model,
    prompts and machine (`graphrl calibrate`). The cost model scales the native sampler's predicted
    generation time by `native_tokens_per_s / tokens_per_s` for a generator on this engine."""

    engine: Literal["vllm"] = Field(description="The engine measured.")
    tokens_per_s: Real = Field(gt=0, description="Generated tokens per second of the engine on the probe.")
    native_tokens_per_s: Real = Field(gt=0, description="Generated tokens per second of the native sampler on the probe.")
    probe: str = Field(description="What was measured: model, sequences x new tokens, dtype, threads.")


class CollectiveFit(Frozen):
    """One collective measured on one node for one group size, as ring-model figures.

    The cost model's ring formulas give a collective's time from a bus bandwidth and a per-step
    latency; a fit stores the pair that reproduces the measured times of this kind and group size.
    """

    kind: MeasuredCollective = Field(description="Which collective was measured.")
    group_size: Integer = Field(ge=2, description="Number of ranks in the measured group.")
    bus_bandwidth: Real = Field(gt=0, description="Ring-model link bandwidth that fits the measurement, bytes/s.")
    latency_s: Real = Field(ge=0, description="Ring-model latency per step that fits the measurement, seconds.")


# 4: general matmul shapes and vocabulary costs are measured at every thread count a rank may use, and a
# vocabulary cost records its threads.
CALIBRATION_FORMAT = 4
"""The version of a calibration file's content (`graphrl calibrate`): a file of another version is ignored,
with a warning, since its figures may mean something else or miss ones the cost model now reads."""


class MachineId(Frozen):
    """The machine a calibration file was measured on, so that a file copied to another machine (or left
    behind after a move to new hardware) is not taken for this one's figures."""

    cpu_model: str = Field(description="The CPU's model name, as /proc/cpuinfo's `model name` (or "
                                       "platform.processor()) gives it; empty where neither says.")
    logical_cores: Integer = Field(ge=1, description="Logical cores (hardware threads) the OS reports.")
    threads: Integer | None = Field(
        default=None, ge=1,
        description="torch threads per rank the figures were measured with; not part of the machine's identity "
                    "(two descriptions of one machine with other thread counts are the same machine).")

    def same_machine(self, other: "MachineId") -> bool:
        """The same CPU model and core count; the thread count is a setting, not the machine."""
        return (self.cpu_model, self.logical_cores) == (other.cpu_model, other.logical_cores)

    def describe(self) -> str:
        return f"{self.cpu_model or 'an unnamed CPU'} with {self.logical_cores} logical cores"


class MatmulFit(Frozen):
    """Measured seconds of one linear layer's matmul, y[m, n] = x[m, k] @ W[n, k]^T, by the rows m of its
    input (`graphrl calibrate JOB` measures every weight shape of the job's models). The timing model
    interpolates between the measured rows linearly and scales past the last one by rows."""

    k: Integer = Field(gt=0, description="Input features (the weight's columns).")
    n: Integer = Field(gt=0, description="Output features (the weight's rows).")
    dtype_bytes: Integer = Field(gt=0, description="Bytes per element of the weights and activations measured.")
    threads: Integer = Field(gt=0, description="torch intra-op threads of the measuring process.")
    rows: tuple[Integer, ...] = Field(min_length=1, description="Input rows measured, ascending.")
    seconds: tuple[Real, ...] = Field(min_length=1, description="Seconds of one matmul at each of `rows`.")


class VocabCost(Frozen):
    """Measured seconds per row and vocabulary entry of the float32 work over the head's logits, for one
    vocabulary size (`graphrl calibrate JOB`): sampling a token and its log-prob in generation, a log-prob
    pass's log-softmax and entropy, and a training pass's forward and backward of them."""

    vocab_size: Integer = Field(gt=0, description="Vocabulary entries per row measured.")
    threads: Integer = Field(default=1, gt=0, description="torch intra-op threads of the measuring process.")
    generate: Real = Field(ge=0, description="Seconds per row and entry of sampling plus the sampled token's log-prob.")
    forward: Real = Field(ge=0, description="Seconds per row and entry of a log-prob pass (log-softmax, entropy).")
    train: Real = Field(ge=0, description="Seconds per row and entry of a training pass (that forward and its backward).")


HOST_FIT_FIELDS = ("layer_overhead_s", "pass_overhead_s", "decode_token_overhead_s", "train_layer_overhead_s",
                   "train_pass_overhead_s", "data_parallel_layer_overhead_s", "sharded_unit_overhead_s",
                   "zero1_step_overhead_s", "sharded_forward_unit_overhead_s", "tensor_parallel_layer_overhead_s",
                   "elementwise_bandwidth", "backward_elementwise_bandwidth")


class HostFit(Frozen):
    """The host overheads and elementwise rates `graphrl calibrate JOB` fitted to one job's own models
    (their width, in their dtype and threads): a rank of a model of that width uses them instead of the
    description's general figures (`HardwareSpec.for_rank`). Fields as in `HardwareSpec`."""

    hidden_size: Integer = Field(gt=0, description="Hidden size of the models probed.")
    threads: Integer = Field(gt=0, description="torch threads per process of the probes.")
    tokens: Integer = Field(default=0, ge=0, description="Tokens per rank of the job's step (its per-rank batch times "
                                                         "prompt and response length) the probes ran.")
    layer_overhead_s: Real = Field(ge=0, description="Host seconds per layer per forward pass.")
    pass_overhead_s: Real = Field(ge=0, description="Host seconds per forward pass outside the layers.")
    decode_token_overhead_s: Real = Field(ge=0, description="Host seconds per generated token per layer.")
    train_layer_overhead_s: Real = Field(ge=0, description="Host seconds per layer per training micro-batch.")
    train_pass_overhead_s: Real = Field(ge=0, description="Host seconds per training micro-batch outside the layers.")
    data_parallel_layer_overhead_s: Real = Field(ge=0, description="Extra host seconds per layer per training "
                                                                   "micro-batch of a data-parallel rank.")
    sharded_unit_overhead_s: Real = Field(ge=0, description="Further host seconds per FSDP2 unit per training "
                                                            "micro-batch of a rank whose state FSDP2 shards.")
    zero1_step_overhead_s: Real = Field(default=0.0, ge=0, description="Further host seconds per optimizer step of "
                                                                      "a ZeRO-1 rank.")
    sharded_forward_unit_overhead_s: Real = Field(default=0.0, ge=0, description="Further host seconds per FSDP2 "
                                                  "unit per forward micro-batch of a rank whose weights FSDP2 shards.")
    tensor_parallel_layer_overhead_s: Real = Field(ge=0, description="Extra host seconds per layer per forward "
                                                                     "pass of a tensor-parallel rank.")
    elementwise_bandwidth: Real = Field(ge=0, description="Bytes/s of a forward's elementwise kernels.")
    backward_elementwise_bandwidth: Real = Field(ge=0, description="A backward's elementwise work, in bytes/s "
                                                                   "of the forward's elementwise bytes.")


class HardwareSpec(Frozen):
    """One kind of device and the links between devices."""

    name: str = Field(description="Name shown in plans, e.g. 'h100-sxm-80gb'.")
    kind: Literal["gpu", "cpu"] = Field(default="gpu", description="Device family; selects NCCL or gloo.")
    peak_bf16_flops: Real = Field(gt=0, description="Dense bf16 matmul peak, FLOP/s per device.")
    peak_fp8_flops: Real = Field(
        default=0.0, ge=0, description="Dense fp8 matmul peak, FLOP/s per device; 0 means fp8 is unsupported."
    )
    memory_bytes: Real = Field(gt=0, description="Device memory capacity in bytes.")
    memory_bandwidth: Real = Field(gt=0, description="Device memory bandwidth, bytes/s.")
    intra_node_bandwidth: Real = Field(
        gt=0, description="Link bandwidth per device to devices of the same node (NVLink), bytes/s, one direction."
    )
    inter_node_bandwidth: Real = Field(
        gt=0, description="Network bandwidth per device to other nodes (InfiniBand/RoCE), bytes/s, one direction."
    )
    host_link_bandwidth: Real = Field(
        gt=0, description="Device <-> host memory bandwidth per device (PCIe), bytes/s, for offload."
    )
    link_latency_s: Real = Field(default=10e-6, ge=0, description="Fixed latency of one transfer, seconds.")
    compute_efficiency: Real = Field(
        default=0.5, gt=0, le=1, description="Achievable fraction of peak FLOP/s in training and prefill."
    )
    memory_efficiency: Real = Field(
        default=0.7, gt=0, le=1, description="Achievable fraction of memory bandwidth (memory-bound decode)."
    )
    link_efficiency: Real = Field(
        default=0.8, gt=0, le=1, description="Achievable fraction of link bandwidth in collectives."
    )
    op_overhead_s: Real = Field(
        default=0.0, ge=0, description="Fixed host overhead per executed instruction, seconds."
    )
    layer_overhead_s: Real = Field(
        default=0.0, ge=0,
        description="Fixed host time per transformer layer per forward pass (kernel launches, dispatch), "
                    "seconds; dominant for tiny models on CPU, negligible for large ones on GPUs.",
    )
    pass_overhead_s: Real = Field(
        default=0.0, ge=0,
        description="Fixed host time per forward pass outside the layers (embedding, final norm, output head, "
                    "sampling or log-softmax), seconds.",
    )
    decode_token_overhead_s: Real = Field(
        default=0.0, ge=0,
        description="Host time per generated token per transformer layer beyond its FLOPs (KV-cache append, "
                    "per-sequence bookkeeping), seconds; visible on CPUs, negligible on GPUs.",
    )
    train_layer_overhead_s: Real = Field(
        default=0.0, ge=0,
        description="Fixed host time per transformer layer per training micro-batch: its forward, backward and "
                    "optimizer update, seconds.",
    )
    train_pass_overhead_s: Real = Field(
        default=0.0, ge=0,
        description="Fixed host time per training micro-batch outside the layers (loss, gradient clipping, "
                    "optimizer bookkeeping), seconds.",
    )
    collectives: tuple[CollectiveFit, ...] = Field(
        default=(),
        description="Measured collectives within one node (from `graphrl calibrate`); the cost model uses the "
                    "fit of the nearest measured group size and falls back to the link figures without one.",
    )
    environments: tuple[EnvironmentTiming, ...] = Field(
        default=(), description="Environments measured on this machine (`graphrl calibrate JOB` of a job with one).")
    engines: tuple[EngineThroughput, ...] = Field(
        default=(),
        description="Measured generation engines (from `graphrl calibrate`, where the engine is installed); a "
                    "generator on an engine without a measurement is costed as the native sampler.",
    )
    serving_step_floor_s: Real = Field(
        default=0.0, ge=0,
        description="The shortest decode step of a serving engine (vLLM) at any batch: its host-side scheduling, "
                    "sampling and output processing overlap the device's work, so a step takes the longer of the "
                    "two; 0 means the device's work alone.",
    )
    engine_reload_tensor_s: Real = Field(
        default=0.18e-3, ge=0,
        description="Host seconds per weight tensor of reloading new weights into a serving engine (vLLM's "
                    "weight loader), beside copying its bytes; the default is the per-tensor cost NeMo-RL measured "
                    "for rebuilding a shared CUDA tensor in its refit (NeMo-RL blog, 2025-08-12).",
    )
    kernel_overhead_s: Real = Field(
        default=0.0, ge=0,
        description="Fixed time of one kernel (launch and tail), seconds, added to every matmul's roofline; on a "
                    "CPU the fitted per-layer host times carry it instead.",
    )
    elementwise_bandwidth: Real = Field(
        default=0.0, ge=0,
        description="Bytes/s that elementwise kernels (norms, rotary embedding, activations, residuals, the softmax "
                    "over the vocabulary, the optimizer update) achieve; 0 means memory_bandwidth * memory_efficiency. "
                    "`graphrl calibrate` fits it from the executor's own model code.",
    )
    backward_elementwise_bandwidth: Real = Field(
        default=0.0, ge=0,
        description="The backward pass's elementwise work (autograd's saved tensors, the gradients of the norms, "
                    "rotary embedding and activations) as bytes/s of the forward's elementwise bytes; 0 means half the "
                    "elementwise rate (a backward moves about twice a forward's bytes). Fitted by `graphrl calibrate`.",
    )
    data_parallel_layer_overhead_s: Real = Field(
        default=0.0, ge=0,
        description="Host time per transformer layer per training micro-batch of a data-parallel rank beyond its "
                    "own computation and the modelled collectives (the wrapper's gradient hooks and bucket "
                    "bookkeeping, waiting for the other ranks), seconds. Fitted by `graphrl calibrate` from "
                    "side-by-side data-parallel probes.",
    )
    host_fits: tuple[HostFit, ...] = Field(
        default=(),
        description="Host figures fitted to the models of the jobs calibrated (`graphrl calibrate JOB`), by model "
                    "width and threads; see `for_rank`.",
    )
    sharded_forward_unit_overhead_s: Real = Field(
        default=0.0, ge=0,
        description="Further host time per FSDP2 unit per forward-only micro-batch (log-probs, values, rewards) of a "
                    "rank whose weights FSDP2 shards (a frozen model beside a data-parallel trainer, or a zero2/fsdp "
                    "trainer's own forward): its gathers' hooks and waits beyond the modelled collective, seconds. "
                    "Fitted by `graphrl calibrate` from a side-by-side probe of a sharded frozen model.",
    )
    zero1_step_overhead_s: Real = Field(
        default=0.0, ge=0,
        description="Further host time per optimizer step of a data-parallel rank whose optimizer state ZeRO-1 shards "
                    "(torch's ZeroRedundancyOptimizer: its partition bookkeeping and per-rank broadcasts beyond the "
                    "modelled all-gather), seconds. Fitted by `graphrl calibrate` from side-by-side ZeRO-1 probes.",
    )
    sharded_unit_overhead_s: Real = Field(
        default=0.0, ge=0,
        description="Further host time per FSDP2 unit (`fsdp_layer_units`) per training micro-batch of a rank whose "
                    "weights FSDP2 shards (zero2, fsdp): its gathers' and reductions' hooks and waits beyond the "
                    "modelled collectives, seconds. Fitted by `graphrl calibrate` from side-by-side FSDP2 probes.",
    )
    tensor_parallel_layer_overhead_s: Real = Field(
        default=0.0, ge=0,
        description="Host time per transformer layer per forward pass of a rank of a tensor-parallel group beyond "
                    "the modelled all-reduces (waiting for the other ranks at each), seconds. Fitted by `graphrl "
                    "calibrate` from side-by-side tensor-parallel generation probes.",
    )
    matmuls: tuple[MatmulFit, ...] = Field(
        default=(),
        description="Measured matmul times by weight shape and rows (from `graphrl calibrate JOB`); a shape not "
                    "measured is scaled from the nearest measured one, and without any the roofline of the peak "
                    "FLOP/s and memory bandwidth is used.",
    )
    optimizer_param_s: Real = Field(
        default=0.0, ge=0,
        description="Measured seconds per parameter of the optimizer step (AdamW and gradient-norm clipping, float32; "
                    "from `graphrl calibrate JOB`, at the job's model size); 0 means the step is timed by the bytes it "
                    "moves at the elementwise bandwidth.",
    )
    vocab: tuple[VocabCost, ...] = Field(
        default=(),
        description="Measured costs of the work over the vocabulary by vocabulary size (from `graphrl calibrate "
                    "JOB`); without one, that work is timed by the bytes it moves at the elementwise bandwidth.",
    )
    reserved_memory_fraction: Real = Field(
        default=0.1, ge=0, lt=1, description="Device memory kept free for the allocator, workspace and fragmentation."
    )
    machine: MachineId | None = Field(
        default=None,
        description="The machine a calibration file was measured on (`graphrl calibrate`); None for a datasheet "
                    "preset or a description written by hand.",
    )
    calibration_format: Integer | None = Field(
        default=None,
        description="The calibration file format version (`graphrl calibrate` writes the current one); None for "
                    "a preset or a description written by hand.",
    )

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * (1.0 - self.reserved_memory_fraction)

    def for_rank(self, threads: int, hidden_size: int, tokens: float = 0) -> "HardwareSpec":
        """This description for ranks of `threads` torch threads that run models `hidden_size` wide on
        `tokens` tokens a step: the matmul fits and vocabulary costs measured with that many threads (with
        the nearest thread count measured, where none was), and the host fit of those threads whose width,
        then step size, is nearest (the general figures where none was made)."""
        update: dict = {}
        for field in ("matmuls", "vocab"):
            measured: tuple[MatmulFit | VocabCost, ...] = getattr(self, field)
            if measured:
                nearest = min({m.threads for m in measured}, key=lambda t: (abs(math.log(t / threads)), -t))
                same = tuple(m for m in measured if m.threads == nearest)
                if len(same) != len(measured):
                    update[field] = same
        fits = [f for f in self.host_fits if f.threads == threads]
        if fits:
            fit = min(fits, key=lambda f: (abs(math.log(f.hidden_size / hidden_size)),
                                           abs(math.log(max(f.tokens, 1) / max(tokens, 1)))))
            update.update({name: getattr(fit, name) for name in HOST_FIT_FIELDS})
        return self.model_copy(update=update) if update else self

    @property
    def elementwise_rate(self) -> float:
        """Bytes/s of elementwise kernels: the fitted figure, else the effective memory bandwidth."""
        return self.elementwise_bandwidth or self.memory_bandwidth * self.memory_efficiency

    @property
    def backward_elementwise_rate(self) -> float:
        """The backward's elementwise work in bytes/s of the forward's elementwise bytes."""
        return self.backward_elementwise_bandwidth or self.elementwise_rate / 2


# A vLLM decode step at light load: 13 ms per output token for Llama 3 8B on one H100 (vLLM v0.6.0
# performance update, 2024-09-05), where the device's work alone (the weights read once) takes about
# 6.4 ms: the rest is the engine's host side, which at light load sets the pace. The host side does not
# depend on the GPU, so the A100 and H200 presets keep the same floor.
SERVING_STEP_FLOOR_S = 13e-3

# Datasheet figures (NVIDIA H100, H200 and A100 datasheets): dense (not sparse) tensor-core peaks.
# NVLink per-device figures are total bidirectional bandwidth / 2; inter-node assumes one 400 Gb/s
# (H100/H200) or 200 Gb/s (A100) NIC per GPU.
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "h100-sxm-80gb": HardwareSpec(
        name="h100-sxm-80gb", peak_bf16_flops=989 * TFLOPS, peak_fp8_flops=1979 * TFLOPS,
        memory_bytes=80 * GB, memory_bandwidth=3.35e12, intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB, host_link_bandwidth=55 * GB, serving_step_floor_s=SERVING_STEP_FLOOR_S,
    ),
    "h200-141gb": HardwareSpec(
        name="h200-141gb", peak_bf16_flops=989 * TFLOPS, peak_fp8_flops=1979 * TFLOPS,
        memory_bytes=141 * GB, memory_bandwidth=4.8e12, intra_node_bandwidth=450 * GB,
        inter_node_bandwidth=50 * GB, host_link_bandwidth=55 * GB, serving_step_floor_s=SERVING_STEP_FLOOR_S,
    ),
    "a100-sxm-80gb": HardwareSpec(
        name="a100-sxm-80gb", peak_bf16_flops=312 * TFLOPS, peak_fp8_flops=0.0,
        memory_bytes=80 * GB, memory_bandwidth=2.039e12, intra_node_bandwidth=300 * GB,
        inter_node_bandwidth=25 * GB, host_link_bandwidth=25 * GB, serving_step_floor_s=SERVING_STEP_FLOOR_S,
    ),
    # Defaults for a CPU "device" (one rank = one process, one thread), rounded from `graphrl calibrate`
    # on a 2-core x86-64 cloud VM; a calibration file replaces them with this machine's figures. Plans
    # stay deterministic either way. fp8 weights are dequantized at use on a CPU (executors/fp8.py), so
    # its fp8 rate is its unquantized rate: fp8 generation saves memory here, never time.
    "cpu-local": HardwareSpec(
        name="cpu-local", kind="cpu", peak_bf16_flops=90e9, peak_fp8_flops=90e9,
        memory_bytes=4 * GiB, memory_bandwidth=12 * GB, intra_node_bandwidth=2 * GB,
        inter_node_bandwidth=1 * GB, host_link_bandwidth=12 * GB, link_latency_s=200e-6,
        compute_efficiency=0.35, memory_efficiency=1.0, link_efficiency=1.0, op_overhead_s=140e-6,
        layer_overhead_s=400e-6, pass_overhead_s=500e-6, decode_token_overhead_s=1.7e-6,
        train_layer_overhead_s=1.6e-3, train_pass_overhead_s=2.5e-3, reserved_memory_fraction=0.0,
    ),
}
