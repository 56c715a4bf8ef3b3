"""The base of every schema: frozen, no unknown keys, strict about types that YAML could blur.

Numbers and flags in what a user writes use the strict types below, never bare `int`/`float`/`bool`:
pydantic's lax mode would take `batch_size: true` as 1, `lr: "1e-3"` (a quoted string) as a number and
`lr: .inf` as a learning rate, so a typo would run. A value must have the type the field declares; the
one conversion kept is an integer where a real number is expected (`lr: 1`).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AllowInfNan, BaseModel, ConfigDict, Strict

Integer = Annotated[int, Strict()]
"""An integer as written: not a boolean, not a string of digits, not 8.0."""

Real = Annotated[float, Strict(), AllowInfNan(False)]
"""A finite real number; an integer is accepted, a boolean, a string, inf or nan is not."""

Boolean = Annotated[bool, Strict()]
"""true or false; not 0/1 and not a string."""


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
