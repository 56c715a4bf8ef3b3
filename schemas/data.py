"""Data schemas: the typed batches that flow along data edges.

A schema is a set of named tensor fields, each with a dtype and a symbolic shape such as
`int64[B, R]`. Symbols are upper-case names; an integer is a fixed size. Edges connect ports whose
schemas agree, and symbols unify across a node's ports.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from graphrl.schemas.base import Frozen

FieldDType = Literal["int64", "int32", "bool", "float32", "bfloat16"]
DTYPE_BYTES: dict[str, int] = {"int64": 8, "int32": 4, "bool": 1, "float32": 4, "bfloat16": 2}
"""Bytes per element of each field dtype (a bool crosses a link as one byte)."""
_SYMBOL = re.compile(r"^[A-Z][A-Za-z0-9_]*$")
_SPEC = re.compile(r"^\s*(?P<dtype>[a-z0-9]+)\s*\[(?P<dims>[^\]]*)\]\s*$")


class TensorField(Frozen):
    """One tensor of a batch."""

    dtype: FieldDType = Field(description="Element type.")
    shape: tuple[str | int, ...] = Field(description="Symbolic shape: symbols (e.g. 'B', 'R') or fixed sizes.")

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: tuple[str | int, ...]) -> tuple[str | int, ...]:
        for dim in shape:
            if isinstance(dim, int) and dim <= 0:
                raise ValueError(f"fixed dimension {dim} must be positive")
            if isinstance(dim, str) and not _SYMBOL.match(dim):
                raise ValueError(f"symbolic dimension {dim!r} must be an upper-case name like 'B'")
        return shape

    @classmethod
    def parse(cls, text: str) -> "TensorField":
        """Parse the compact form `int64[B, R]`."""
        match = _SPEC.match(text)
        if not match:
            raise ValueError(f"tensor spec {text!r} is not of the form 'dtype[D0, D1, ...]'")
        dims: list[str | int] = []
        for raw in filter(None, (d.strip() for d in match["dims"].split(","))):
            dims.append(int(raw) if raw.isdigit() else raw)
        return cls(dtype=match["dtype"], shape=tuple(dims))  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


class DataSchema(Frozen):
    """A batch: named tensor fields."""

    fields: dict[str, TensorField] = Field(description="Tensor fields by name.")

    @classmethod
    def of(cls, **specs: str) -> "DataSchema":
        return cls(fields={name: TensorField.parse(spec) for name, spec in specs.items()})

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in self.fields.items()) + "}"

    def bytes_per(self, symbol: str, sizes: dict[str, int]) -> int:
        """Bytes of the batch per unit of `symbol` (one response of N, say), the other symbols at `sizes`;
        every field must have `symbol` as its leading dimension."""
        total = 0
        for name, f in self.fields.items():
            if not f.shape or f.shape[0] != symbol:
                raise ValueError(f"field {name} ({f}) does not lead with {symbol}")
            per = DTYPE_BYTES[f.dtype]
            for dim in f.shape[1:]:
                per *= dim if isinstance(dim, int) else sizes[dim]
            total += per
        return total
