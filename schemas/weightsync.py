"""A DDMA weight sync as the plan stores it: the two meshes, the byte widths, and every transfer round.

The planner (`graphrl.compiler.ddma`) computes a sync in these slices and buckets; the record is what a plan
file keeps of it and what the executors run (`graphrl.executors.weightsync`), whatever its size: ranks never
plan. A 405B sync has ~190,000 buckets but only a few thousand distinct contents (the generator's replicas
receive the same slices), so the record stores them in tables referenced by index, written positionally as
named tuples: the parameter names and regions once each; each distinct content once, as runs of consecutive
parameters that share a region; each round as three columns (senders, receivers, contents), a column stored
once however many rounds repeat it. `buckets`, `round_buckets` and `local_copies` read them back as the
planner's buckets.
"""

from __future__ import annotations

from typing import Iterator, Literal, NamedTuple

from pydantic import Field, model_validator

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


class SliceRun(NamedTuple):
    """Slices of consecutive parameters of a record's table that share one region."""

    param: int
    """The first parameter: its index in `WeightSyncRecord.params`."""
    count: int
    """How many parameters of the table, from `param` on."""
    region: int
    """The region of each: its index in `WeightSyncRecord.regions`."""


class Contents(NamedTuple):
    """What one bucket or local copy carries: its slices in packing order, as runs."""

    num_bytes: int
    """Bytes (at the sender's width)."""
    runs: tuple[SliceRun, ...]
    """The slices, run by run."""


class Round(NamedTuple):
    """One transfer round as three columns of `WeightSyncRecord.columns`, one entry per bucket: bucket i goes
    from rank `columns[src][i]` to rank `columns[dst][i]` and carries `contents[columns[contents][i]]`."""

    src: int
    """The column of senders."""
    dst: int
    """The column of receivers."""
    contents: int
    """The column of contents (indices into `WeightSyncRecord.contents`)."""


class LocalCopyRef(NamedTuple):
    """A rank-local copy: what `rank` copies from its own trainer shard to its own generator shard."""

    rank: int
    """The rank that copies shard to shard."""
    contents: int
    """The slices copied (an index into `WeightSyncRecord.contents`)."""


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
    params: list[str] = Field(default_factory=list, description="The parameter names the contents refer to, "
                              "in the planner's order (a run takes consecutive ones).")
    regions: list[Region] = Field(default_factory=list, description="The distinct regions the contents refer to.")
    contents: list[Contents] = Field(default_factory=list, description="The distinct contents of buckets and "
                                     "local copies.")
    columns: list[tuple[int, ...]] = Field(default_factory=list, description="The distinct columns of the rounds.")
    rounds: list[Round] = Field(default_factory=list, description="The transfer rounds, in order.")
    local: list[LocalCopyRef] = Field(default_factory=list, description="Rank-local copies.")
    staging_layers: int = Field(
        default=0, ge=0, description="Layers per staging group of an fp8 generator (`graphrl.schemas.sharding."
        "staging_layers`): the sync runs group by group, every parameter of a group whole before the next "
        "group's first round, so a rank stages and quantizes one group at a time. 0: one group.")
    group_rounds: list[int] = Field(
        default_factory=list, description="Rounds of each staging group, in order; empty for one group.")

    @model_validator(mode="after")
    def _references_hold(self) -> "WeightSyncRecord":
        """Every index names an entry of its table, and a round's three columns are equally long."""
        def within(indices: list[int], table: list, what: str) -> None:
            if indices and not 0 <= min(indices) <= max(indices) < len(table):
                raise ValueError(f"an index into {what} is outside its {len(table)} entries")

        for run_ in (run for c in self.contents for run in c.runs):
            if run_.count < 1 or not 0 <= run_.param <= run_.param + run_.count <= len(self.params):
                raise ValueError(f"a run of {run_.count} parameters from {run_.param} is outside the "
                                 f"{len(self.params)} parameters")
        within([run.region for c in self.contents for run in c.runs], self.regions, "regions")
        within([i for r in self.rounds for i in r], self.columns, "columns")
        within([c.contents for c in self.local], self.contents, "contents")
        for r in self.rounds:
            if not len(self.columns[r.src]) == len(self.columns[r.dst]) == len(self.columns[r.contents]):
                raise ValueError("a round's columns differ in length")
        within(list({i for r in self.rounds for i in self.columns[r.contents]}), self.contents, "contents")
        return self

    def slices(self, contents: int) -> tuple[Slice, ...]:
        """The slices of `contents[contents]`, in packing order."""
        params, regions = self.params, self.regions
        return tuple(Slice(params[run.param + i], regions[run.region])
                     for run in self.contents[contents].runs for i in range(run.count))

    def round_buckets(self, k: int, rank: int | None = None) -> list[Bucket]:
        """Round `k`'s buckets in order; with `rank`, only those it sends or receives (at most one of each)."""
        r = self.rounds[k]
        src, dst, contents = self.columns[r.src], self.columns[r.dst], self.columns[r.contents]
        if rank is None:
            at: list[int] = list(range(len(src)))
        else:  # no rank sends or receives twice in a round: at most one of each
            at = sorted({i for column in (src, dst) if rank in column for i in (column.index(rank),)})
        return [Bucket(src[i], dst[i], self.contents[contents[i]].num_bytes, self.slices(contents[i])) for i in at]

    def buckets(self) -> Iterator[Bucket]:
        """Every bucket, round by round."""
        for k in range(len(self.rounds)):
            yield from self.round_buckets(k)

    def local_copies(self, rank: int | None = None) -> list[LocalCopy]:
        """The rank-local copies (with `rank`, its own)."""
        return [LocalCopy(c.rank, self.contents[c.contents].num_bytes, self.slices(c.contents))
                for c in self.local if rank is None or c.rank == rank]
