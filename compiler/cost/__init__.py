"""The cost model, in one place: what a layout of a job holds in memory and how long each of its steps
takes, in closed form, before any device is used.

Everything that predicts a cost reads it from here: the placement search ranks and rejects candidates
with it, the preview's phases are its phase table, the simulator replays the programs with the
durations it gives each instruction kind (`layout_durations`, lowered into the plan's `CostKey` table),
and the report sets a run's measured steps beside that simulation. `graphrl calibrate` measures the
hardware figures (`HardwareSpec`) these formulas read, and fits them with these formulas.

- `model.py`: a model's sizes: parameter counts, FLOPs, the bytes of its weights and KV cache;
- `memory.py`: memory by kind: what a role holds per device (`MemoryBreakdown`, `training_memory`,
  `inference_memory`) and a candidate's meshes at their peak phase (`trainer_mesh_memory`, the
  generator's weights, cache and staging);
- `timing.py`: time per instruction kind: a roofline per op, collectives on the calibrated ring fits,
  generation, training and forward passes, an engine's reload;
- `phases.py`: the phase table: what one step of a candidate costs, phase by phase, and each
  instruction kind's duration on its layout.

The names below are the package's public ones; the per-op constants of `timing.py` stay in their module.
"""

from graphrl.compiler.cost.memory import (
    MemoryBreakdown,
    MeshMemory,
    activation_bytes_per_token_per_layer,
    colocated_peak,
    engine_resident,
    engine_weights,
    gen_kv_per_token,
    gen_per_sequence,
    gen_sync_staging,
    gen_weights,
    generator_memory,
    generator_mesh_peak,
    held_weights,
    infer_state,
    inference_memory,
    micro_tokens,
    offloaded_bytes,
    reads_trainer,
    resident_while_generating,
    train_state,
    trainer_mesh_memory,
    training_memory,
)
from graphrl.compiler.cost.model import (
    BF16_BYTES,
    DDP_BUCKET_BYTES,
    FP32_BYTES,
    UnsupportedPrecisionError,
    block_linear_rows,
    causal_mean_context,
    embedding_params,
    forward_flops_per_token,
    fp8_dequantizes,
    fsdp_unit_layers,
    fsdp_units,
    kv_cache_bytes_per_token,
    kv_shards,
    layer_linear_params,
    layer_params,
    matmul_params,
    param_count,
    param_tensor_count,
    prefill_flops,
    train_flops,
    weight_bytes,
)
from graphrl.compiler.cost.phases import (
    GenerationTime,
    PassShape,
    engine_reload_time,
    generation_phase,
    layout_durations,
    lora_comparison,
    offload_bytes,
    pass_shape,
    reshard_in_place_time,
    role_times,
    rollout_transfer_time,
    trainer_times,
    unaligned_tp_shards,
    weight_sync_time,
)
from graphrl.compiler.cost.timing import (
    CollectiveKind,
    StepCost,
    VocabUse,
    attention_seconds_per_key,
    chunked_collective_time,
    collective_time,
    decode_step_cost,
    elementwise_seconds,
    engine_refit_seconds,
    engine_reload_seconds,
    engine_time_factor,
    forward_time,
    generation_time,
    group_spans_nodes,
    head_seconds,
    layer_elementwise_bytes,
    layer_linear_seconds,
    layer_matmul_shapes,
    matmul_seconds,
    measured_collective,
    offload_time,
    optimizer_seconds,
    p2p_seconds,
    pass_compute_seconds,
    ring_shape,
    training_step_time,
    vocab_seconds,
    weight_copy_seconds,
)

__all__ = [
    # model.py
    "BF16_BYTES", "DDP_BUCKET_BYTES", "FP32_BYTES", "UnsupportedPrecisionError", "block_linear_rows",
    "causal_mean_context", "embedding_params", "forward_flops_per_token", "fp8_dequantizes", "fsdp_unit_layers",
    "fsdp_units", "kv_cache_bytes_per_token", "kv_shards", "layer_linear_params", "layer_params", "matmul_params",
    "param_count", "param_tensor_count", "prefill_flops", "train_flops", "weight_bytes",
    # memory.py
    "MemoryBreakdown", "MeshMemory", "activation_bytes_per_token_per_layer", "colocated_peak", "engine_resident",
    "engine_weights", "gen_kv_per_token", "gen_per_sequence", "gen_sync_staging", "gen_weights", "generator_memory",
    "generator_mesh_peak", "held_weights", "infer_state", "inference_memory", "micro_tokens", "offloaded_bytes",
    "reads_trainer", "resident_while_generating", "train_state", "trainer_mesh_memory", "training_memory",
    # timing.py
    "CollectiveKind", "StepCost", "VocabUse", "attention_seconds_per_key", "chunked_collective_time",
    "collective_time", "decode_step_cost", "elementwise_seconds", "engine_refit_seconds", "engine_reload_seconds",
    "engine_time_factor", "forward_time", "generation_time", "group_spans_nodes", "head_seconds",
    "layer_elementwise_bytes", "layer_linear_seconds", "layer_matmul_shapes", "matmul_seconds", "measured_collective",
    "offload_time", "optimizer_seconds", "p2p_seconds", "pass_compute_seconds", "ring_shape", "training_step_time",
    "vocab_seconds", "weight_copy_seconds",
    # phases.py
    "GenerationTime", "PassShape", "engine_reload_time", "generation_phase", "layout_durations", "lora_comparison", "offload_bytes",
    "pass_shape", "reshard_in_place_time", "role_times", "rollout_transfer_time", "trainer_times",
    "unaligned_tp_shards", "weight_sync_time",
]
