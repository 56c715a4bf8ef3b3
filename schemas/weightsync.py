"""A DDMA weight sync as the plan stores it: the two meshes, the byte widths, and the transfer rounds.

The planner (`graphrl.ddma`) computes a sync in these slices and buckets; this record is what a plan
file keeps of it and what the executors run (`graphrl.executors.weightsync`). Buckets and slices are
named tuples: typed and checked like every other field, yet written positionally (`[src, dst, bytes,
[[param, region], ...]]`), since an 8B plan holds thousands of them (and the planner ~2 * 10^5 at 405B).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import Field

from graphrl.schemas.base import Frozen
from graphrl.schemas.mesh import Mesh
from graphrl.schemas.sharding import Region


WeightSyncKind = Literal["none", "in_place", "ddma"]
"""How new weights reach a generator: not at all (no generator); resharded in place (colocated: the trainer's
own devices hold both roles); a DDMA copy (disaggregated)."""


class Slice(NamedTuple):
    """One region of one parameter: the same box of the full tensor on the sending and the receiving side."""

    param: str
    """The parameter's name in graphrl's Llama (e.g. 'model.layers.0.self_attn.q_proj.weight')."""
    region: Region
    """The region of the full parameter, (start, stop) per dimension."""


class Bucket(NamedTuple):
    """What one trainer rank sends one generator rank in one round."""

    src: int
    """The sending rank."""
    dst: int
    """The receiving rank."""
    num_bytes: int
    """Bytes on the wire (at the sender's width)."""
    slices: tuple[Slice, ...]
    """The slices it carries, in the order both sides pack them."""


class LocalCopy(NamedTuple):
    """Slices that stay on one rank: its trainer shard holds what its generator shard needs."""

    rank: int
    """The rank that copies shard to shard."""
    num_bytes: int
    """Bytes copied."""
    slices: tuple[Slice, ...]
    """The slices copied."""


class WeightSyncSummary(Frozen):
    """Numbers that describe a sync, for previews, reports and benchmarks."""

    num_rounds: int = Field(ge=0, description="Transfer rounds; in a round no rank sends or receives twice.")
    num_buckets: int = Field(ge=0, description="Buckets over all rounds.")
    num_pairs: int = Field(ge=0, description="Distinct (sender, receiver) rank pairs.")
    num_senders: int = Field(ge=0, description="Trainer ranks that send anything.")
    num_receivers: int = Field(ge=0, description="Generator ranks that receive anything.")
    total_bytes: float = Field(ge=0, description="Bytes on the wire, all buckets.")
    lower_bound_bytes: float = Field(ge=0, description="Bytes the generator must receive from other ranks at least.")
    local_bytes: float = Field(ge=0, description="Bytes copied rank-locally (trainer and generator share a rank).")
    max_bytes_per_src: float = Field(ge=0, description="Most bytes any sender sends.")
    mean_bytes_per_src: float = Field(ge=0, description="Mean bytes per sender.")
    max_bytes_per_dst: float = Field(ge=0, description="Most bytes any receiver receives.")
    mean_bytes_per_dst: float = Field(ge=0, description="Mean bytes per receiver.")
    balance: float = Field(ge=0, description="Max over mean bytes per sender (1 is perfectly balanced).")
    max_bucket_bytes: float = Field(ge=0, description="The largest bucket.")
    bucket_bytes_limit: int = Field(gt=0, description="The planner's bucket size limit.")
    sum_round_max_bytes: float = Field(ge=0, description="Sum over rounds of the largest bucket: a serial-time proxy.")
    is_noop: bool = Field(description="Whether nothing moves (the same layout on the same ranks).")
    src_bytes_per_elem: int = Field(gt=0, description="Bytes per element on the trainer side (the wire width).")
    dst_bytes_per_elem: int = Field(gt=0, description="Bytes per element on the generator side.")


class WeightSyncRecord(Frozen):
    """One trainer -> generator weight copy of a model, as the plan stores and the executors run it."""

    model: str = Field(description="The model whose weights are copied.")
    src: Mesh = Field(description="The trainer's mesh, along its axes (dp, fsdp, tp, pp).")
    dst: Mesh = Field(description="The generator's mesh, along its axes.")
    src_bytes_per_elem: int = Field(gt=0, description="Bytes per element the trainer sends.")
    dst_bytes_per_elem: int = Field(gt=0, description="Bytes per element the generator holds.")
    bucket_bytes: int = Field(gt=0, description="The bucket size limit the rounds were planned with.")
    summary: WeightSyncSummary = Field(description="Numbers that describe the sync.")
    predicted_s: float = Field(ge=0, description="Predicted seconds of one sync.")
    rounds: list[list[Bucket]] | None = Field(
        default=None, description="The transfer rounds; absent for plans too large to store (the summary stays).")
    local: list[LocalCopy] = Field(default_factory=list, description="Rank-local copies.")
    staging_layers: int = Field(
        default=0, ge=0, description="Layers per staging group of an fp8 generator (`graphrl.schemas.sharding."
        "staging_layers`): the sync runs group by group, every parameter of a group whole before the next "
        "group's first round, so a rank stages and quantizes one group at a time. 0: one group.")
    group_rounds: list[int] = Field(
        default_factory=list, description="Rounds of each staging group, in order; empty for one group.")
