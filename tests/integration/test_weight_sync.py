"""DDMA weight sync on real ranks: plans from the real planner, stored the way `compiler/weight_sync.py`
stores them, executed by `executors/weightsync.py` over gloo between processes on this machine.

Every case moves weights between DIFFERENT layouts (fsdp / tp / dp / pp, disjoint or shared ranks).
Each rank builds the full reference tensors from one seed, cuts the source shards it holds, fills
its destination shards with NaN (a region nobody writes can never compare equal), runs the sync and
checks every destination shard against the full tensor's region bit for bit. The ranks of one world
size run all their cases in one process group, so there is one spawn per world size.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from graphrl.compiler import weight_sync
from graphrl.compiler.ddma import DDMA_BUCKET_BYTES
from graphrl.schemas.sharding import Mesh, llama_params, shard_bounds, to_slices
from graphrl.errors import RunError
from graphrl.executors.models.llama import Llama
from graphrl.executors.local_world import run_on_ranks
from graphrl.executors.weightsync import DIRECT_MIN_ELEMS, execute_weight_sync, run_weight_sync
from graphrl.schemas.hardware import HARDWARE_PRESETS
from graphrl.schemas.weightsync import WeightSyncRecord
from graphrl.schemas.model import ModelDims

pytestmark = pytest.mark.slow

# Vocab 30 splits unevenly 4 ways (8, 8, 7, 7) and 3 layers unevenly over 2 pp stages.
DIMS = ModelDims(vocab_size=30, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2)
TIED = DIMS.model_copy(update={"tie_embeddings": True})
# Slices of DIRECT_MIN_ELEMS and more: they go as messages of their own, from and into the shards.
BIG = ModelDims(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4, num_kv_heads=2)
SEED = 1234
TIMEOUT_S = 300  # per collective: only a hang fails by it, not a peer slowed by a busy machine


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    src: Mesh  # trainer: dp x fsdp x tp x pp
    dst: Mesh  # generator: dp x tp
    dst_dtype: torch.dtype = torch.float32
    bucket_bytes: int = DDMA_BUCKET_BYTES
    module: bool = False  # whole Llama modules through run_weight_sync instead of shards
    dims: ModelDims = DIMS
    has_local: bool = False  # the plan keeps some bytes rank-locally
    has_direct: bool = False  # some slices are large enough to travel alone (see DIRECT_MIN_ELEMS)


def trainer(first: int, dp: int = 1, fsdp: int = 1, tp: int = 1, pp: int = 1) -> Mesh:
    return Mesh.contiguous([("dp", dp), ("fsdp", fsdp), ("tp", tp), ("pp", pp)], first)


def generator(first: int, dp: int = 1, tp: int = 1) -> Mesh:
    return Mesh.contiguous([("dp", dp), ("tp", tp)], first)


CASES = [
    Case("2r-fsdp1@0-to-tp1@1", 2, trainer(0), generator(1)),
    Case("2r-fsdp1@0-to-tp1@1-bf16-small-buckets", 2, trainer(0), generator(1), torch.bfloat16, bucket_bytes=4096),
    Case("2r-fsdp2@0-to-tp2@0-shared", 2, trainer(0, fsdp=2), generator(0, tp=2), has_local=True),
    Case("2r-pp2@0-to-dp2@0-shared", 2, trainer(0, pp=2), generator(0, dp=2), torch.bfloat16, has_local=True),
    Case("2r-module-fsdp1@0-to-tp1@1", 2, trainer(0), generator(1), module=True),
    Case("2r-module-tied-fsdp1@1-to-tp1@0", 2, trainer(1), generator(0), module=True, dims=TIED),
    Case("2r-big-fsdp1@0-to-tp1@1", 2, trainer(0), generator(1), dims=BIG, has_direct=True),
    Case("2r-big-fsdp1@0-to-tp1@1-bf16", 2, trainer(0), generator(1), torch.bfloat16, dims=BIG, has_direct=True),
    # Column blocks of a full down_proj: large and not contiguous in the sender's tensor, then the receiver's.
    Case("4r-big-fsdp1@0-to-tp2@2", 4, trainer(0), generator(2, tp=2), dims=BIG, has_direct=True),
    Case("4r-big-tp2@0-to-tp1@2", 4, trainer(0, tp=2), generator(2), dims=BIG, has_direct=True),
    Case("4r-big-fsdp2@0-to-tp2@2-bf16", 4, trainer(0, fsdp=2), generator(2, tp=2), torch.bfloat16, dims=BIG,
         has_direct=True),
    Case("4r-fsdp2@0-to-tp2@2", 4, trainer(0, fsdp=2), generator(2, tp=2)),
    Case("4r-dp1.fsdp2@2-to-dp2@0", 4, trainer(2, dp=1, fsdp=2), generator(0, dp=2), torch.bfloat16),
    Case("4r-fsdp4@0-to-dp2.tp2@0-shared", 4, trainer(0, fsdp=4), generator(0, dp=2, tp=2), has_local=True),
    Case("4r-dp2.fsdp2@0-to-tp4@0-bf16-small-buckets", 4, trainer(0, dp=2, fsdp=2), generator(0, tp=4),
         torch.bfloat16, bucket_bytes=2048, has_local=True),
]


def stored_plan(case: Case) -> WeightSyncRecord:
    """The record exactly as a compiled job stores it: `weight_sync.ddma_record`'s, through its JSON form."""
    data, _ = weight_sync.ddma_record(case.dims, "policy", HARDWARE_PRESETS["h100-sxm-80gb"], 8, case.src, case.dst, "bf16",
                             case.bucket_bytes)
    return WeightSyncRecord.model_validate_json(data.model_dump_json())


def full_tensors(dims: ModelDims) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    return {p.name: torch.randn(p.shape, generator=gen) for p in llama_params(dims)}


def shards(dims: ModelDims, full: dict[str, torch.Tensor], mesh: Mesh, rank: int, dtype: torch.dtype | None):
    """This rank's shards under `mesh`: copies of the full tensors' regions, or NaN-filled when `dtype` is given."""
    out = {}
    if rank not in mesh:
        return out
    for p in llama_params(dims):
        region = shard_bounds(p, mesh, rank)
        if region is None:  # another pp stage's parameter
            continue
        piece = full[p.name][to_slices(region)]
        out[p.name] = (piece.clone() if dtype is None else torch.full(piece.shape, float("nan"), dtype=dtype), region)
    return out


# --- what each rank runs ----------------------------------------------------------------------


def run_shard_case(rank: int, case: Case, data: WeightSyncRecord) -> int:
    """The sync, twice: the second time with other weights in new tensors (as after an optimizer step
    and an offload), so the rank's program kept from the first sync must not be bound to its tensors."""
    cpu = torch.device("cpu")
    for scale in (1.0, -2.0):
        full = {name: t * scale for name, t in full_tensors(case.dims).items()}
        src = shards(case.dims, full, data.src, rank, None)
        dst = shards(case.dims, full, data.dst, rank, case.dst_dtype)
        execute_weight_sync(data, rank, src, dst, cpu, cpu, wire_dtype=torch.float32)
        bad = [f"{name}{list(region)}" for name, (got, region) in dst.items()
               if not torch.equal(got, full[name][to_slices(region)].to(case.dst_dtype))]
        if bad:
            raise AssertionError(f"sync {scale}: {len(bad)} of {len(dst)} destination shards differ: {bad[:6]}")
    return len(dst)


def run_module_case(rank: int, case: Case, data: WeightSyncRecord) -> int:
    torch.manual_seed(SEED)
    reference = Llama(case.dims)
    src = reference if rank in data.src else None
    dst = None
    if rank in data.dst:
        dst = Llama(case.dims)
        with torch.no_grad():
            for p in dst.parameters():
                p.fill_(float("nan"))
    run_weight_sync(data, rank, src, dst, SimpleNamespace(comm_device=torch.device("cpu"), device=torch.device("cpu")))
    if dst is None:
        return 0
    want = dict(reference.named_parameters())
    bad = [name for name, p in dst.named_parameters() if not torch.equal(p, want[name])]
    if bad:
        raise AssertionError(f"parameters differ after the sync: {bad[:6]}")
    return len(want)


def run_cases(rank: int, world: int, plans: list[tuple[Case, dict[str, Any]]]) -> dict[str, tuple[str | None, int]]:
    """One rank: every case in order; per case, its error text (or None) and the shards it checked."""
    reports: dict[str, tuple[str | None, int]] = {}
    for case, data in plans:
        try:
            reports[case.name] = (None, (run_module_case if case.module else run_shard_case)(rank, case, data))
        except BaseException:
            reports[case.name] = (traceback.format_exc(), 0)
        dist.barrier()  # the next case starts together, whatever happened in this one
    return reports


def spawn_world(world: int) -> dict[str, dict[int, tuple[str | None, int]]]:
    """Run every case of `world` ranks; {case name -> {rank -> (error, checked)}}."""
    plans = [(case, stored_plan(case)) for case in CASES if case.world == world]
    by_rank = run_on_ranks(world, run_cases, plans, collective_timeout_s=TIMEOUT_S)
    return {case.name: {r: got[case.name] for r, got in enumerate(by_rank)} for case, _ in plans}


@pytest.fixture(scope="module")
def world_reports():
    cache: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in cache:
            cache[world] = spawn_world(world)
        return cache[world]

    return get


def expected_checks(case: Case, data: WeightSyncRecord) -> int:
    mesh = data.dst
    params = llama_params(case.dims)
    if case.module:
        return mesh.num_ranks * len(params)
    return sum(shard_bounds(p, mesh, r) is not None for p in params for r in mesh.ranks())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_destination_shards_equal_the_full_tensors_bit_for_bit(case: Case, world_reports) -> None:
    data = stored_plan(case)
    assert bool(data.local) == case.has_local  # the case covers the paths it names
    slices = [region for *_, pieces in data.buckets() for _, region in pieces]
    assert any(math.prod(b - a for a, b in r) >= DIRECT_MIN_ELEMS for r in slices) == case.has_direct
    assert data.rounds, "a case with nothing on the wire tests nothing"
    reports = world_reports(case.world)
    mine = reports.get(case.name, {})
    problems = [f"rank {r}: {err}" for r, (err, _) in sorted(mine.items()) if err]
    problems += [f"rank {r}: never reported" for r in range(case.world) if r not in mine]
    assert not problems, "\n".join(problems)
    assert sum(checked for _, checked in mine.values()) == expected_checks(case, data)


def test_small_buckets_make_several_rounds() -> None:
    """The small-bucket cases must really cut slices over several rounds, or they cover nothing more."""
    for case in CASES:
        if case.bucket_bytes < 1 << 20:
            assert len(stored_plan(case).rounds) > 5, case.name


# --- refusals, on one process: they happen before anything is sent -------------------------------


def test_a_shard_that_misses_the_planned_region_is_refused() -> None:
    """A rank whose shard does not cover a slice the plan sends from it must say so, not send garbage."""
    case = CASES[0]
    data = stored_plan(case)
    full = full_tensors(DIMS)
    src = shards(DIMS, full, data.src, 0, None)
    name = "model.layers.0.mlp.up_proj.weight"
    tensor, ((a, b), cols) = src[name]
    src[name] = (tensor[: (b - a) // 2], ((a, a + (b - a) // 2), cols))
    cpu = torch.device("cpu")
    with pytest.raises(RunError, match="up_proj.weight.*outside the shard"):
        execute_weight_sync(data, 0, src, {}, cpu, cpu, wire_dtype=torch.float32)


def test_a_source_shard_of_another_dtype_than_the_wire_is_refused() -> None:
    case = CASES[0]
    data = stored_plan(case)
    src = shards(DIMS, full_tensors(DIMS), data.src, 0, None)
    src = {k: (t.to(torch.bfloat16), r) for k, (t, r) in src.items()}
    cpu = torch.device("cpu")
    with pytest.raises(RunError, match="wire dtype"):
        execute_weight_sync(data, 0, src, {}, cpu, cpu, wire_dtype=torch.float32)


def test_a_shard_layout_change_after_a_sync_is_checked_again() -> None:
    """The rank's reading of the plan is kept per plan and shard layout: the same layout reuses it, and a
    shard that changes shape afterwards is refused as on a first sync, not sliced with the old indices."""
    from graphrl.executors.weightsync import _rank_sync

    case = CASES[0]
    data = stored_plan(case)
    cpu = torch.device("cpu")
    src = shards(DIMS, full_tensors(DIMS), data.src, 0, None)
    first = _rank_sync(data, 0, src, {}, torch.float32)
    again = {k: (t.clone(), r) for k, (t, r) in src.items()}  # new tensors, same layout
    assert _rank_sync(data, 0, again, {}, torch.float32) is first
    assert first.rounds and all(peer == 1 for sends, _ in first.rounds for peer, _, _ in sends)
    name = "model.layers.0.mlp.up_proj.weight"
    tensor, region = src[name]
    src[name] = (tensor[:1], region)
    with pytest.raises(RunError, match="up_proj.weight has shape"):
        execute_weight_sync(data, 0, src, {}, cpu, cpu, wire_dtype=torch.float32)


def test_packed_messages_round_trip_mixed_shapes_strides_and_dtypes() -> None:
    """A packed message holds its pieces back to back in order, whatever their shape or strides (a
    column block of a row-major weight is strided), and unpacking casts to each target's dtype."""
    from graphrl.executors.weightsync import _pack, _unpack

    cpu = torch.device("cpu")
    weight = torch.arange(48, dtype=torch.bfloat16).view(6, 8)
    norm = torch.arange(8, dtype=torch.bfloat16) + 100
    views = [weight[:, 4:], norm[2:6], weight[1:3]]
    flat = _pack(views, torch.bfloat16, cpu)
    assert torch.equal(flat, torch.cat([v.reshape(-1) for v in views]))
    assert torch.equal(_pack([weight[:, :4]], torch.bfloat16, cpu), weight[:, :4].reshape(-1))
    assert _pack([weight[1:3]], torch.bfloat16, cpu).data_ptr() == weight[1].data_ptr()  # contiguous: no copy
    targets = [torch.zeros(6, 4), torch.zeros(4), torch.zeros(2, 8)]
    _unpack(targets, flat)
    for target, view in zip(targets, views):
        assert target.dtype == torch.float32 and torch.equal(target, view.float())
