"""Layouts as data: meshes, placements, pp stages, the region each rank holds, Llama names."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrl.schemas.mesh import LayoutError
from graphrl.schemas.sharding import (
    Mesh,
    MeshAxis,
    ParamInfo,
    Replicate,
    Shard,
    llama_param_layout,
    llama_params,
    pp_stage,
    shard_bounds,
    shard_region,
    chunk_bounds,
    fsdp_shard_dim,
    llama_layout_on,
    fsdp_layer_units,
)
from graphrl.schemas.model import MODEL_PRESETS, ModelDims

DP, FSDP, TP, PP = MeshAxis.DP, MeshAxis.FSDP, MeshAxis.TP, MeshAxis.PP


# --- meshes -----------------------------------------------------------------------------------


def test_mesh_coords_are_row_major_over_the_given_devices() -> None:
    mesh = Mesh.of((10, 11, 12, 13, 14, 15), ((DP, 2), (TP, 3)))
    assert mesh.coords(10) == {DP: 0, TP: 0}
    assert mesh.coords(12) == {DP: 0, TP: 2}
    assert mesh.coords(13) == {DP: 1, TP: 0}
    assert mesh.size(TP) == 3 and mesh.size(PP) == 1
    assert mesh.ranks() == (10, 11, 12, 13, 14, 15)
    assert Mesh.contiguous([("fsdp", 4), ("tp", 2)], first_rank=8).ranks() == tuple(range(8, 16))


def test_mesh_accepts_axis_names_as_strings_and_compares_by_value() -> None:
    assert Mesh.of([0, 1], [("tp", 2)]) == Mesh.of((0, 1), ((TP, 2),))


@pytest.mark.parametrize(
    "devices, axes",
    [
        ((0, 1, 2), ((DP, 2),)),  # product 2 != 3 devices
        ((0, 1, 2, 3), ((DP, 2), (DP, 2))),  # axis twice
        ((0, 0), ((TP, 2),)),  # a device twice
        ((0, 1), (("xp", 2),)),  # unknown axis
        ((), ()),  # nothing
    ],
)
def test_mesh_rejects_inconsistent_descriptions(devices: tuple, axes: tuple) -> None:
    with pytest.raises(ValueError, match="hold|twice|distinct|is not a valid MeshAxis"):
        Mesh.of(devices, axes)


def test_coords_of_a_foreign_rank_is_an_error() -> None:
    with pytest.raises(LayoutError, match="not in mesh"):
        Mesh.of((0, 1), ((TP, 2),)).coords(5)


# --- splits -----------------------------------------------------------------------------------


@given(st.integers(0, 40), st.integers(1, 9))
def test_chunk_bounds_are_what_a_dtensor_shard_holds(length: int, num_pieces: int) -> None:
    """DTensor's Shard (and FSDP2) cut like torch.chunk, padded with empty pieces at the end."""
    pieces = list(torch.chunk(torch.arange(length), num_pieces)) if length else []
    pieces += [torch.arange(0)] * (num_pieces - len(pieces))
    for i, piece in enumerate(pieces):
        start, stop = chunk_bounds(length, num_pieces, i)
        assert torch.equal(piece, torch.arange(start, stop))


@given(st.integers(0, 40), st.integers(1, 9))
def test_bucket_cuts_follow_torch_tensor_split(length: int, num_pieces: int) -> None:
    from graphrl.compiler.ddma import _even_bounds

    pieces = torch.tensor_split(torch.arange(length), num_pieces)
    for i, piece in enumerate(pieces):
        start, stop = _even_bounds(length, num_pieces, i)
        assert torch.equal(piece, torch.arange(start, stop))


def test_tp_and_fsdp_on_one_dim_nest_as_torch_applies_them() -> None:
    """parallelize_module cuts over tp first (10 -> 4, 4, 2), then fully_shard cuts each tp shard over
    fsdp (a strided shard): rank (fsdp i, tp j) = 3 i + j holds piece i of tp piece j."""
    mesh = Mesh.contiguous([(FSDP, 2), (TP, 3)])
    param = ParamInfo("w", (10, 4))
    layout = {FSDP: Shard(0), TP: Shard(0)}
    rows = [shard_bounds(param, mesh, r, layout)[0] for r in mesh.ranks()]
    assert rows == [(0, 2), (4, 6), (8, 9), (2, 4), (6, 8), (9, 10)]


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
    sizes=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)),
    choice=st.data(),
)
def test_regions_match_nested_dtensor_shards_and_replicas_cover_each_element_equally(shape, sizes, choice) -> None:
    axes = [(DP, sizes[0]), (FSDP, sizes[1]), (TP, sizes[2])]
    order = choice.draw(st.permutations(axes))
    mesh = Mesh.contiguous(order)
    layout = {
        axis: choice.draw(st.sampled_from([Replicate()] + [Shard(d) for d in range(len(shape))])) for axis, _ in axes
    }
    full = torch.arange(math.prod(shape)).reshape(shape)
    param = ParamInfo("w", shape)
    count = torch.zeros(shape, dtype=torch.int64)
    for rank in mesh.ranks():
        region = shard_region(param, mesh, rank, layout)
        # Reference: cut the full tensor as DTensor does (torch.chunk, empty pieces at the end), axis by
        # axis: tp first, then fsdp (the order torch applies them), then the others in mesh order.
        expected = full
        coords = mesh.coords(rank)
        for axis, size in sorted(mesh.axes, key=lambda a: {TP: 0, FSDP: 1}.get(a[0], 2)):
            if isinstance(layout[axis], Shard):
                dim = layout[axis].dim
                pieces = torch.chunk(expected, size, dim=dim) if expected.shape[dim] else ()
                i = coords[axis]
                expected = pieces[i] if i < len(pieces) else expected.narrow(dim, expected.shape[dim], 0)
        assert torch.equal(full[region], expected)
        count[region] += 1
    replicas = math.prod(size for axis, size in axes if isinstance(layout[axis], Replicate))
    assert bool((count == replicas).all())


def test_pp_cannot_shard_and_shard_dims_must_exist() -> None:
    mesh = Mesh.contiguous([(PP, 2)])
    with pytest.raises(LayoutError, match="pp"):
        shard_region(ParamInfo("w", (4,), 0, 2), mesh, 0, {PP: Shard(0)})
    with pytest.raises(LayoutError, match="names no dim"):
        shard_region(ParamInfo("w", (4,)), Mesh.contiguous([(TP, 2)]), 0, {TP: Shard(1)})


# --- pipeline stages --------------------------------------------------------------------------


@given(st.integers(1, 20), st.integers(1, 8))
def test_layers_split_contiguously_over_stages_like_tensor_split(num_layers: int, num_stages: int) -> None:
    expected = torch.tensor_split(torch.arange(num_layers), num_stages)
    for stage, layers in enumerate(expected):
        for layer in layers.tolist():
            param = ParamInfo(f"model.layers.{layer}.mlp.up_proj.weight", (1,), layer, num_layers)
            assert pp_stage(param, num_stages) == stage


def test_embeddings_on_first_stage_head_and_final_norm_on_last() -> None:
    mesh = Mesh.contiguous([(PP, 3), (TP, 2)])
    embed = ParamInfo("model.embed_tokens.weight", (8, 4), None, 6)
    head = ParamInfo("lm_head.weight", (8, 4), None, 6)
    norm = ParamInfo("model.norm.weight", (4,), None, 6)
    assert pp_stage(embed, 3) == 0 and pp_stage(head, 3) == 2 and pp_stage(norm, 3) == 2
    # Ranks of other stages hold nothing of the parameter.
    assert shard_region(embed, mesh, 0) == (slice(0, 4), slice(0, 4))
    assert shard_region(embed, mesh, 2) is None
    assert shard_region(head, mesh, 5) == (slice(4, 8), slice(0, 4))


def test_a_layer_param_without_num_layers_cannot_be_staged() -> None:
    with pytest.raises(LayoutError, match="num_layers"):
        pp_stage(ParamInfo("model.layers.0.mlp.up_proj.weight", (4,), 0), 2)


# --- Llama ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, tp",
    [
        ("model.layers.0.self_attn.q_proj.weight", Shard(0)),
        ("model.layers.0.self_attn.k_proj.weight", Shard(0)),
        ("model.layers.0.self_attn.v_proj.weight", Shard(0)),
        ("model.layers.0.mlp.gate_proj.weight", Shard(0)),
        ("model.layers.0.mlp.up_proj.weight", Shard(0)),
        ("model.layers.0.self_attn.o_proj.weight", Shard(1)),
        ("model.layers.0.mlp.down_proj.weight", Shard(1)),
        ("model.embed_tokens.weight", Shard(0)),
        ("lm_head.weight", Shard(0)),
        ("model.layers.0.input_layernorm.weight", Replicate()),
        ("model.layers.0.post_attention_layernorm.weight", Replicate()),
        ("model.norm.weight", Replicate()),
    ],
)
def test_llama_layout_is_megatron_tp_plus_fsdp2(name: str, tp) -> None:
    layout = llama_param_layout(ParamInfo(name, (8, 8), 0, 1))
    assert layout[TP] == tp
    assert layout[FSDP] == Shard(0) and layout[DP] == Replicate()
    assert llama_param_layout(ParamInfo(name, (8, 8), 0, 1), tp_sharded=False)[TP] == Replicate()


@pytest.mark.parametrize(
    "name, shape, fsdp, tp, dim",
    [
        ("model.layers.0.self_attn.o_proj.weight", (64, 64), 2, 1, 1),  # column blocks: a tp rank's shard
        ("model.layers.0.mlp.down_proj.weight", (64, 90), 2, 1, 1),
        ("model.layers.0.mlp.down_proj.weight", (64, 90), 4, 1, 0),  # 90 / 4 is uneven: FSDP2 takes dim 0 only
        ("model.layers.0.mlp.down_proj.weight", (64, 90), 2, 2, 0),  # tp cuts dim 1 already; fsdp nests on dim 0
        ("model.layers.0.mlp.down_proj.weight", (64, 90), 1, 1, 0),  # nothing to shard
        ("model.layers.0.mlp.up_proj.weight", (90, 64), 2, 1, 0),  # column parallel: rows are the tp shards
        ("model.embed_tokens.weight", (30, 64), 2, 1, 0),
        ("model.norm.weight", (64,), 2, 1, 0),
    ],
)
def test_fsdp_cuts_row_parallel_weights_into_column_blocks_where_even(name, shape, fsdp, tp, dim) -> None:
    assert fsdp_shard_dim(name, shape, fsdp, tp) == dim
    mesh = Mesh.contiguous([("dp", 1), ("fsdp", fsdp), ("tp", tp), ("pp", 1)], 0)
    assert llama_layout_on(mesh)(ParamInfo(name, shape, 0, 1))[FSDP] == Shard(dim)


def test_an_fsdp_shard_of_a_row_parallel_weight_is_the_tp_shard_on_the_same_ranks() -> None:
    """fsdp2 and tp2 on the same two ranks hold the same column block of o_proj, and of q_proj the same rows."""
    fsdp = Mesh.contiguous([("dp", 1), ("fsdp", 2), ("tp", 1), ("pp", 1)], 0)
    tp = Mesh.contiguous([("dp", 1), ("fsdp", 1), ("tp", 2), ("pp", 1)], 0)
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        param = ParamInfo(name, (64, 64), 0, 1)
        assert [shard_bounds(param, fsdp, r) for r in (0, 1)] == [shard_bounds(param, tp, r) for r in (0, 1)]
    assert shard_bounds(ParamInfo("model.layers.0.self_attn.o_proj.weight", (64, 64), 0, 1), fsdp, 1) == ((0, 64), (32, 64))


def test_llama_layout_refuses_unknown_names() -> None:
    with pytest.raises(LayoutError, match="not a Llama parameter"):
        llama_param_layout(ParamInfo("model.layers.0.moe.router.weight", (8, 8), 0, 1))


def test_llama_params_names_and_shapes() -> None:
    dims = MODEL_PRESETS["llama3-8b"]
    params = llama_params(dims)
    by_name = {p.name: p for p in params}
    assert len(params) == 1 + 32 * 9 + 2
    assert by_name["model.embed_tokens.weight"].shape == (128256, 4096)
    assert by_name["model.layers.3.self_attn.q_proj.weight"].shape == (4096, 4096)
    assert by_name["model.layers.3.self_attn.k_proj.weight"].shape == (1024, 4096)
    assert by_name["model.layers.3.self_attn.o_proj.weight"].shape == (4096, 4096)
    assert by_name["model.layers.3.mlp.down_proj.weight"].shape == (4096, 14336)
    assert by_name["model.layers.3.mlp.down_proj.weight"].layer == 3
    assert by_name["lm_head.weight"].layer is None
    # 8.03 B parameters, the published count.
    assert round(sum(p.num_elements for p in params) / 1e9, 2) == 8.03
    tied = llama_params(ModelDims(**{**dims.model_dump(), "tie_embeddings": True}))
    assert "lm_head.weight" not in {p.name for p in tied}


# --- FSDP2 units --------------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers,layer_mib,expected", [
    (2, 0.01, []),  # a tiny model is one unit
    (30, 9.0, [range(0, 3), range(3, 6), range(6, 9), range(9, 12), range(12, 15), range(15, 18),
               range(18, 21), range(21, 24), range(24, 27), range(27, 30)]),
    (7, 10.0, [range(0, 3), range(3, 6), range(6, 7)]),  # the last unit takes what is left
    (4, 25.0, [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]),  # a layer that fills a unit is one
    (3, 400.0, [range(0, 1), range(1, 2), range(2, 3)]),
    (3, 9.0, []),  # three layers reach 25 MiB: all of them, a single unit
])
def test_fsdp_units_hold_consecutive_layers_up_to_the_unit_size(num_layers, layer_mib, expected) -> None:
    assert fsdp_layer_units(num_layers, layer_mib * 2**20) == expected


@pytest.mark.parametrize("hidden,layers,dtype", [(64, 2, torch.float32), (512, 8, torch.float32),
                                                 (1024, 6, torch.bfloat16), (2048, 3, torch.bfloat16)])
def test_the_executors_wrap_the_units_the_compiler_charges(hidden, layers, dtype) -> None:
    """`executors.parallel.layer_units` on a real model (on the meta device) cuts its layers as the
    compiler's `fsdp_units`/`fsdp_unit_layers` count them, for the model's dtype and tp."""
    from graphrl.compiler import cost
    from graphrl.executors.models.llama import Llama
    from graphrl.executors.parallel import layer_units

    dims = ModelDims(vocab_size=1000, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers,
                     num_heads=8, num_kv_heads=4, max_seq_len=64)
    with torch.device("meta"):
        model = Llama(dims).to(dtype)
    for tp in (1, 2):
        units = layer_units(model.model.layers, tp=tp)
        size = dict(tp=tp, dtype_bytes=2 if dtype == torch.bfloat16 else 4)
        assert cost.fsdp_units(dims, **size) == (len(units) + 1 if units else 1)
        assert cost.fsdp_units(dims, **size, trained=False) == layers  # a frozen model's: layer by layer
        assert cost.fsdp_unit_layers(dims, **size) == (len(units[0]) if units else layers)
        assert [m for unit in units for m in unit] in ([], list(model.model.layers))
