"""How fast the DDMA weight-sync planner plans, and how good its plans are, at paper scale.

Each case plans one trainer -> generator weight sync for a Llama 3 preset and prints the planning
time (wall and CPU, best of --repeat), the rounds, the bytes on links against the lower bound,
and the send balance (max / mean bytes over sending ranks). A case whose label ends in fp8 plans the sync
into an fp8 generator, in staging groups of layers one after the other (`graphrl.compiler.ddma.sync_staging_layers`),
beside the same layout into bf16.

    python benchmarks/bench_ddma.py [--bucket-mib 256] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

from graphrl.compiler.ddma import plan_summary, plan_weight_sync, sync_staging_layers
from graphrl.schemas.sharding import Mesh, MeshAxis, llama_param_layout, llama_params, staging_group
from graphrl.schemas.model import MODEL_PRESETS

DP, FSDP, TP, PP = MeshAxis.DP, MeshAxis.FSDP, MeshAxis.TP, MeshAxis.PP

# (label, preset, trainer axes, generator axes, generator's first rank: 0 = the trainer's devices)
CASES = [
    ("8b fsdp8 -> dp4.tp2 (disaggregated)", "llama3-8b", [(FSDP, 8)], [(DP, 4), (TP, 2)], 8),
    ("8b fsdp8 -> dp4.tp2 (colocated)", "llama3-8b", [(FSDP, 8)], [(DP, 4), (TP, 2)], 0),
    ("70b fsdp16.tp8 -> dp16.tp8", "llama3-70b", [(FSDP, 16), (TP, 8)], [(DP, 16), (TP, 8)], 128),
    ("70b pp4.fsdp4.tp8 -> dp8.tp16", "llama3-70b", [(PP, 4), (FSDP, 4), (TP, 8)], [(DP, 8), (TP, 16)], 128),
    ("405b fsdp64.tp8 -> dp64.tp8", "llama3-405b", [(FSDP, 64), (TP, 8)], [(DP, 64), (TP, 8)], 512),
    ("405b dp2.fsdp32.tp8 -> dp32.tp16", "llama3-405b", [(DP, 2), (FSDP, 32), (TP, 8)], [(DP, 32), (TP, 16)], 512),
    ("405b fsdp64.tp8 -> dp64.tp8 (colocated)", "llama3-405b", [(FSDP, 64), (TP, 8)], [(DP, 64), (TP, 8)], 0),
    # The 405B example's chosen layout, into bf16 and into fp8 (in staging groups of layers, one after the other)
    ("405b fsdp22.tp8 -> dp53.tp16 bf16", "llama3-405b", [(FSDP, 22), (TP, 8)], [(DP, 53), (TP, 16)], 848),
    ("405b fsdp22.tp8 -> dp53.tp16 fp8", "llama3-405b", [(FSDP, 22), (TP, 8)], [(DP, 53), (TP, 16)], 848),
]


def run_case(label: str, preset: str, src_axes, dst_axes, dst_first: int, bucket_bytes: int, repeat: int) -> dict:
    params = llama_params(MODEL_PRESETS[preset])
    dims = MODEL_PRESETS[preset]
    src = Mesh.contiguous(src_axes)
    dst = Mesh.contiguous(dst_axes, first_rank=dst_first)
    layers = sync_staging_layers(dims, dst, "fp8") if label.endswith("fp8") else None
    best_wall = best_cpu = float("inf")
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        plan = plan_weight_sync(
            params, src_mesh=src, src_layout=llama_param_layout, dst_mesh=dst, dst_layout=llama_param_layout,
            src_bytes_per_elem=2, bucket_bytes=bucket_bytes,
            group_of=None if layers is None else lambda p: staging_group(p.name, layers),
        )
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    summary = plan_summary(plan)
    return {"case": label, "num_params": len(params), "plan_wall_s": best_wall, "plan_cpu_s": best_cpu, **summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bucket-mib", type=int, default=256, help="bucket size limit, MiB")
    parser.add_argument("--repeat", type=int, default=3, help="plans per case; the best time is kept")
    parser.add_argument("--json", action="store_true", help="print one JSON object per case")
    args = parser.parse_args()
    bucket_bytes = args.bucket_mib << 20
    if not args.json:
        print(f"bucket limit {args.bucket_mib} MiB, bf16 on the wire, best of {args.repeat}")
        print(
            f"{'case':42} {'params':>6} {'wall s':>7} {'cpu s':>6} {'rounds':>6} {'buckets':>8} "
            f"{'link GB':>9} {'= bound':>7} {'balance':>7} {'rounds/ideal':>12}"
        )
    for case in CASES:
        row = run_case(*case, bucket_bytes=bucket_bytes, repeat=args.repeat)
        if args.json:
            print(json.dumps(row))
            continue
        # A round lasts as long as its largest bucket; the ideal is the busiest sender's bytes.
        ideal = max(row["max_bytes_per_src"], row["max_bytes_per_dst"])
        stretch = row["sum_round_max_bytes"] / ideal if ideal else 1.0
        print(
            f"{row['case']:42} {row['num_params']:>6} {row['plan_wall_s']:>7.2f} {row['plan_cpu_s']:>6.2f} "
            f"{row['num_rounds']:>6} {row['num_buckets']:>8} {row['total_bytes'] / 1e9:>9.1f} "
            f"{str(row['total_bytes'] == row['lower_bound_bytes']):>7} {row['balance']:>7.3f} {stretch:>12.3f}"
        )


if __name__ == "__main__":
    main()
