"""How close the DDMA weight-sync executor comes to raw point-to-point bandwidth, on local ranks (gloo):
2 ranks, and 3 for a tp=2 generator beside its trainer (each world size its own process group).

Each case plans a trainer -> generator sync with the real planner, stores it the way a compiled job
does (`compiler/weight_sync.py:ddma_record`, through JSON), and times only `execute_weight_sync` (packing,
the batched sends and receives, unpacking). Beside it, in the same run, the same bytes per
direction go as ONE flat tensor per (sender, receiver) pair with `dist.send` / `dist.recv` (or one
batched isend/irecv when both ranks send). GB/s = bytes crossing between the ranks / the slower
rank's time, best of --repeat after a warm-up, the two paths taking turns; the median of the same
runs is printed beside it (with more processes than cores, as in the 3-rank case, the best run is the
one the scheduler happened to favour, and the median shows the typical sync). The destination is
checked bit for bit once. Where trainer and generator share ranks, part of the weights stays on its
rank (column `local MB`): the DDMA path copies it from trainer shard to generator shard, and the raw
baseline copies the same bytes as one flat contiguous tensor per rank, so both deliver every byte.

Into tp=2 shards: on the trainer's own 2 ranks nearly everything stays on its rank (an fsdp trainer
holds o/down as the column blocks the generator's ranks hold, `fsdp_shard_dim`; only the norms cross);
with the trainer's 2 ranks in the other order every block crosses; a 1-rank trainer beside a tp=2
generator (3 ranks) sends each generator rank its shard, gathering o/down's column blocks first.

    python benchmarks/bench_weight_sync.py [--layers 2] [--repeat 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphrl.compiler import weight_sync
from graphrl.schemas.sharding import Mesh, llama_params, shard_bounds, to_slices
from graphrl.executors.weightsync import execute_weight_sync
from graphrl.schemas.hardware import HARDWARE_PRESETS
from graphrl.schemas.weightsync import WeightSyncRecord
from graphrl.schemas.model import ModelDims

MIB = 1 << 20
CPU = torch.device("cpu")

# (label, trainer mesh, generator mesh, bucket limit)
CASES = [
    ("fsdp1@0 -> tp1@1, 256 MiB buckets", Mesh.contiguous([("dp", 1), ("fsdp", 1), ("tp", 1), ("pp", 1)], 0), Mesh.contiguous([("dp", 1), ("fsdp", 1), ("tp", 1), ("pp", 1)], 1), 256 * MIB),
    ("fsdp1@0 -> tp1@1, 16 MiB buckets", Mesh.contiguous([("dp", 1), ("fsdp", 1), ("tp", 1), ("pp", 1)], 0), Mesh.contiguous([("dp", 1), ("fsdp", 1), ("tp", 1), ("pp", 1)], 1), 16 * MIB),
    ("fsdp2@0-1 -> tp2@0-1 (shared ranks)", Mesh.contiguous([("dp", 1), ("fsdp", 2), ("tp", 1), ("pp", 1)], 0), Mesh.contiguous([("dp", 1), ("fsdp", 1), ("tp", 2), ("pp", 1)], 0), 256 * MIB),
    # The same two meshes with the trainer's ranks swapped: every block crosses the link, into tp shards.
    ("fsdp2@1,0 -> tp2@0-1 (all cross)", Mesh(devices=(1, 0), axes=(("dp", 1), ("fsdp", 2), ("tp", 1), ("pp", 1))), Mesh.contiguous([("dp", 1), ("fsdp", 1), ("tp", 2), ("pp", 1)], 0), 256 * MIB),
    # A disaggregated generator, the planner's main case: one trainer rank sends each tp rank its shard.
    ("fsdp1@0 -> tp2@1-2 (3 ranks)", Mesh.contiguous([("dp", 1), ("fsdp", 1), ("tp", 1), ("pp", 1)], 0), Mesh.contiguous([("dp", 1), ("fsdp", 1), ("tp", 2), ("pp", 1)], 1), 256 * MIB),
]


def world_of(data: WeightSyncRecord) -> int:
    return max(max(data.src.devices), max(data.dst.devices)) + 1


def model_dims(layers: int) -> ModelDims:
    """~20M parameters per layer pair plus 17M of embedding and head: 78 MB in bf16 at 2 layers."""
    return ModelDims(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_layers=layers,
                     num_heads=16, num_kv_heads=4)


def stored_plan(dims: ModelDims, src: Mesh, dst: Mesh, bucket_bytes: int) -> WeightSyncRecord:
    data, _ = weight_sync.ddma_record(dims, "policy", HARDWARE_PRESETS["h100-sxm-80gb"], 8, src, dst, "bf16", bucket_bytes)
    return WeightSyncRecord.model_validate_json(data.model_dump_json())


def timed(fns: list[Callable[[], None]], repeat: int) -> list[tuple[float, float]]:
    """Per function, (best, median) over `repeat` runs (after one warm-up) of the slower rank's seconds.
    The functions take turns, so a noisy neighbour slows both paths alike, and the order of the
    turns flips every run: a path that runs right after the other finds the caches and TLB full of
    the other's buffers, which costs a few tenths of a millisecond here."""
    runs: list[list[float]] = [[] for _ in fns]
    for i in range(repeat + 1):
        for k in range(len(fns)) if i % 2 else reversed(range(len(fns))):
            fn = fns[k]
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i:
                runs[k].append(elapsed.item())
    return [(min(r), statistics.median(r)) for r in runs]


def bench_case(rank: int, dims: ModelDims, data: WeightSyncRecord, dtype: torch.dtype, repeat: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    full = {p.name: torch.randn(p.shape, generator=gen).to(dtype) for p in llama_params(dims)}
    src_mesh, dst_mesh = data.src, data.dst

    def shards(mesh: Mesh, copy: bool) -> dict[str, tuple[torch.Tensor, Any]]:
        if rank not in mesh:
            return {}
        out = {}
        for p in llama_params(dims):
            region = shard_bounds(p, mesh, rank)
            piece = full[p.name][to_slices(region)]
            out[p.name] = (piece.clone() if copy else torch.zeros_like(piece), region)
        return out

    src, dst = shards(src_mesh, True), shards(dst_mesh, False)

    # Raw: the same elements per (sender, receiver) pair, one flat tensor each.
    per_pair: dict[tuple[int, int], int] = {}
    for b_src, b_dst, _, slices in data.buckets():
        n = sum(_numel(region) for _, region in slices)
        per_pair[(b_src, b_dst)] = per_pair.get((b_src, b_dst), 0) + n
    out_bufs = {d: torch.randn(n).to(dtype) for (s, d), n in per_pair.items() if s == rank}
    in_bufs = {s: torch.empty(n, dtype=dtype) for (s, d), n in per_pair.items() if d == rank}
    local = sum(_numel(region) for _, _, slices in data.local_copies(rank) for _, region in slices)
    local_src, local_dst = torch.randn(local).to(dtype), torch.empty(local, dtype=dtype)

    def raw() -> None:
        if len(per_pair) == 1:
            for peer, buf in out_bufs.items():
                dist.send(buf, peer)
            for peer, buf in in_bufs.items():
                dist.recv(buf, peer)
            local_dst.copy_(local_src)
            return
        ops = [dist.P2POp(dist.isend, b, p) for p, b in out_bufs.items()]
        ops += [dist.P2POp(dist.irecv, b, p) for p, b in in_bufs.items()]
        works = dist.batch_isend_irecv(ops)
        local_dst.copy_(local_src)  # overlapping the transfers, as the DDMA path does
        for work in works:
            work.wait()

    def ddma() -> None:
        execute_weight_sync(data, rank, src, dst, CPU, CPU, wire_dtype=dtype)

    (ddma_s, ddma_median_s), (raw_s, raw_median_s) = timed([ddma, raw], repeat)
    ok = all(torch.equal(t, full[name][to_slices(region)]) for name, (t, region) in dst.items())
    ok_all = torch.tensor([int(ok)])
    dist.all_reduce(ok_all, op=dist.ReduceOp.MIN)
    link_bytes = sum(per_pair.values()) * torch.empty(0, dtype=dtype).element_size()
    return {"link_bytes": link_bytes, "delivered_bytes": link_bytes + data.summary.local_bytes, "ddma_s": ddma_s, "raw_s": raw_s,
            "ddma_median_s": ddma_median_s, "raw_median_s": raw_median_s, "rounds": len(data.rounds),
            "buckets": data.summary.num_buckets, "local_bytes": data.summary.local_bytes,
            "exact": bool(ok_all.item())}


def _numel(region: list[list[int]]) -> int:
    n = 1
    for a, b in region:
        n *= b - a
    return n


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, plans: list[tuple[str, WeightSyncRecord]],
              out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    dims = model_dims(args.layers)
    for label, data in plans:
        row = bench_case(rank, dims, data, torch.bfloat16, args.repeat)
        if rank == 0:
            out.put({"case": label, **row})
    dist.destroy_process_group()


def run_world(world: int, plans: list[tuple[str, WeightSyncRecord]], args: argparse.Namespace) -> list[dict[str, Any]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, args, plans, out)) for r in range(world)]
    for p in procs:
        p.start()
    rows = [{**out.get(timeout=600), "ranks": world} for _ in plans]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a rank exited with code {p.exitcode}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the benchmark model")
    parser.add_argument("--repeat", type=int, default=40, help="timed runs per path; the best and the median are kept")
    parser.add_argument("--json", action="store_true", help="print one JSON object per case")
    args = parser.parse_args()
    dims = model_dims(args.layers)
    model_bytes = sum(p.num_elements for p in llama_params(dims)) * 2
    plans = [(label, stored_plan(dims, s, d, b)) for label, s, d, b in CASES]
    rows = []
    for world in sorted({world_of(data) for _, data in plans}):  # one process group per world size
        rows += run_world(world, [(label, data) for label, data in plans if world_of(data) == world], args)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print(f"model {model_bytes / 1e6:.0f} MB in bf16 ({args.layers} layers), gloo on loopback, "
          f"best (and median) of {args.repeat}")
    print(f"{'case':38} {'link MB':>8} {'local MB':>8} {'rounds':>6} {'ddma ms':>8} {'ddma GB/s':>9} {'raw ms':>7} "
          f"{'raw GB/s':>8} {'ddma/raw':>8} {'median':>6} {'exact':>5}")
    print("(GB/s: bytes delivered into the generator's shards, over the link and rank-local, per second)")
    for r in rows:
        gb = r["delivered_bytes"] / 1e9
        print(f"{r['case']:38} {r['link_bytes'] / 1e6:>8.1f} {r['local_bytes'] / 1e6:>8.1f} {r['rounds']:>6} "
              f"{r['ddma_s'] * 1e3:>8.1f} {gb / r['ddma_s']:>9.2f} {r['raw_s'] * 1e3:>7.1f} {gb / r['raw_s']:>8.2f} "
              f"{r['raw_s'] / r['ddma_s']:>8.2f} {r['raw_median_s'] / r['ddma_median_s']:>6.2f} {str(r['exact']):>5}")


if __name__ == "__main__":
    main()
