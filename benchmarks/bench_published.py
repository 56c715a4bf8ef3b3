"""The preview against published GPU runs: predicted against published seconds per phase and per step.

    python benchmarks/bench_published.py [--out DIR]

NVIDIA publishes GRPO runs of Llama-3.1-8B-Instruct with their full configuration and measured times.
This benchmark writes each as a graphrl job (the facts it rests on are quoted beside each field), compiles
it for its cluster (no GPU is needed: the preview is the point) and prints the plan's predicted seconds per
phase and per step beside the published ones.

Target: every published phase within 25%, every step within 15%.

A second table checks the serving-engine model alone: the preset's roofline decode with continuous
batching against TensorRT-LLM's published offline throughput for Llama-3.1-8B (tokens/s per GPU at
fixed input/output lengths, as many requests in flight as the KV cache holds). It is reported, not judged.

Facts and sources
-----------------
NeMo-RL v0.3 (blog "NeMo-RL V0.3: Scalable and Performant Post-training ... via Megatron-Core",
2025-07-21; configs `examples/configs/grpo_math_8B_megatron.yaml` at tag v0.3.0):
  Llama-3.1-8B-Instruct, 1 node x 8 H100, GRPO, synchronous, colocated; vLLM TP1 x 8 engines,
  gpu_memory_utilization 0.6; Megatron trainer, bf16, Adam; 64 prompts x 32 generations = 2048
  responses per step; train global batch 512 (4 optimizer steps per step), micro-batch 1, sequence
  packing on (4096 tokens per training micro-batch), max sequence 4096; KL 0.01 (k3) to the reference;
  mean generated length 795 tokens. "Get logprobs" is two forward passes over the batch (the policy's
  old log-probs and the reference's). Measured, steps 22-29: total 112 s = training 28 + refit 5 +
  generation 58 + logprobs 18 (the rest, 3 s, is other timers).
NeMo-RL v0.5 (`docs/about/performance-summary.md` at tag v0.5.0; recipe
  `grpo-llama3.1-8b-instruct-2n8g.yaml`): the same job on 2 nodes x 16 H100, trainer TP1 PP2 with
  activation checkpointing, mean generated length ("G-Average Seq len") 1,019: 92.8 s per step, 1,581
  tokens/s/GPU (no phases published).
Not published: the prompts' length (OpenMathInstruct-2 with the cot.txt template and Llama-3.1's chat
  template). The v0.5 summary defines tokens/s/GPU as the tokens processed over step time and GPUs:
  1,581 x 92.8 s x 16 / 2048 = 1,146 tokens per response, of which 1,019 generated ("G-Average Seq
  len"), which leaves about 127 prompt tokens. Both jobs assume 128 (the summary says its averages do
  not match its formula exactly). The lengths' spread is not published either: the jobs give the mean
  and the limit, and the preview's default spread fills in the rest.
TensorRT-LLM perf overview (`docs/source/performance/perf-overview.md`, data of v0.14.0): Llama-3.1-8B
  TP1 FP16 output tokens/s on H100 and A100-SXM4-80GB.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP_TARGET_PCT = 15.0
PHASE_TARGET_PCT = 25.0

CLUSTER = """name: h100-{n}
num_nodes: {nodes}
devices_per_node: 8
hardware: h100-sxm-80gb
host_memory_bytes: 2.0e12
"""

# NeMo-RL's GRPO on Llama-3.1-8B-Instruct, written as a graphrl job. Each field says which fact it holds.
JOB = """name: {name}
description: NeMo-RL's published GRPO run of Llama-3.1-8B-Instruct ({source})
cluster: cluster.yaml
models:
  policy: {{preset: llama3-8b, dtype: bfloat16}}
  reference: {{preset: llama3-8b, dtype: bfloat16, init_from: policy}}
nodes:
  # 64 prompts per step; their length is not published (128 tokens assumed, see the benchmark's notes).
  prompts: {{op: dataset, task: synthetic-tokens, batch_size: 64, prompt_len: 128, options: {{vocab_size: 128256}}}}
  rollout:
    op: generate
    model: policy
    samples_per_prompt: 32          # 32 generations per prompt: 2048 responses per step
    max_new_tokens: 4096            # max_new_tokens = max_total_sequence_length = 4096
    response_tokens: {{mean: {mean}, max: 4096}}   # the published mean generated length
    inputs: {{prompts: prompts.prompts}}
  # "Get logprobs": the policy's log-probs of the responses (the loss's old log-probs) and the reference's.
  old_logprobs: {{op: logprob, model: policy, inputs: {{rollouts: rollout.rollouts}}}}
  ref_logprobs: {{op: logprob, model: reference, inputs: {{rollouts: rollout.rollouts}}}}
  score: {{op: reward, fn: digits_copy, inputs: {{rollouts: rollout.rollouts}}}}   # a rule reward (math-verify there)
  adv: {{op: advantage, estimator: rloo, inputs: {{rewards: score.rewards, rollouts: rollout.rollouts}}}}  # leave-one-out
  update:
    op: train
    model: policy
    loss: grpo
    inputs: {{rollouts: rollout.rollouts, advantages: adv.advantages, ref_logprobs: ref_logprobs.logprobs,
             old_logprobs: old_logprobs.logprobs}}
algorithm:
  lr: 3.0e-7
  kl_coef: 0.01                     # reference_policy_kl_penalty
  kl_estimator: k3
  mini_batch_size: 512              # train_global_batch_size: 4 optimizer steps per step, one pass
  micro_batch_size: 1               # train_micro_batch_size 1, packed to a token budget
  pack_sequences: true              # sequence_packing.enabled
schedule: {{mode: sync, steps: 30}}
placement:
  strategy: colocated               # colocated generation
  roles:
    policy: {policy_pins}
    policy/generate: {{tp: 1, dp: {n}, engine: vllm, precision: bf16, memory_fraction: 0.6}}
"""


@dataclass(frozen=True)
class Published:
    key: str
    source: str
    devices: int
    mean_response: int
    policy_pins: str
    step_s: float
    phases: dict[str, float]  # published phase -> seconds


RUNS = (
    Published("nemo_rl_v03_8b_1x8", "NeMo-RL v0.3 blog, Megatron backend, 1 x 8 H100, steps 22-29", 8, 795,
              "{fsdp: 8}", 112.0, {"training": 28.0, "refit": 5.0, "generation": 58.0, "logprobs": 18.0}),
    Published("nemo_rl_v05_8b_2x8", "NeMo-RL v0.5 performance summary, 2 x 8 H100, trainer TP1 PP2", 16, 1019,
              "{pp: 2, tp: 1}", 92.8, {}),
)

# Which of the plan's phases make up each published one. NeMo-RL's refit offloads the trainer's state,
# hands the weights to the engine and reallocates its cache.
PHASE_MAP = {"training": ("train",), "refit": ("weight_sync", "offload", "reshard_in_place"),
             "generation": ("generate",), "logprobs": ("logprob",)}

# TensorRT-LLM v0.14 perf overview, Llama-3.1-8B TP1 FP16, output tokens/s per GPU: (input, output) -> rate.
ENGINE_TABLE = {
    "h100-sxm-80gb": {(128, 2048): 9150.7, (500, 2000): 7498.3, (1000, 1000): 7054.5, (2048, 2048): 4159.7,
                      (128, 4096): 5368.9, (128, 128): 15571.7, (2048, 128): 1904.3},
    "a100-sxm-80gb": {(128, 2048): 4963.4, (500, 2000): 3945.2, (1000, 1000): 3634.4, (2048, 2048): 2265.0},
}
ENGINE_KV_FRACTION = 0.9  # of the memory the weights leave (TensorRT-LLM's default KV-cache share)


def write_job(run: Published, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cluster.yaml").write_text(CLUSTER.format(n=run.devices, nodes=math.ceil(run.devices / 8)))
    path = folder / f"{run.key}.yaml"
    path.write_text(JOB.format(name=run.key, source=run.source, mean=run.mean_response, n=run.devices,
                               policy_pins=run.policy_pins))
    return path


def predict(path: Path) -> tuple[dict[str, float], float, str, str]:
    """(phases, step seconds, the chosen layout, the lengths the preview assumed) of a job's plan."""
    from graphrl.compiler.compile import compile_job
    from graphrl.loader import job_cluster, load_job

    job = load_job(path)
    plan = compile_job(job, job_cluster(job, None))
    assumed = plan.workload.describe() if plan.workload is not None else ""
    return dict(plan.chosen.estimate.phases), plan.chosen.estimate.step_time_s, plan.chosen.label, assumed


def error_pct(predicted: float, published: float) -> float:
    return 100.0 * (predicted - published) / published


def engine_table() -> list[tuple[str, int, int, int, float, float]]:
    """(hardware, input, output, requests in flight, predicted, published tokens/s) of the engine check."""
    from graphrl.compiler import cost
    from graphrl.compiler.cost import timing
    from graphrl.schemas.hardware import HARDWARE_PRESETS
    from graphrl.schemas.model import MODEL_PRESETS

    dims = MODEL_PRESETS["llama3-8b"]
    rows = []
    for name, cases in ENGINE_TABLE.items():
        hw = HARDWARE_PRESETS[name]
        room = ENGINE_KV_FRACTION * (hw.memory_bytes - cost.weight_bytes(dims, cost.BF16_BYTES))
        per_token = cost.kv_cache_bytes_per_token(dims, cost.BF16_BYTES)
        for (isl, osl), published in cases.items():
            batch = min(4096, int(room // (per_token * (isl + osl))))
            seconds = timing.generation_time(dims, batch, isl, osl, 1, "bf16", hw, continuous=True)
            rows.append((name, isl, osl, batch, batch * osl / seconds, published))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="Folder for the written jobs (default: a temporary one).")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="graphrl-published-"))
    failed = False
    print(f"jobs written to {out}\n")
    for run in RUNS:
        path = write_job(run, out / run.key)
        phases, step, label, assumed = predict(path)
        print(f"{run.key}: {run.source}\n  chosen {label}\n  {assumed}")
        print(f"  {'phase':<12}{'predicted':>11}{'published':>11}{'error':>9}")
        for name, published in run.phases.items():
            predicted = sum(phases.get(k, 0.0) for k in PHASE_MAP[name])
            err = error_pct(predicted, published)
            ok = abs(err) <= PHASE_TARGET_PCT
            failed |= not ok
            print(f"  {name:<12}{predicted:>10.1f}s{published:>10.1f}s{err:>+8.0f}%  {'ok' if ok else 'FAIL'}")
        shown = {k for name in run.phases for k in PHASE_MAP[name]}
        other = {k: v for k, v in phases.items() if k not in shown and v > 0}
        if other:
            print("  predicted, not published: " + ", ".join(f"{k} {v:.2f}s" for k, v in sorted(other.items())))
        err = error_pct(step, run.step_s)
        ok = abs(err) <= STEP_TARGET_PCT
        failed |= not ok
        print(f"  {'step':<12}{step:>10.1f}s{run.step_s:>10.1f}s{err:>+8.0f}%  {'ok' if ok else 'FAIL'}\n")

    print("engine model against TensorRT-LLM's published Llama-3.1-8B TP1 FP16 throughput (reported, not judged)")
    print(f"  {'hardware':<15}{'in/out':>11}{'in flight':>10}{'predicted':>11}{'published':>11}{'ratio':>7}")
    for name, isl, osl, batch, predicted, published in engine_table():
        print(f"  {name:<15}{f'{isl}/{osl}':>11}{batch:>10}{predicted:>10.0f}/s{published:>9.0f}/s"
              f"{predicted / published:>7.2f}")
    print("\n" + ("FAIL: a published phase or step is outside its target" if failed else
                  f"PASS: every phase within {PHASE_TARGET_PCT:.0f}%, every step within {STEP_TARGET_PCT:.0f}%"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
