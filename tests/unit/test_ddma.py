"""The DDMA weight-sync planner: exact coverage, each byte once, contention-free rounds, balance."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrl.compiler.ddma import (
    DdmaPlan,
    TransferRound,
    _edge_colouring,
    plan_summary,
    plan_weight_sync,
    sync_record,
)
from graphrl.schemas.sharding import (
    LayoutFn,
    Mesh,
    MeshAxis,
    ParamInfo,
    Replicate,
    Shard,
    llama_param_layout,
    llama_params,
    local_slices,
    region_size,
    shard_bounds,
    shard_region,
    to_slices,
)
from graphrl.errors import GraphRLError
from graphrl.schemas.model import MODEL_PRESETS, ModelDims
from graphrl.schemas.weightsync import Bucket, LocalCopy, Slice, WeightSyncRecord

DP, FSDP, TP, PP = MeshAxis.DP, MeshAxis.FSDP, MeshAxis.TP, MeshAxis.PP


# --- the checks every plan must pass ----------------------------------------------------------


def brute_lower_bound(params, src_mesh, src_layout, dst_mesh, dst_layout, eb) -> int:
    """Per destination rank and parameter: bytes of its region that its own source shard lacks."""
    total = 0
    for p in params:
        for r in dst_mesh.ranks():
            need = shard_bounds(p, dst_mesh, r, dst_layout(p))
            if need is None:
                continue
            held = shard_bounds(p, src_mesh, r, src_layout(p)) if r in src_mesh else None
            overlap = 0
            if held is not None:
                overlap = math.prod(max(0, min(b, d) - max(a, c)) for (a, b), (c, d) in zip(need, held))
            total += (math.prod(b - a for a, b in need) - overlap) * eb
    return total


def check_plan(plan: DdmaPlan, params, src_mesh, src_layout, dst_mesh, dst_layout, eb: int, limit: int,
               group_of=None) -> None:
    by_name = {p.name: p for p in params}
    assert plan.num_pairs == len({(b.src, b.dst) for b in plan.buckets()})
    coverage = {}  # (param, dst rank) -> count per element
    for p in params:
        for r in dst_mesh.ranks():
            if shard_bounds(p, dst_mesh, r, dst_layout(p)) is not None:
                coverage[(p.name, r)] = np.zeros(p.shape, dtype=np.int64)

    def take(src: int, dst: int, slices: tuple[Slice, ...]) -> int:
        elems = 0
        for sl in slices:
            p = by_name[sl.param]
            held = shard_bounds(p, src_mesh, src, src_layout(p))
            need = shard_bounds(p, dst_mesh, dst, dst_layout(p))
            assert held is not None and need is not None
            assert all(a <= x and y <= b for (x, y), (a, b) in zip(sl.region, held)), (sl, held)
            assert all(a <= x and y <= b for (x, y), (a, b) in zip(sl.region, need)), (sl, need)
            assert region_size(sl.region) > 0
            coverage[(sl.param, dst)][to_slices(sl.region)] += 1
            elems += region_size(sl.region)
        return elems

    sent, received = Counter(), Counter()
    for rnd in plan.rounds:
        senders = [b.src for b in rnd.buckets]
        receivers = [b.dst for b in rnd.buckets]
        assert len(set(senders)) == len(senders) and len(set(receivers)) == len(receivers), rnd
        for b in rnd.buckets:
            assert b.src != b.dst
            assert b.num_bytes == take(b.src, b.dst, b.slices) * eb
            assert 0 < b.num_bytes <= limit
            sent[b.src] += b.num_bytes
            received[b.dst] += b.num_bytes
    for c in plan.local_copies:
        assert c.num_bytes == take(c.rank, c.rank, c.slices) * eb

    # The union of what each destination receives and keeps is exactly its region, once.
    for (name, r), count in coverage.items():
        p = by_name[name]
        expected = np.zeros(p.shape, dtype=np.int64)
        expected[to_slices(shard_bounds(p, dst_mesh, r, dst_layout(p)))] = 1
        assert np.array_equal(count, expected), (name, r)

    assert plan.total_bytes == sum(sent.values()) == plan.lower_bound_bytes
    assert plan.lower_bound_bytes == brute_lower_bound(params, src_mesh, src_layout, dst_mesh, dst_layout, eb)
    assert plan.bytes_per_src == dict(sent) and plan.bytes_per_dst == dict(received)
    # Exactly max-degree rounds, the fewest possible; in staging groups, a group's rounds carry only its
    # parameters and are as many as its own max degree.
    groups = sorted({group_of(p) for p in params}) if group_of is not None else [None]
    assert group_of is None or (len(plan.group_rounds) == len(groups) and sum(plan.group_rounds) == len(plan.rounds))
    start = 0
    for g, num_rounds in zip(groups, plan.group_rounds or (len(plan.rounds),)):
        degree = Counter()
        for rnd in plan.rounds[start:start + num_rounds]:
            for b in rnd.buckets:
                degree[("s", b.src)] += 1
                degree[("d", b.dst)] += 1
                assert g is None or all(group_of(by_name[sl.param]) == g for sl in b.slices)
        assert num_rounds == max(degree.values(), default=0)
        start += num_rounds


# --- strategies -------------------------------------------------------------------------------


@st.composite
def meshes(draw, devices_from: list[int] | None = None, max_ranks: int = 8) -> Mesh:
    axes = draw(st.permutations([DP, FSDP, TP, PP]))
    sizes, total = [], 1
    for axis in axes:
        size = draw(st.integers(1, max(1, min(3, max_ranks // total))))
        sizes.append((axis, size))
        total *= size
    sizes = [(a, s) for a, s in sizes if s > 1 or draw(st.booleans())]
    total = math.prod(s for _, s in sizes)
    if devices_from is None:
        start = draw(st.integers(0, 6))
        devices = list(range(start, start + total))
    else:
        devices = list(devices_from)
    devices = draw(st.permutations(devices)) if draw(st.booleans()) else devices
    return Mesh.of(tuple(devices[:total]), tuple(sizes))


@st.composite
def layouts(draw, params: list[ParamInfo]) -> LayoutFn:
    table = {}
    for p in params:
        options = [Replicate()] + [Shard(d) for d in range(len(p.shape))]
        table[p.name] = {axis: draw(st.sampled_from(options)) for axis in (DP, FSDP, TP)}
    return lambda p: table[p.name]


@st.composite
def param_lists(draw) -> list[ParamInfo]:
    num_layers = draw(st.integers(1, 4))
    count = draw(st.integers(1, 4))
    params = []
    for i in range(count):
        shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
        layer = draw(st.one_of(st.none(), st.integers(0, num_layers - 1)))
        name = "model.embed_tokens.weight" if i == 0 and layer is None else f"p{i}"
        params.append(ParamInfo(name, shape, layer, num_layers))
    return params


# --- properties -------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_random_layouts_cover_each_destination_exactly_once_at_the_lower_bound(data) -> None:
    params = data.draw(param_lists())
    src_mesh = data.draw(meshes())
    dst_mesh = data.draw(meshes())
    src_layout, dst_layout = data.draw(layouts(params)), data.draw(layouts(params))
    eb = data.draw(st.sampled_from([1, 2, 4]))
    limit = data.draw(st.sampled_from([eb, 3 * eb, 16, 64, 1 << 20]))
    plan = plan_weight_sync(
        params, src_mesh=src_mesh, src_layout=src_layout, dst_mesh=dst_mesh, dst_layout=dst_layout,
        src_bytes_per_elem=eb, dst_bytes_per_elem=1, bucket_bytes=limit,
    )
    check_plan(plan, params, src_mesh, src_layout, dst_mesh, dst_layout, eb, limit)
    again = plan_weight_sync(
        params, src_mesh=src_mesh, src_layout=src_layout, dst_mesh=dst_mesh, dst_layout=dst_layout,
        src_bytes_per_elem=eb, dst_bytes_per_elem=1, bucket_bytes=limit,
    )
    assert again == plan  # deterministic


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_staging_groups_run_in_turn_and_move_the_same_bytes(data) -> None:
    """A sync cut into staging groups (an fp8 generator quantizes one group at a time): every group's
    parameters arrive in its own run of rounds, whole, and the bytes on the wire are the ungrouped plan's."""
    params = data.draw(param_lists())
    src_mesh = data.draw(meshes())
    dst_mesh = data.draw(meshes(devices_from=list(src_mesh.ranks()), max_ranks=src_mesh.num_ranks)
                         if data.draw(st.booleans()) else meshes())
    src_layout, dst_layout = data.draw(layouts(params)), data.draw(layouts(params))
    num_groups = data.draw(st.integers(1, 3))
    group = {p.name: data.draw(st.integers(0, num_groups - 1)) for p in params}
    limit = data.draw(st.sampled_from([2, 16, 1 << 20]))
    kwargs = dict(src_mesh=src_mesh, src_layout=src_layout, dst_mesh=dst_mesh, dst_layout=dst_layout,
                  src_bytes_per_elem=2, dst_bytes_per_elem=1, bucket_bytes=limit)
    grouped = plan_weight_sync(params, group_of=lambda p: group[p.name], **kwargs)
    check_plan(grouped, params, src_mesh, src_layout, dst_mesh, dst_layout, 2, limit, lambda p: group[p.name])
    whole = plan_weight_sync(params, **kwargs)
    assert grouped.total_bytes == whole.total_bytes and grouped.local_bytes == whole.local_bytes
    assert whole.group_rounds == ()


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_overlapping_devices_keep_what_they_hold(data) -> None:
    """Destination meshes drawn over the source's own devices: held bytes become local copies."""
    params = data.draw(param_lists())
    src_mesh = data.draw(meshes())
    dst_mesh = data.draw(meshes(devices_from=list(src_mesh.ranks()), max_ranks=src_mesh.num_ranks))
    src_layout, dst_layout = data.draw(layouts(params)), data.draw(layouts(params))
    plan = plan_weight_sync(
        params, src_mesh=src_mesh, src_layout=src_layout, dst_mesh=dst_mesh, dst_layout=dst_layout,
        src_bytes_per_elem=2, bucket_bytes=32,
    )
    check_plan(plan, params, src_mesh, src_layout, dst_mesh, dst_layout, 2, 32)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_stored_record_reads_back_as_the_plan(data) -> None:
    """A plan file keeps a sync in tables (names, regions, distinct contents as runs, distinct round
    columns); read back, as a plan file stores it, it is every bucket of every round and every local copy
    of the plan, in order: with slices cut to fit buckets, staging groups and rank-local copies."""
    params = data.draw(param_lists())
    src_mesh = data.draw(meshes())
    dst_mesh = data.draw(meshes(devices_from=list(src_mesh.ranks()), max_ranks=src_mesh.num_ranks)
                         if data.draw(st.booleans()) else meshes())
    src_layout, dst_layout = data.draw(layouts(params)), data.draw(layouts(params))
    group = {p.name: data.draw(st.integers(0, 2)) for p in params}
    limit = data.draw(st.sampled_from([2, 16, 1 << 20]))
    plan = plan_weight_sync(params, src_mesh=src_mesh, src_layout=src_layout, dst_mesh=dst_mesh,
                            dst_layout=dst_layout, src_bytes_per_elem=2, bucket_bytes=limit,
                            group_of=(lambda p: group[p.name]) if data.draw(st.booleans()) else None)
    record = WeightSyncRecord.model_validate_json(sync_record(plan, "m", src_mesh, dst_mesh, 0.0).model_dump_json())
    assert [record.round_buckets(k) for k in range(len(record.rounds))] == [list(r.buckets) for r in plan.rounds]
    assert record.local_copies() == list(plan.local_copies)
    assert record.group_rounds == list(plan.group_rounds)


def test_a_405b_sync_is_stored_whole_and_small() -> None:
    """The 405B example's sync (fsdp22 x tp8 trainer -> 53 tp16 fp8 generators, ~190,000 buckets) once kept
    only its summary, and every rank planned its own part; the plan now stores every round, in tables small
    enough for a plan file (the contents and round columns repeat across the generator's replicas)."""
    import msgpack

    from graphrl.compiler.ddma import gc_paused, plan_llama_sync

    src = Mesh.contiguous([(DP, 1), (FSDP, 22), (TP, 8), (PP, 1)], 848)
    dst = Mesh.contiguous([(DP, 53), (FSDP, 1), (TP, 16), (PP, 1)], 0)
    with gc_paused():
        plan = plan_llama_sync(MODEL_PRESETS["llama3-405b"], src, dst, "fp8")
        record = sync_record(plan, "policy", src, dst, 0.0)
    assert sum(len(record.columns[r.src]) for r in record.rounds) == record.summary.num_buckets > 150_000
    assert record.round_buckets(0) == list(plan.rounds[0].buckets)
    assert len(msgpack.packb(record.model_dump(mode="json"))) < 1 << 20


@settings(max_examples=40, deadline=None)
@given(params=param_lists(), mesh=meshes(), data=st.data())
def test_same_layout_on_same_devices_moves_nothing(params, mesh, data) -> None:
    layout = data.draw(layouts(params))
    plan = plan_weight_sync(params, src_mesh=mesh, src_layout=layout, dst_mesh=mesh, dst_layout=layout, bucket_bytes=8)
    assert plan.is_noop and plan.rounds == () and plan.total_bytes == 0 and plan.lower_bound_bytes == 0
    check_plan(plan, params, mesh, layout, mesh, layout, 2, 8)
    # Every rank copies its whole shard onto itself.
    held = sum(
        math.prod(b - a for a, b in region) * 2
        for p in params
        for r in mesh.ranks()
        if (region := shard_bounds(p, mesh, r, layout(p))) is not None
    )
    assert plan.local_bytes == held


@settings(max_examples=50, deadline=None)
@given(
    src_dp=st.integers(2, 4),
    src_tp=st.sampled_from([1, 2, 4]),
    src_fsdp=st.sampled_from([1, 2]),
    dst_dp=st.integers(1, 3),
    dst_tp=st.sampled_from([1, 2, 4]),
    num_layers=st.integers(1, 6),
)
def test_source_replicas_share_the_sending_evenly(src_dp, src_tp, src_fsdp, dst_dp, dst_tp, num_layers) -> None:
    """dp replicas on the source: the planner spreads sends so max/mean load <= 1.25."""
    dims = ModelDims(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=num_layers, num_heads=4, num_kv_heads=4,
    )
    params = llama_params(dims)
    src = Mesh.contiguous([(DP, src_dp), (FSDP, src_fsdp), (TP, src_tp)])
    dst = Mesh.contiguous([(DP, dst_dp), (TP, dst_tp)], first_rank=src.num_ranks)
    plan = plan_weight_sync(
        params, src_mesh=src, src_layout=llama_param_layout, dst_mesh=dst, dst_layout=llama_param_layout,
        bucket_bytes=4096,
    )
    check_plan(plan, params, src, llama_param_layout, dst, llama_param_layout, 2, 4096)
    assert plan.balance() <= 1.25, plan_summary(plan)


@settings(max_examples=100, deadline=None)
@given(
    edges=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=80),
    seed=st.randoms(use_true_random=False),
)
def test_edge_colouring_of_any_bipartite_multigraph_uses_max_degree_colours(edges, seed) -> None:
    """König: parallel edges and ranks that both send and receive included; any edge order."""
    order = list(range(len(edges)))
    seed.shuffle(order)
    colours = _edge_colouring(edges, order)
    degree = Counter([("s", u) for u, _ in edges] + [("d", v) for _, v in edges])
    assert max(colours) + 1 == max(degree.values())
    seen = set()
    for (u, v), c in zip(edges, colours):
        assert ("s", u, c) not in seen and ("d", v, c) not in seen
        seen |= {("s", u, c), ("d", v, c)}


def test_disaggregated_8b_sync_sends_each_generator_rank_exactly_its_shard() -> None:
    """llama3-8b, trainer fsdp=8 -> generator dp=4 x tp=2 on 8 other ranks: every generator rank
    receives exactly its shard, ~8 GB, and the 8 trainer ranks share the sending evenly."""
    params = llama_params(MODEL_PRESETS["llama3-8b"])
    src = Mesh.contiguous([(FSDP, 8)])
    dst = Mesh.contiguous([(DP, 4), (TP, 2)], first_rank=8)
    plan = plan_weight_sync(
        params, src_mesh=src, src_layout=llama_param_layout, dst_mesh=dst, dst_layout=llama_param_layout,
        bucket_bytes=256 << 20,
    )
    model_bytes = 2 * sum(p.num_elements for p in params)
    norm_bytes = 2 * sum(p.num_elements for p in params if len(p.shape) == 1)  # replicated over tp
    # Each generator rank gets its tp half of every matrix and every norm whole.
    per_rank = (model_bytes - norm_bytes) // 2 + norm_bytes
    assert plan.bytes_per_dst == {r: per_rank for r in dst.ranks()}
    assert plan.total_bytes == plan.lower_bound_bytes == 8 * per_rank
    assert all(b.num_bytes <= 256 << 20 for b in plan.buckets())
    assert plan.balance() == pytest.approx(1.0, abs=1e-3)
    degree = Counter([b.src for b in plan.buckets()])
    assert len(plan.rounds) == max(max(degree.values()), max(Counter(b.dst for b in plan.buckets()).values()))


# --- worked examples --------------------------------------------------------------------------


def rows(a: int, b: int) -> tuple[tuple[int, int], ...]:
    return ((a, b), (0, 4))


def test_fsdp2_to_tp2_on_the_same_ranks_copies_every_weight_matrix_in_place() -> None:
    """The trainer's fsdp shards of o/down are column blocks (`fsdp_shard_dim`), the tp generator's shards:
    on shared ranks only the norms (replicated by tp, row-sharded by fsdp) cross, as a rank's missing half."""
    from graphrl.compiler.weight_sync import ddma_record
    from graphrl.schemas.hardware import HARDWARE_PRESETS

    dims = ModelDims(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
    src = Mesh.contiguous([("dp", 1), ("fsdp", 2), ("tp", 1), ("pp", 1)], 0)
    dst = Mesh.contiguous([("dp", 1), ("fsdp", 1), ("tp", 2), ("pp", 1)], 0)
    record, _ = ddma_record(dims, "policy", HARDWARE_PRESETS["h100-sxm-80gb"], 8, src, dst, "bf16")
    crossing = {s.param for b in record.buckets() for s in b.slices}
    assert crossing and all(name.endswith("norm.weight") for name in crossing), crossing
    norms = sum(p.num_elements for p in llama_params(dims) if p.name.endswith("norm.weight"))
    assert record.summary.total_bytes == norms * 2  # each rank receives the other half of every norm
    # Each rank keeps half of every matrix and of every norm: together, every element once.
    assert record.summary.local_bytes == sum(p.num_elements for p in llama_params(dims)) * 2


def test_hand_computed_tp2_to_tp4_on_other_devices() -> None:
    """One [4, 4] bf16 weight, tp=2 on ranks 0,1 (two rows each) -> tp=4 on ranks 2..5 (one row each)."""
    w = ParamInfo("w", (4, 4))
    layout = lambda p: {TP: Shard(0)}  # noqa: E731
    plan = plan_weight_sync(
        [w], src_mesh=Mesh.of((0, 1), ((TP, 2),)), src_layout=layout,
        dst_mesh=Mesh.of((2, 3, 4, 5), ((TP, 4),)), dst_layout=layout, bucket_bytes=1 << 20,
    )

    def bucket(src: int, dst: int, row: int) -> Bucket:
        return Bucket(src, dst, 8, (Slice("w", rows(row, row + 1)),))

    assert plan.rounds == (
        TransferRound((bucket(0, 2, 0), bucket(1, 4, 2))),
        TransferRound((bucket(0, 3, 1), bucket(1, 5, 3))),
    )
    assert plan.local_copies == ()
    assert plan.total_bytes == plan.lower_bound_bytes == 32
    assert plan.bytes_per_src == {0: 16, 1: 16} and plan.bytes_per_dst == {2: 8, 3: 8, 4: 8, 5: 8}
    assert plan.balance() == 1.0


def test_hand_computed_tp2_to_tp4_on_overlapping_devices() -> None:
    """Same weight, tp=2 on ranks 0,1 -> tp=4 on ranks 0..3: rank 0 keeps row 0 locally."""
    w = ParamInfo("w", (4, 4))
    layout = lambda p: {TP: Shard(0)}  # noqa: E731
    plan = plan_weight_sync(
        [w], src_mesh=Mesh.of((0, 1), ((TP, 2),)), src_layout=layout,
        dst_mesh=Mesh.of((0, 1, 2, 3), ((TP, 4),)), dst_layout=layout, bucket_bytes=1 << 20,
    )
    one = lambda s, d, r: Bucket(s, d, 8, (Slice("w", rows(r, r + 1)),))  # noqa: E731
    assert plan.rounds == (TransferRound((one(0, 1, 1), one(1, 2, 2))), TransferRound((one(1, 3, 3),)))
    assert plan.local_copies == (LocalCopy(0, 8, (Slice("w", rows(0, 1)),)),)
    assert plan.total_bytes == 24 and plan.local_bytes == 8


def test_a_slice_longer_than_a_bucket_is_cut_to_fill_buckets() -> None:
    """A [6, 5] fp32 weight (120 B) sent whole with 48 B buckets: 120 B = 3 buckets of 40 B."""
    w = ParamInfo("w", (6, 5))
    plan = plan_weight_sync(
        [w], src_mesh=Mesh.of((0,), ()), src_layout=lambda p: {}, dst_mesh=Mesh.of((1,), ()), dst_layout=lambda p: {},
        src_bytes_per_elem=4, bucket_bytes=48,
    )
    assert [b.num_bytes for b in plan.buckets()] == [40, 40, 40]
    assert [s.region for b in plan.buckets() for s in b.slices] == [
        ((0, 2), (0, 5)), ((2, 4), (0, 5)), ((4, 6), (0, 5))
    ]
    assert len(plan.rounds) == 3


def test_wire_bytes_are_source_bytes() -> None:
    """bf16 trainer -> fp8 generator: 2 bytes per element cross the link; the cast is the receiver's."""
    w = ParamInfo("w", (4, 4))
    plan = plan_weight_sync(
        [w], src_mesh=Mesh.of((0,), ()), src_layout=lambda p: {}, dst_mesh=Mesh.of((1,), ()), dst_layout=lambda p: {},
        src_bytes_per_elem=2, dst_bytes_per_elem=1,
    )
    assert plan.total_bytes == 32 and plan.dst_bytes_per_elem == 1


def test_bad_inputs_are_user_errors() -> None:
    w = ParamInfo("w", (4,))
    kwargs = dict(src_mesh=Mesh.of((0,), ()), src_layout=lambda p: {}, dst_mesh=Mesh.of((1,), ()), dst_layout=lambda p: {})
    with pytest.raises(GraphRLError, match="bucket"):
        plan_weight_sync([w], bucket_bytes=1, **kwargs)
    with pytest.raises(GraphRLError, match="repeat"):
        plan_weight_sync([w, w], **kwargs)


# --- end to end with real tensors -------------------------------------------------------------


def execute(plan: DdmaPlan, params, src_mesh, dst_mesh, full: dict[str, torch.Tensor], dst_dtype) -> dict:
    """Run a plan on in-memory shards the way ranks would: pack a flat buffer per bucket, unpack it."""
    src_shards = {}
    for p in params:
        for r in src_mesh.ranks():
            region = shard_region(p, src_mesh, r, llama_param_layout(p))
            if region is not None:
                src_shards[(p.name, r)] = full[p.name][region].clone()
    dst_shards = {}
    for p in params:
        for r in dst_mesh.ranks():
            region = shard_region(p, dst_mesh, r, llama_param_layout(p))
            if region is not None:
                dst_shards[(p.name, r)] = torch.full(full[p.name][region].shape, float("nan"), dtype=dst_dtype)
    by_name = {p.name: p for p in params}

    def src_view(sl: Slice, rank: int) -> torch.Tensor:
        held = shard_bounds(by_name[sl.param], src_mesh, rank, llama_param_layout(by_name[sl.param]))
        return src_shards[(sl.param, rank)][local_slices(sl.region, held)]

    def dst_view(sl: Slice, rank: int) -> torch.Tensor:
        need = shard_bounds(by_name[sl.param], dst_mesh, rank, llama_param_layout(by_name[sl.param]))
        return dst_shards[(sl.param, rank)][local_slices(sl.region, need)]

    for rnd in plan.rounds:
        for b in rnd.buckets:
            wire = torch.cat([src_view(sl, b.src).reshape(-1) for sl in b.slices])  # sender packs
            assert wire.numel() * wire.element_size() == b.num_bytes
            offset = 0
            for sl in b.slices:  # receiver unpacks and casts
                view = dst_view(sl, b.dst)
                view.copy_(wire[offset : offset + view.numel()].reshape(view.shape))
                offset += view.numel()
    for c in plan.local_copies:
        for sl in c.slices:
            dst_view(sl, c.rank).copy_(src_view(sl, c.rank))
    return dst_shards


@pytest.mark.parametrize(
    "src_axes, dst_axes, dst_first",
    [
        ([(FSDP, 2), (TP, 2)], [(DP, 2), (TP, 3)], 4),  # disjoint, uneven tp=3
        ([(PP, 2), (FSDP, 2), (TP, 2)], [(TP, 4)], 2),  # pp on the trainer, overlapping devices
        ([(DP, 2), (TP, 3)], [(PP, 3), (TP, 2)], 0),  # pp on the generator, same devices
        ([(FSDP, 3), (TP, 2)], [(FSDP, 3), (TP, 2)], 0),  # same layout: all local
    ],
)
def test_executing_the_plan_rebuilds_every_destination_shard(src_axes, dst_axes, dst_first) -> None:
    dims = ModelDims(vocab_size=21, hidden_size=12, intermediate_size=18, num_layers=3, num_heads=3, num_kv_heads=1)
    params = llama_params(dims)
    torch.manual_seed(0)
    full = {p.name: torch.randn(p.shape, dtype=torch.float32) for p in params}
    src_mesh = Mesh.contiguous(src_axes)
    dst_mesh = Mesh.contiguous(dst_axes, first_rank=dst_first)
    plan = plan_weight_sync(
        params, src_mesh=src_mesh, src_layout=llama_param_layout, dst_mesh=dst_mesh, dst_layout=llama_param_layout,
        src_bytes_per_elem=4, dst_bytes_per_elem=2, bucket_bytes=256,
    )
    check_plan(plan, params, src_mesh, llama_param_layout, dst_mesh, llama_param_layout, 4, 256)
    dst_shards = execute(plan, params, src_mesh, dst_mesh, full, torch.bfloat16)
    for p in params:
        for r in dst_mesh.ranks():
            region = shard_region(p, dst_mesh, r, llama_param_layout(p))
            if region is not None:
                assert torch.equal(dst_shards[(p.name, r)], full[p.name][region].to(torch.bfloat16)), (p.name, r)
    assert plan.is_noop == (src_axes == dst_axes and dst_first == 0)


def test_an_fp8_generators_sync_runs_in_staging_groups_of_layers(monkeypatch) -> None:
    """`plan_llama_sync` into fp8 cuts the sync into groups of `staging_layers` consecutive layers (the
    embedding, final norm and head with the first), and into bf16 keeps one group; both rebuild every
    destination shard. A tiny model's layers all fit one group's bytes, so the bound is shrunk here."""
    from graphrl.compiler.ddma import plan_llama_sync, sync_staging_layers
    from graphrl.schemas import sharding
    from graphrl.schemas.sharding import MAX_STAGING_GROUPS, staging_group, staging_layers

    dims = ModelDims(vocab_size=21, hidden_size=12, intermediate_size=18, num_layers=6, num_heads=3, num_kv_heads=1)
    src, dst = Mesh.contiguous([(FSDP, 2), (TP, 2)]), Mesh.contiguous([(TP, 2)], first_rank=4)
    assert staging_layers(dims, 2) == dims.num_layers  # one group
    monkeypatch.setattr(sharding, "STAGING_GROUP_BYTES", 1)  # a layer a group, but no more than 4 groups
    layers = staging_layers(dims, 2)
    assert sync_staging_layers(dims, dst, "fp8") == layers and sync_staging_layers(dims, dst, "bf16") is None
    assert layers == math.ceil(dims.num_layers / MAX_STAGING_GROUPS) == 2
    fp8, bf16 = plan_llama_sync(dims, src, dst, "fp8"), plan_llama_sync(dims, src, dst, "bf16")
    assert len(fp8.group_rounds) == math.ceil(dims.num_layers / layers) and bf16.group_rounds == ()
    assert fp8.staging_layers == layers and bf16.staging_layers == 0
    params = llama_params(dims)
    start = 0
    for g, num_rounds in enumerate(fp8.group_rounds):
        names = {sl.param for rnd in fp8.rounds[start:start + num_rounds] for b in rnd.buckets for sl in b.slices}
        assert names == {p.name for p in params if staging_group(p.name, layers) == g}
        start += num_rounds
    torch.manual_seed(0)
    full = {p.name: torch.randn(p.shape).to(torch.bfloat16) for p in params}  # the wire's dtype
    for plan in (fp8, bf16):
        shards = execute(plan, params, src, dst, full, torch.bfloat16)
        for p in params:
            for r in dst.ranks():
                assert torch.equal(shards[(p.name, r)], full[p.name][shard_region(p, dst, r, llama_param_layout(p))])


def test_staging_groups_hold_a_bounded_number_of_bytes_or_layers() -> None:
    """A group holds the most layers within `STAGING_GROUP_BYTES` per device at two bytes a weight, and
    there are at most `MAX_STAGING_GROUPS` groups; a layer larger than the bound is a group of its own."""
    from graphrl.schemas.sharding import (MAX_STAGING_GROUPS, STAGING_GROUP_BYTES, llama_layer_param_count,
                                          param_layer, staging_group, staging_layers)

    for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
        dims = MODEL_PRESETS[name]
        for tp in (1, 2, 4, 8, 16):
            layers = staging_layers(dims, tp)
            layer_bytes = llama_layer_param_count(dims, matmuls_only=True) / tp * 2
            assert math.ceil(dims.num_layers / layers) <= MAX_STAGING_GROUPS
            assert layers * layer_bytes <= STAGING_GROUP_BYTES or layers == math.ceil(dims.num_layers / MAX_STAGING_GROUPS)
    huge = ModelDims(vocab_size=8, hidden_size=65536, intermediate_size=65536, num_layers=2, num_heads=8, num_kv_heads=8)
    assert staging_layers(huge, 1) == 1
    assert param_layer("model.layers.17.mlp.up_proj.weight") == 17 and param_layer("model.norm.weight") is None
    assert staging_group("model.layers.17.mlp.up_proj.weight", 8) == 2 and staging_group("lm_head.weight", 8) == 0


# --- summary ----------------------------------------------------------------------------------


def test_plan_summary_is_json_and_consistent() -> None:
    dims = ModelDims(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    params = llama_params(dims)
    src = Mesh.contiguous([(DP, 2), (TP, 2)])
    dst = Mesh.contiguous([(TP, 4)], first_rank=4)
    plan = plan_weight_sync(
        params, src_mesh=src, src_layout=llama_param_layout, dst_mesh=dst, dst_layout=llama_param_layout,
        bucket_bytes=512,
    )
    summary = json.loads(json.dumps(plan_summary(plan)))
    assert summary["num_rounds"] == len(plan.rounds)
    assert summary["num_buckets"] == plan.num_buckets
    assert summary["total_bytes"] == plan.total_bytes == summary["lower_bound_bytes"]
    assert summary["max_bytes_per_src"] == max(plan.bytes_per_src.values())
    assert summary["balance"] == pytest.approx(plan.balance())
    assert summary["num_senders"] == 4 and summary["num_receivers"] == 4
