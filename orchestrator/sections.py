"""What every section of the schedule is built from: the base class, the bounded number types, the
error a check across keys raises, and values spelled as the TOML file spells them."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]


class KeyProblem(ValueError):
    """A check that spans several keys, raised inside a section; ``key`` is the dotted key to blame."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are not coerced across types."""

    # Attribute docstrings become field descriptions: docs/schedule.md is generated from them.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)


def int_is_float(v: Any) -> Any:
    """TOML writes 0 and 1 as integers; strict mode would refuse them as floats."""
    return float(v) if isinstance(v, int) and not isinstance(v, bool) else v


def _show(v: Any) -> str:
    """A value as the TOML file spells it, short."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "a table"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
