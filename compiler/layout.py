"""Layouts as data: device meshes with named axes, per-parameter placements, and the shard a rank holds.

A model copy lives on a `Mesh` (`graphrl.schemas.mesh`): an ordered list of global ranks laid out
row-major over named axes (`dp`, `fsdp`, `tp`, `pp`). How one parameter is spread over that mesh is a `ParamLayout`: for each
axis either `Replicate()` or `Shard(dim)`. Resharding and weight sync (DDMA) read these as data, so a
new parallelism is a new layout function, not new transfer code.

Conventions, used everywhere in graphrl:

- Uneven splits follow `torch.tensor_split`: a length L cut into k pieces gives the first L % k
  pieces one extra element (L=10, k=4 -> 3, 3, 2, 2). A piece may be empty when k > L.
- Several axes sharding the same tensor dim nest in mesh-axis order, as DTensor does: the earlier
  axis splits the dim first, the later axis splits each of those pieces again.
- `pp` never slices a tensor: it assigns whole parameters (layers) to stages. Layers split
  contiguously over stages with the tensor_split convention; `embed_tokens` sits on the first stage,
  every other non-layer parameter (`model.norm`, `lm_head`) on the last.
- Axes a layout does not name replicate; axes a mesh does not have have size 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable, Mapping, Sequence

from graphrl.errors import PlacementError
from graphrl.schemas.mesh import Mesh, MeshAxis
from graphrl.schemas.model import ModelDims

# A region of a full tensor as half-open (start, stop) pairs, one per tensor dim.
Region = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Replicate:
    """Every rank along the axis holds the same data."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Ranks along the axis hold consecutive pieces of tensor dim `dim` (tensor_split convention)."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


Placement = Replicate | Shard
ParamLayout = Mapping[MeshAxis, Placement]


@dataclass(frozen=True)
class ParamInfo:
    """One named parameter of a model: its full shape and the layer it belongs to."""

    name: str
    shape: tuple[int, ...]
    layer: int | None = None  # None for embeddings, the final norm and the output head
    num_layers: int | None = None  # layers of the whole model; needed to place layer params on pp stages

    @property
    def num_elements(self) -> int:
        return prod(self.shape)


LayoutFn = Callable[[ParamInfo], ParamLayout]


def split_bounds(length: int, num_pieces: int, index: int) -> tuple[int, int]:
    """(start, stop) of piece `index` when `length` is cut into `num_pieces` (torch.tensor_split)."""
    q, r = divmod(length, num_pieces)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def chunk_bounds(length: int, num_pieces: int, index: int) -> tuple[int, int]:
    """(start, stop) of piece `index` when `length` is sharded over `num_pieces` ranks the way DTensor's
    `Shard` and FSDP2 do (torch.chunk: pieces of ceil(length / num_pieces), the last ones shorter or
    empty). Shard regions follow this, so a planned region is exactly what a DTensor rank holds."""
    size = -(-length // num_pieces)
    start = min(index * size, length)
    return start, min(start + size, length)


# Axes sharding the same tensor dim nest in the order torch applies them: `parallelize_module` cuts
# the full tensor over tp first, then `fully_shard` cuts each tp shard over fsdp (a strided shard).
_NESTING = {MeshAxis.TP: 0, MeshAxis.FSDP: 1}


# ---------------------------------------------------------------------------------------------
# Pipeline stages


def pp_stage(param: ParamInfo, num_stages: int) -> int:
    """The pipeline stage that holds `param` whole (see the module docstring for the rule)."""
    if num_stages == 1:
        return 0
    if param.layer is None:
        return 0 if "embed_tokens" in param.name else num_stages - 1
    if param.num_layers is None:
        raise PlacementError(
            f"parameter {param.name} has layer {param.layer} but no num_layers, so its pp stage is unknown",
            fix="build ParamInfo with num_layers (llama_params does)",
        )
    if not 0 <= param.layer < param.num_layers:
        raise PlacementError(f"parameter {param.name}: layer {param.layer} is outside 0..{param.num_layers - 1}")
    q, r = divmod(param.num_layers, num_stages)
    if param.layer < r * (q + 1):
        return param.layer // (q + 1)
    return r + (param.layer - r * (q + 1)) // q


# ---------------------------------------------------------------------------------------------
# Regions


def normalize_layout(
    layout: ParamLayout, mesh: Mesh, shape: Sequence[int], name: str = "?"
) -> tuple[tuple[int, ...], ...]:
    """For each tensor dim, the positions in the mesh of the axes that shard it, outermost cut first
    (tp before fsdp, see `_NESTING`; otherwise mesh order).

    Checks the layout against the tensor: a Shard dim must exist, and pp may not slice a tensor.
    Axes the mesh does not have are ignored (they have size 1).
    """
    per_dim: list[list[int]] = [[] for _ in shape]
    for key, placement in layout.items():
        if key not in MeshAxis.__members__.values():
            raise PlacementError(
                f"parameter {name}: layout names an unknown mesh axis {key!r}",
                fix=f"use axes from {[a.value for a in MeshAxis]}",
            )
        axis = MeshAxis(key)
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard):
            raise PlacementError(f"parameter {name}: placement {placement!r} on {axis.value} is not Replicate or Shard")
        if axis is MeshAxis.PP:
            raise PlacementError(
                f"parameter {name}: pp assigns whole layers to stages and cannot Shard a tensor",
                fix="use Replicate() for pp",
            )
        if not 0 <= placement.dim < len(shape):
            raise PlacementError(
                f"parameter {name} of shape {tuple(shape)}: Shard({placement.dim}) on {axis.value} names no dim"
            )
    for pos, (axis, size) in sorted(enumerate(mesh.axes), key=lambda item: _NESTING.get(item[1][0], 2)):
        placement = layout.get(axis)
        if isinstance(placement, Shard) and size > 1:
            per_dim[placement.dim].append(pos)
    return tuple(tuple(p) for p in per_dim)


def region_of(
    shape: Sequence[int], dim_axes: Sequence[Sequence[int]], sizes: Sequence[int], coords: Sequence[int]
) -> Region:
    """The region a rank with mesh `coords` holds, given `normalize_layout`'s per-dim axis positions."""
    out = []
    for length, positions in zip(shape, dim_axes):
        start = 0
        for pos in positions:
            lo, hi = chunk_bounds(length, sizes[pos], coords[pos])
            start, length = start + lo, hi - lo
        out.append((start, start + length))
    return tuple(out)


def shard_bounds(param: ParamInfo, mesh: Mesh, rank: int, layout: ParamLayout | None = None) -> Region | None:
    """Like `shard_region`, as (start, stop) pairs."""
    layout = llama_layout_on(mesh)(param) if layout is None else layout
    coords = mesh.coord_tuple(rank)
    num_stages = mesh.size(MeshAxis.PP)
    if num_stages > 1:
        pp_pos = mesh.axis_position(MeshAxis.PP)
        assert pp_pos is not None
        if coords[pp_pos] != pp_stage(param, num_stages):
            return None
    dim_axes = normalize_layout(layout, mesh, param.shape, param.name)
    return region_of(param.shape, dim_axes, [s for _, s in mesh.axes], coords)


def shard_region(
    param: ParamInfo, mesh: Mesh, rank: int, layout: ParamLayout | None = None
) -> tuple[slice, ...] | None:
    """The region of the full tensor `rank` holds under `layout` (default: `llama_layout_on(mesh)`).

    None when the rank holds nothing of it (the parameter lives on another pp stage). A region may
    be empty (a dim split into more pieces than it has elements).
    """
    bounds = shard_bounds(param, mesh, rank, layout)
    return None if bounds is None else to_slices(bounds)


def to_slices(region: Region) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in region)


def region_size(region: Region) -> int:
    return prod(b - a for a, b in region)


def local_slices(region: Region, within: Region) -> tuple[slice, ...]:
    """`region` (full-tensor coordinates) as slices into the buffer that holds `within`."""
    assert all(wa <= a and b <= wb for (a, b), (wa, wb) in zip(region, within)), (region, within)
    return tuple(slice(a - wa, b - wa) for (a, b), (wa, _) in zip(region, within))


# ---------------------------------------------------------------------------------------------
# Llama


_COLUMN_PARALLEL = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
_ROW_PARALLEL = {"o_proj", "down_proj"}
_VOCAB_PARALLEL = {"embed_tokens", "lm_head"}
_NORMS = {"input_layernorm", "post_attention_layernorm", "norm"}


def llama_param_layout(param: ParamInfo, *, tp_sharded: bool = True, fsdp_dim: int = 0) -> dict[MeshAxis, Placement]:
    """Megatron tensor parallel + FSDP2 for Hugging Face Llama parameter names.

    tp: q/k/v/gate/up column parallel (Shard(0)); o/down row parallel (Shard(1), a bias replicates);
    embed_tokens and lm_head vocab parallel (Shard(0)); norms replicate. `tp_sharded=False`
    replicates everything over tp. fsdp shards dim `fsdp_dim` (FSDP2; `llama_layout_on` picks it per
    parameter by `fsdp_shard_dim`, 0 for all but row-parallel weights); dp and pp replicate.
    """
    module, kind = _module_and_kind(param.name)
    tp: Placement
    if module in _COLUMN_PARALLEL or module in _VOCAB_PARALLEL:
        tp = Shard(0)
    elif module in _ROW_PARALLEL:
        tp = Shard(1) if kind == "weight" else Replicate()
    elif module in _NORMS:
        tp = Replicate()
    else:
        raise PlacementError(
            f"parameter {param.name} is not a Llama parameter, so its tensor-parallel layout is unknown",
            fix="give a layout function for this model",
        )
    if not tp_sharded:
        tp = Replicate()
    return {MeshAxis.DP: Replicate(), MeshAxis.FSDP: Shard(fsdp_dim), MeshAxis.TP: tp, MeshAxis.PP: Replicate()}


def _module_and_kind(name: str) -> tuple[str, str]:
    parts = name.split(".")
    return (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[-1])


def fsdp_shard_dim(name: str, shape: Sequence[int], fsdp: int, tp: int) -> int:
    """The dim FSDP cuts parameter `name` along, on a copy sharded `fsdp` ways with `tp`-way tensor parallel.

    A row-parallel weight (o_proj, down_proj) is cut along its input dim (1) when the copy has no tp and
    that dim splits evenly: each fsdp rank then holds whole column blocks, the shards a tensor-parallel
    generator's rank holds, so a weight sync into tp shards sends (or, on shared ranks, copies)
    contiguous blocks where row shards would make every sender gather strided columns first.
    Everything else, and every uneven split (FSDP2 takes dim > 0 only when even), is cut along dim 0.
    With tp, the tp axis already cuts dim 1 and fsdp nests on dim 0, as torch's 2-D FSDP does.
    """
    module, kind = _module_and_kind(name)
    row_weight = module in _ROW_PARALLEL and kind == "weight" and len(shape) == 2
    return 1 if row_weight and tp == 1 and fsdp > 1 and shape[1] % fsdp == 0 else 0


def llama_layout_on(mesh: Mesh) -> LayoutFn:
    """`llama_param_layout` for a model copy on `mesh`, fsdp cutting each parameter along
    `fsdp_shard_dim` (what `executors/parallel.py` tells `fully_shard`)."""
    fsdp, tp = mesh.size(MeshAxis.FSDP), mesh.size(MeshAxis.TP)

    def layout(param: ParamInfo) -> ParamLayout:
        return llama_param_layout(param, fsdp_dim=fsdp_shard_dim(param.name, param.shape, fsdp, tp))

    return layout


def llama_params(dims: ModelDims) -> list[ParamInfo]:
    """Every parameter of a Hugging Face Llama model, in checkpoint order."""
    h, i, v = dims.hidden_size, dims.intermediate_size, dims.vocab_size
    q_rows, kv_rows = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    n = dims.num_layers
    params = [ParamInfo("model.embed_tokens.weight", (v, h), None, n)]
    for layer in range(n):
        pre = f"model.layers.{layer}."
        for name, shape in (
            ("self_attn.q_proj.weight", (q_rows, h)),
            ("self_attn.k_proj.weight", (kv_rows, h)),
            ("self_attn.v_proj.weight", (kv_rows, h)),
            ("self_attn.o_proj.weight", (h, q_rows)),
            ("mlp.gate_proj.weight", (i, h)),
            ("mlp.up_proj.weight", (i, h)),
            ("mlp.down_proj.weight", (h, i)),
            ("input_layernorm.weight", (h,)),
            ("post_attention_layernorm.weight", (h,)),
        ):
            params.append(ParamInfo(pre + name, shape, layer, n))
    params.append(ParamInfo("model.norm.weight", (h,), None, n))
    if not dims.tie_embeddings:
        params.append(ParamInfo("lm_head.weight", (v, h), None, n))
    return params

