"""A model's parameters and how they are sharded, as data: one torch-free description below the compiler
and the executors.

- **The inventory and the tensor-parallel plan** (`LLAMA_LAYER`, `LLAMA_EMBEDDING`, `LLAMA_FINAL_NORM`,
  `LLAMA_HEADS`): every module of a Llama model with its weight's shape as a function of the dims and
  its tensor-parallel style (colwise, rowwise, vocabulary-parallel, replicated). The compiler's parameter
  counts and layouts, the DDMA planner's parameter list, the executors' `parallelize_module` plan and the
  tensor-parallel generator's shards are all generated from it.
- **Layouts**: a model copy lives on a `Mesh` (`graphrl.schemas.mesh`): global ranks laid out row-major
  over named axes (`dp`, `fsdp`, `tp`, `pp`). How one parameter spreads over it is a `ParamLayout`: per
  axis `Replicate()` or `Shard(dim)`. Resharding and weight sync read these as data, so a new
  parallelism is a new layout function, not new transfer code.

Conventions, used everywhere in graphrl:

- One split rule, DTensor's and FSDP2's (`chunk_bounds`, as torch.chunk): a length L cut into k pieces
  gives pieces of ceil(L / k), the last ones shorter or empty (L=10, k=4 -> 3, 3, 3, 1).
- Several axes sharding the same tensor dim nest as torch applies them: tp cuts the full tensor first
  (`parallelize_module`), then fsdp cuts each tp shard again (`fully_shard`).
- `pp` never slices a tensor: it assigns whole parameters (layers) to stages. Layers split
  contiguously over stages (the first L % k stages take one more); `embed_tokens` sits on the first
  stage, every other non-layer parameter (`model.norm`, `lm_head`) on the last.
- Axes a layout does not name replicate; axes a mesh does not have have size 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
import functools
import math
from math import prod
from typing import Callable, Literal, Mapping, Sequence

from graphrl.schemas.mesh import LayoutError, Mesh, MeshAxis
from graphrl.schemas.model import LoraSpec, ModelDims

# A region of a full tensor as half-open (start, stop) pairs, one per tensor dim.
Region = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Replicate:
    """Every rank along the axis holds the same data."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Ranks along the axis hold consecutive pieces of tensor dim `dim` (`chunk_bounds`)."""

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
        raise LayoutError(
            f"parameter {param.name} has layer {param.layer} but no num_layers, so its pp stage is unknown",
            fix="build ParamInfo with num_layers (llama_params does)",
        )
    if not 0 <= param.layer < param.num_layers:
        raise LayoutError(f"parameter {param.name}: layer {param.layer} is outside 0..{param.num_layers - 1}")
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
            raise LayoutError(
                f"parameter {name}: layout names an unknown mesh axis {key!r}",
                fix=f"use axes from {[a.value for a in MeshAxis]}",
            )
        axis = MeshAxis(key)
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard):
            raise LayoutError(f"parameter {name}: placement {placement!r} on {axis.value} is not Replicate or Shard")
        if axis is MeshAxis.PP:
            raise LayoutError(
                f"parameter {name}: pp assigns whole layers to stages and cannot Shard a tensor",
                fix="use Replicate() for pp",
            )
        if not 0 <= placement.dim < len(shape):
            raise LayoutError(
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
# Llama: the parameter inventory and the tensor-parallel plan, as data


class TpStyle(StrEnum):
    """How the tensor-parallel axis cuts one module's weight (Megatron-style tensor parallelism)."""

    COLWISE = "colwise"
    """Output features split (weight Shard(0)): q/k/v, gate/up. Each rank computes its slice of the output."""
    ROWWISE = "rowwise"
    """Input features split (weight Shard(1), a bias replicates): o, down. Partial outputs are summed."""
    VOCAB = "vocab"
    """Vocabulary rows split (Shard(0)): the embedding and the output head."""
    REPLICATE = "replicate"
    """Every tp rank holds the whole tensor: the norms, a critic's value head, a router."""
    EXPERT = "expert"
    """Experts stacked on dim 0 ([experts, rows, cols]): a tensor-parallel generator's ranks each hold whole
    experts (expert parallelism over the tp group, ep = tp); each computes its experts' share of every
    token and the group's all-reduce sums the shares, as a row-parallel layer's partial sums."""


def _always(dims: ModelDims) -> bool:
    return True


def _never(dims: ModelDims) -> bool:
    return False


def _has_qkv_bias(dims: ModelDims) -> bool:
    return bool(dims.qkv_bias)


def _has_qk_norm(dims: ModelDims) -> bool:
    return bool(dims.qk_norm)


def _is_dense(dims: ModelDims) -> bool:
    return not dims.is_moe


def _is_moe(dims: ModelDims) -> bool:
    return dims.is_moe


def _has_shared_expert(dims: ModelDims) -> bool:
    return dims.shared_expert_intermediate_size > 0


@dataclass(frozen=True)
class ModuleSpec:
    """One module of the decoder: its weight's shape as a function of the dims, its tp style, and whether
    the dims give it (a family's per-head norms) and a bias (over its output features, cut as its rows)."""

    name: str
    """Module path relative to a decoder layer (`self_attn.q_proj`), or from the model's root."""
    shape: Callable[[ModelDims], tuple[int, ...]]
    tp: TpStyle
    present: Callable[[ModelDims], bool] = _always
    bias: Callable[[ModelDims], bool] = _never
    bare: bool = False
    """The name is the parameter's own (stacked experts: `mlp.experts.gate_proj`), not a module's `.weight`."""

    def params(self, dims: ModelDims) -> list[tuple[str, tuple[int, ...]]]:
        """(kind, shape) of the module's parameters: its weight, then its bias if it has one; kind "" for a
        bare parameter."""
        shape = self.shape(dims)
        if self.bare:
            return [("", shape)]
        return [("weight", shape), ("bias", shape[:1])] if self.bias(dims) else [("weight", shape)]

    def param_name(self, module_name: str, kind: str) -> str:
        return f"{module_name}.{kind}" if kind else module_name


# The modules of one decoder layer, in checkpoint order (Hugging Face's: q/k/v/o, then a Qwen3's q/k
# norms, the MLP, the two layer norms).
LLAMA_LAYER: tuple[ModuleSpec, ...] = (
    ModuleSpec("self_attn.q_proj", lambda d: (d.q_width, d.hidden_size), TpStyle.COLWISE, bias=_has_qkv_bias),
    ModuleSpec("self_attn.k_proj", lambda d: (d.kv_width, d.hidden_size), TpStyle.COLWISE, bias=_has_qkv_bias),
    ModuleSpec("self_attn.v_proj", lambda d: (d.kv_width, d.hidden_size), TpStyle.COLWISE, bias=_has_qkv_bias),
    ModuleSpec("self_attn.o_proj", lambda d: (d.hidden_size, d.q_width), TpStyle.ROWWISE),
    # One head's norm, applied to every head: a tp rank holds it whole for its own heads.
    ModuleSpec("self_attn.q_norm", lambda d: (d.head_dim,), TpStyle.REPLICATE, present=_has_qk_norm),
    ModuleSpec("self_attn.k_norm", lambda d: (d.head_dim,), TpStyle.REPLICATE, present=_has_qk_norm),
    ModuleSpec("mlp.gate_proj", lambda d: (d.intermediate_size, d.hidden_size), TpStyle.COLWISE, present=_is_dense),
    ModuleSpec("mlp.up_proj", lambda d: (d.intermediate_size, d.hidden_size), TpStyle.COLWISE, present=_is_dense),
    ModuleSpec("mlp.down_proj", lambda d: (d.hidden_size, d.intermediate_size), TpStyle.ROWWISE, present=_is_dense),
    # A mixture of experts instead (Qwen2-MoE, Qwen3-MoE): the router, the experts stacked, a shared expert.
    ModuleSpec("mlp.gate", lambda d: (d.num_experts, d.hidden_size), TpStyle.REPLICATE, present=_is_moe),
    ModuleSpec("mlp.experts.gate_proj", lambda d: (d.num_experts, d.expert_intermediate_size, d.hidden_size),
               TpStyle.EXPERT, present=_is_moe, bare=True),
    ModuleSpec("mlp.experts.up_proj", lambda d: (d.num_experts, d.expert_intermediate_size, d.hidden_size),
               TpStyle.EXPERT, present=_is_moe, bare=True),
    ModuleSpec("mlp.experts.down_proj", lambda d: (d.num_experts, d.hidden_size, d.expert_intermediate_size),
               TpStyle.EXPERT, present=_is_moe, bare=True),
    ModuleSpec("mlp.shared_expert.gate_proj", lambda d: (d.shared_expert_intermediate_size, d.hidden_size),
               TpStyle.COLWISE, present=_has_shared_expert),
    ModuleSpec("mlp.shared_expert.up_proj", lambda d: (d.shared_expert_intermediate_size, d.hidden_size),
               TpStyle.COLWISE, present=_has_shared_expert),
    ModuleSpec("mlp.shared_expert.down_proj", lambda d: (d.hidden_size, d.shared_expert_intermediate_size),
               TpStyle.ROWWISE, present=_has_shared_expert),
    ModuleSpec("mlp.shared_expert_gate", lambda d: (1, d.hidden_size), TpStyle.REPLICATE, present=_has_shared_expert),
    ModuleSpec("input_layernorm", lambda d: (d.hidden_size,), TpStyle.REPLICATE),
    ModuleSpec("post_attention_layernorm", lambda d: (d.hidden_size,), TpStyle.REPLICATE),
)
# The modules outside the layers: before them, and after them by head kind (a tied lm head has none).
LLAMA_EMBEDDING = ModuleSpec("model.embed_tokens", lambda d: (d.vocab_size, d.hidden_size), TpStyle.VOCAB)
LLAMA_FINAL_NORM = ModuleSpec("model.norm", lambda d: (d.hidden_size,), TpStyle.REPLICATE)
LLAMA_HEADS: dict[str, ModuleSpec] = {
    "lm": ModuleSpec("lm_head", lambda d: (d.vocab_size, d.hidden_size), TpStyle.VOCAB),
    "value": ModuleSpec("value_head", lambda d: (1, d.hidden_size), TpStyle.REPLICATE),
}
Head = Literal["lm", "value"]

# By the module that holds a parameter (a stacked expert tensor's is `experts`).
_TP_STYLE: dict[str, TpStyle] = {(m.name.split(".")[-2] if m.bare else m.name.split(".")[-1]): m.tp
                                 for m in (*LLAMA_LAYER, LLAMA_EMBEDDING, LLAMA_FINAL_NORM, *LLAMA_HEADS.values())}


@functools.cache
def layer_modules(dims: ModelDims) -> tuple[ModuleSpec, ...]:
    """The modules a decoder layer of these dims has (a Qwen3's q/k norms only where the family has them)."""
    return tuple(m for m in LLAMA_LAYER if m.present(dims))


def _head(dims: ModelDims, head: Head) -> list[ModuleSpec]:
    """The output head's module, if it has its own weight (a tied lm head reads the embedding)."""
    return [LLAMA_HEADS[head]] if head == "value" or not dims.tie_embeddings else []


def llama_modules(dims: ModelDims, head: Head = "lm") -> list[tuple[str, ModuleSpec, int | None]]:
    """(full module name, spec, layer) of every parameterised module of the model, in checkpoint order."""
    out: list[tuple[str, ModuleSpec, int | None]] = [(LLAMA_EMBEDDING.name, LLAMA_EMBEDDING, None)]
    for layer in range(dims.num_layers):
        out += [(f"model.layers.{layer}.{m.name}", m, layer) for m in layer_modules(dims)]
    out += [(m.name, m, None) for m in (LLAMA_FINAL_NORM, *_head(dims, head))]
    return out


def llama_params(dims: ModelDims, head: Head = "lm") -> list[ParamInfo]:
    """Every parameter of the Hugging Face model of these dims (`head="value"`: graphrl's critic), in
    checkpoint order: each module's weight, then its bias if the family gives it one."""
    return [ParamInfo(spec.param_name(name, kind), shape, layer, dims.num_layers)
            for name, spec, layer in llama_modules(dims, head) for kind, shape in spec.params(dims)]


# The counts are cached: the placement search asks for them thousands of times per model, and a
# `ModelDims` is frozen, so the same dims always have the same counts.
@functools.cache
def llama_layer_param_count(dims: ModelDims, *, matmuls_only: bool = False, active: bool = False) -> int:
    """Parameters of one decoder layer (with `matmuls_only`, the weights of its linear layers alone, the
    stacked experts' among them). With `active`, the experts a token is routed to only (top-k of them):
    the weights one token's forward multiplies by."""
    total = 0
    for m in layer_modules(dims):
        for _, shape in m.params(dims):
            if matmuls_only and len(shape) < 2:
                continue
            size = prod(shape)
            if m.tp is TpStyle.EXPERT and active:
                size = size // dims.num_experts * dims.experts_per_token
            total += size
    return total


@functools.cache
def layer_tensor_count(dims: ModelDims) -> int:
    """Parameter tensors of one decoder layer (weights and biases)."""
    return sum(len(m.params(dims)) for m in layer_modules(dims))


@functools.cache
def llama_param_count(dims: ModelDims, head: Head = "lm") -> int:
    """Number of distinct parameters (a tied head counts once), without listing every layer's."""
    outer = (LLAMA_EMBEDDING, LLAMA_FINAL_NORM, *_head(dims, head))
    return dims.num_layers * llama_layer_param_count(dims) + sum(prod(m.shape(dims)) for m in outer)


# LoRA adapters (`LoraSpec`): a targeted projection `<module>` gains `<module>.lora_A.weight` [rank, in] and
# `<module>.lora_B.weight` [out, rank] (the names the PEFT library saves), cut by tp so that each rank's
# adapter acts on what its base shard sees: a column-parallel base keeps A whole and cuts B's rows; a
# row-parallel one cuts A's columns (its input) and keeps B whole, and its partial products are summed by
# the base's own all-reduce.
LORA_A, LORA_B = "lora_A", "lora_B"
_LORA_SPLIT: dict[tuple[TpStyle, str], int | None] = {
    (TpStyle.COLWISE, LORA_A): None, (TpStyle.COLWISE, LORA_B): 0,
    (TpStyle.ROWWISE, LORA_A): 1, (TpStyle.ROWWISE, LORA_B): None,
}


@functools.cache
def lora_modules(dims: ModelDims, lora: LoraSpec) -> tuple[tuple[str, int, int, int], ...]:
    """(full module name, layer, in features, out features) of every projection that gets an adapter."""
    out = []
    for name, spec, layer in llama_modules(dims):
        last = name.split(".")[-1]
        if spec.bare or layer is None or not lora.wraps(last):
            continue
        rows, cols = spec.shape(dims)
        out.append((name, layer, cols, rows))
    return tuple(out)


def lora_params(dims: ModelDims, lora: LoraSpec) -> list[ParamInfo]:
    """The adapters' parameters in checkpoint order: per targeted projection, A then B."""
    return [p for name, layer, cols, rows in lora_modules(dims, lora)
            for p in (ParamInfo(f"{name}.{LORA_A}.weight", (lora.rank, cols), layer, dims.num_layers),
                      ParamInfo(f"{name}.{LORA_B}.weight", (rows, lora.rank), layer, dims.num_layers))]


@functools.cache
def lora_param_count(dims: ModelDims, lora: LoraSpec, tp: int = 1) -> int:
    """Parameters of all adapters: rank * (in + out) per targeted projection; with `tp`, those one rank of a
    tensor-parallel group holds (A or B whole, the other cut, as `tp_split_dim` says; the largest piece)."""
    total = 0
    for name, _, cols, rows in lora_modules(dims, lora):
        for part, size in ((LORA_A, cols), (LORA_B, rows)):
            cut = tp_split_dim(f"{name}.{part}.weight") is not None and tp > 1
            total += lora.rank * (-(-size // tp) if cut else size)
    return total


def is_adapter(name: str) -> bool:
    """Whether a HF-named parameter is a LoRA adapter's (`...q_proj.lora_A.weight`)."""
    parts = name.split(".")
    return len(parts) >= 3 and parts[-2] in (LORA_A, LORA_B)


def tp_style(name: str) -> TpStyle:
    """The tensor-parallel style of a HF-named Llama parameter (`model.layers.3.mlp.up_proj.weight`)."""
    module, _ = _module_and_kind(name)
    style = _TP_STYLE.get(module)
    if style is None:
        raise LayoutError(
            f"parameter {name} is not a Llama parameter, so its tensor-parallel layout is unknown",
            fix="give a layout function for this model",
        )
    return style


def tp_split_dim(name: str) -> int | None:
    """The tensor dim the tp axis cuts of a HF-named Llama parameter; None when it is replicated."""
    if is_adapter(name):
        parts = name.split(".")
        return _LORA_SPLIT.get((tp_style(".".join(parts[:-2]) + ".weight"), parts[-2]))
    style = tp_style(name)
    _, kind = _module_and_kind(name)
    if style in (TpStyle.COLWISE, TpStyle.VOCAB, TpStyle.EXPERT):
        return 0
    if style is TpStyle.ROWWISE and kind == "weight":
        return 1
    return None


def tp_region(name: str, shape: Sequence[int], tp_rank: int, tp_size: int) -> Region:
    """The region of the full tensor `name` that rank `tp_rank` of a tp group holds."""
    region = [(0, n) for n in shape]
    dim = tp_split_dim(name)
    if dim is not None:
        region[dim] = chunk_bounds(shape[dim], tp_size, tp_rank)
    return tuple(region)


def tp_split_problem(dims: ModelDims, tp: int, kind: str = "generate") -> str | None:
    """Why `tp` tensor-parallel shards cannot split this model evenly for a role of `kind`, or None when
    they can: the query heads and the feed-forward width divide by tp; the KV heads divide by tp, or,
    for generation only (fewer KV heads than shards), tp divides by them and each KV head is replicated
    on tp / num_kv_heads shards. A trainer's shards are DTensors of one layout, which never replicate."""
    if dims.num_heads % tp:
        return f"tp {tp} does not divide the {dims.num_heads} attention heads"
    if kind == "train" and dims.num_kv_heads % tp:
        return f"tp {tp} does not divide the {dims.num_kv_heads} KV heads (a trainer does not replicate KV heads)"
    if dims.num_kv_heads % tp and tp % dims.num_kv_heads:
        return (f"tp {tp} neither divides the {dims.num_kv_heads} KV heads nor is a multiple of them "
                "(to replicate each KV head)")
    if dims.is_moe:
        if kind == "train" and tp > 1:
            return ("a mixture-of-experts trainer shards its experts with fsdp, not tp (tp > 1 is offered to its "
                    "generator, whose tp group shares the experts out: ep = tp)")
        if dims.num_experts % tp:
            return f"tp {tp} (= ep, the experts' share-out) does not divide the {dims.num_experts} experts"
        if dims.shared_expert_intermediate_size % tp:
            return f"tp {tp} does not divide the shared expert's width {dims.shared_expert_intermediate_size}"
        return None
    if dims.intermediate_size % tp:
        return f"tp {tp} does not divide the feed-forward width {dims.intermediate_size}"
    return None


def llama_param_layout(param: ParamInfo, *, tp_sharded: bool = True, fsdp_dim: int = 0) -> dict[MeshAxis, Placement]:
    """A Llama parameter's placement per mesh axis: tp as `tp_split_dim` says (replicated with
    `tp_sharded=False`); fsdp shards dim `fsdp_dim` (FSDP2; `llama_layout_on` picks it per parameter by
    `fsdp_shard_dim`, 0 for all but row-parallel weights); dp and pp replicate."""
    dim = tp_split_dim(param.name)
    tp: Placement = Shard(dim) if dim is not None and tp_sharded else Replicate()
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
    row_weight = _TP_STYLE.get(module) is TpStyle.ROWWISE and kind == "weight" and len(shape) == 2
    return 1 if row_weight and tp == 1 and fsdp > 1 and shape[1] % fsdp == 0 else 0


# Each FSDP2 unit is gathered by one collective and reduced by another, and a collective of a few
# megabytes costs its latency, not its bytes: consecutive decoder layers share a unit until it holds this
# many bytes, the size of DDP's gradient buckets (torch's default `bucket_cap_mb=25`).
FSDP_UNIT_BYTES = 25 * 2**20


def fsdp_layer_units(num_layers: int, layer_bytes: float) -> list[range]:
    """The decoder layers of each FSDP2 unit (of one pipeline stage's `num_layers`, `layer_bytes` each on
    one rank before sharding): consecutive, each the fewest layers that reach `FSDP_UNIT_BYTES` (a layer at
    least that large is a unit of its own, the last unit may be smaller). Empty when every layer fits in
    one unit: a trained model is then a single unit with its embedding and head (its root). A frozen
    model's layers stay units of their own whatever their size (each is an FSDP2 root).
    The compiler's memory and collectives and the executors' `fully_shard` calls both read this."""
    per_unit = max(1, math.ceil(FSDP_UNIT_BYTES / layer_bytes)) if layer_bytes > 0 else num_layers
    if per_unit >= num_layers:
        return []
    return [range(start, min(start + per_unit, num_layers)) for start in range(0, num_layers, per_unit)]


# An fp8 generator receives its block linears at the wire's dtype and quantizes each once it has
# arrived whole (`executors/fp8.py`). A weight sync into it runs in staging groups of consecutive layers,
# one after the other, so that a rank stages one group's linears at a time, not the whole model's. A group
# holds the most layers whose linears stay within `STAGING_GROUP_BYTES` per device at the wire's two bytes
# per weight, and there are at most `MAX_STAGING_GROUPS` groups: every (trainer, generator) pair of ranks
# that exchanges bytes exchanges a bucket per group, so at 405B scale (~55,000 pairs) more groups would
# multiply the buckets the planner colours into rounds and the compile time with them.
STAGING_GROUP_BYTES = 2 * 2**30
MAX_STAGING_GROUPS = 4


def staging_layers(dims: ModelDims, tp: int) -> int:
    """Layers per staging group of a weight sync into an fp8 generator with `tp` shards per layer: the
    compiler's staging charge and the DDMA planner's group order both read it."""
    layer_bytes = llama_layer_param_count(dims, matmuls_only=True) / tp * 2
    by_bytes = int(STAGING_GROUP_BYTES // layer_bytes) if layer_bytes > 0 else dims.num_layers
    return max(1, min(dims.num_layers, max(by_bytes, math.ceil(dims.num_layers / MAX_STAGING_GROUPS))))


def param_layer(name: str) -> int | None:
    """The decoder layer of a HF-named Llama parameter (`model.layers.3.mlp.up_proj.weight` -> 3); None for
    the embedding, the final norm and the heads."""
    parts = name.split(".", 3)
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] else None


def staging_group(name: str, layers_per_group: int) -> int:
    """The staging group a parameter is synced in: its layer's, counted from 0 in runs of
    `layers_per_group`. The embedding, final norm and heads (never staged) go with the first group."""
    layer = param_layer(name)
    return 0 if layer is None else layer // layers_per_group


def llama_layout_on(mesh: Mesh) -> LayoutFn:
    """`llama_param_layout` for a model copy on `mesh`, fsdp cutting each parameter along
    `fsdp_shard_dim` (what `executors/parallel.py` tells `fully_shard`)."""
    fsdp, tp = mesh.size(MeshAxis.FSDP), mesh.size(MeshAxis.TP)

    def layout(param: ParamInfo) -> ParamLayout:
        return llama_param_layout(param, fsdp_dim=fsdp_shard_dim(param.name, param.shape, fsdp, tp))

    return layout
