"""The device mesh: global ranks laid out row-major over ordered, named axes. One type for every stage.

Placement builds a `Mesh` per layout and per role; the schedule splits data over its `dp`/`fsdp` axes
and gives each generator replica its `tp` group; the DDMA planner reads rank coordinates from it;
the plan stores it, and the executors find their groups in it. The last axis varies fastest, so with
axes `(dp, fsdp, tp, pp)` the ranks of one tensor-parallel group are consecutive.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import StrEnum
from math import prod
from typing import Any

from pydantic import Field, PrivateAttr, field_serializer, field_validator, model_validator

from graphrl.schemas.base import Frozen


class LayoutError(ValueError):
    """A rank, axis or layout a mesh or the sharding description cannot place (a rank outside the mesh, a
    Shard of a dim the tensor lacks). Raised by the schemas' own functions; the compiler reports it as a
    `PlacementError` (`graphrl.compiler.passes.run_passes`), in the same words."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix


class MeshAxis(StrEnum):
    """Named parallelism axes of a device mesh."""

    DP = "dp"  # data parallel: full replicas
    FSDP = "fsdp"  # fully sharded data parallel (ZeRO-3 / FSDP2): params sharded on dim 0
    TP = "tp"  # tensor parallel (Megatron column / row / vocab parallel)
    PP = "pp"  # pipeline parallel: whole layers per stage


DATA_AXES = (MeshAxis.DP, MeshAxis.FSDP)
"""The axes over which a step's responses are split (each index along them is one data shard)."""


class Mesh(Frozen):
    """Global ranks (`devices`, in mesh order) over named axes (row-major, the last fastest)."""

    name: str = Field(default="", description="Mesh name, e.g. 'trainer' or 'generator' ('' for a role's view).")
    devices: tuple[int, ...] = Field(description="Global ranks in mesh order.")
    axes: tuple[tuple[MeshAxis, int], ...] = Field(
        description="Named axis sizes in order; their product is the number of devices. Written as a map.")
    _index: dict[int, int] = PrivateAttr(default_factory=dict)
    _coords: tuple[tuple[int, ...], ...] = PrivateAttr(default=())
    _data_groups: tuple[tuple[int, ...], ...] = PrivateAttr(default=())

    @field_validator("axes", mode="before")
    @classmethod
    def _axes_from_map(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return tuple(value.items())
        return value

    @field_serializer("axes")
    def _axes_as_map(self, axes: tuple[tuple[MeshAxis, int], ...]) -> dict[str, int]:
        return {a.value: s for a, s in axes}

    @model_validator(mode="after")
    def _consistent(self) -> "Mesh":
        names = [a for a, _ in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axes {[a.value for a in names]} name an axis twice")
        if any(s < 1 for _, s in self.axes):
            raise ValueError(f"mesh axis sizes {self.axis_sizes()} must all be >= 1")
        if not self.devices or len(set(self.devices)) != len(self.devices) or min(self.devices) < 0:
            raise ValueError(f"mesh devices {self.devices} must be distinct ranks >= 0, at least one")
        if prod(s for _, s in self.axes) != len(self.devices):
            raise ValueError(f"mesh axes {self.axis_sizes()} hold {prod(s for _, s in self.axes)} ranks, "
                             f"but {len(self.devices)} devices were given")
        return self

    def model_post_init(self, context: Any) -> None:
        sizes = [s for _, s in self.axes]
        coords = []
        for flat in range(len(self.devices)):
            c = []
            for size in reversed(sizes):
                flat, i = divmod(flat, size)
                c.append(i)
            coords.append(tuple(reversed(c)))
        self._index = {d: i for i, d in enumerate(self.devices)}
        self._coords = tuple(coords)
        positions = [self.axis_position(a) for a in DATA_AXES]
        fsdp = self.size(MeshAxis.FSDP)
        groups: list[list[int]] = [[] for _ in range(self.data_parallel)]
        for rank, c in zip(self.devices, coords):
            dp_i, fsdp_i = (c[p] if p is not None else 0 for p in positions)
            groups[dp_i * fsdp + fsdp_i].append(rank)
        self._data_groups = tuple(tuple(g) for g in groups)

    def __hash__(self) -> int:
        return hash((self.name, self.devices, self.axes))

    # -- construction --------------------------------------------------------------------------------
    @classmethod
    def contiguous(cls, axes: Iterable[tuple[MeshAxis | str, int]], first_rank: int = 0, name: str = "") -> "Mesh":
        """A mesh over ranks first_rank, first_rank + 1, ... in order."""
        axes = tuple((MeshAxis(a), int(s)) for a, s in axes)
        return cls(name=name, devices=tuple(range(first_rank, first_rank + prod(s for _, s in axes))), axes=axes)

    @classmethod
    def of(cls, devices: Sequence[int], axes: Iterable[tuple[MeshAxis | str, int]], name: str = "") -> "Mesh":
        """A mesh over `devices` in the order given; axes may be named by string."""
        return cls(name=name, devices=tuple(devices), axes=tuple((MeshAxis(a), int(s)) for a, s in axes))

    def view(self, **sizes: int) -> "Mesh":
        """The same devices along other axes (a role's layout on a shared mesh), in the order dp, fsdp, tp,
        pp; axes of size 1 are kept so that `size()` and the data split read alike."""
        axes = tuple((MeshAxis(a), int(sizes.get(a, 1))) for a in ("dp", "fsdp", "tp", "pp"))
        return Mesh(name=self.name, devices=self.devices, axes=axes)

    # -- shape ---------------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.devices)

    num_devices = num_ranks

    @property
    def first_device(self) -> int:
        return self.devices[0]

    def size(self, axis: MeshAxis | str) -> int:
        """Size of `axis`; 1 when the mesh does not have it."""
        for name, size in self.axes:
            if name == axis:
                return size
        return 1

    def axis_sizes(self) -> dict[str, int]:
        return {a.value: s for a, s in self.axes}

    def axis_position(self, axis: MeshAxis | str) -> int | None:
        """Position of `axis` among this mesh's axes; None when the mesh does not have it."""
        for pos, (name, _) in enumerate(self.axes):
            if name == axis:
                return pos
        return None

    # -- ranks ---------------------------------------------------------------------------------------
    def ranks(self) -> tuple[int, ...]:
        return self.devices

    def __contains__(self, rank: object) -> bool:
        return rank in self._index

    def coords(self, rank: int) -> dict[MeshAxis, int]:
        """Index of `rank` along each axis of this mesh."""
        return {name: i for (name, _), i in zip(self.axes, self.coord_tuple(rank))}

    def coord_tuple(self, rank: int) -> tuple[int, ...]:
        """Index of `rank` along each axis, in axis order."""
        try:
            return self._coords[self._index[rank]]
        except KeyError:
            raise LayoutError(f"rank {rank} is not in mesh {self.describe()}") from None

    def coord_table(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """(rank, coords in axis order) for every rank, in mesh order."""
        return tuple(zip(self.devices, self._coords))

    # -- the data split ------------------------------------------------------------------------------
    @property
    def data_parallel(self) -> int:
        """Data shards of a step: the product of the `dp` and `fsdp` sizes."""
        return prod(self.size(a) for a in DATA_AXES)

    def data_index(self, rank: int) -> int:
        """Which data shard `rank` works on (row-major over `dp`, `fsdp`)."""
        c = self.coords(rank)
        return c.get(MeshAxis.DP, 0) * self.size(MeshAxis.FSDP) + c.get(MeshAxis.FSDP, 0)

    def ranks_of_data_index(self, d: int) -> tuple[int, ...]:
        """The ranks that work on data shard `d` together (its tensor- and pipeline-parallel group)."""
        return self._data_groups[d]

    # -- text ----------------------------------------------------------------------------------------
    def device_range(self) -> str:
        first, last = min(self.devices), max(self.devices)
        return f"{first}" if first == last else f"{first}-{last}"

    def describe(self) -> str:
        axes = " x ".join(f"{a.value}={s}" for a, s in self.axes) or "single"
        return f"[{axes} on ranks {self.devices[0]}..{self.devices[-1]}]"


__all__ = ["DATA_AXES", "Mesh", "MeshAxis"]
