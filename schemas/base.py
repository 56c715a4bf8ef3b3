"""The base of every schema: frozen, no unknown keys, strict about types that YAML could blur."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    """Immutable, hashable-by-value schema object that refuses unknown keys."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        strict=False,
        validate_default=True,
        use_attribute_docstrings=False,
        ser_json_inf_nan="strings",
    )
