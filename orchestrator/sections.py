"""What every section of the schedule is built from: the base class, the bounded number types, the
error a check across keys raises, and values spelled as the TOML file spells them."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

MAX_INT64 = 2**63 - 1
"""Every integer a run stores (steps, positions, seeds) is an int64 tensor somewhere."""
MAX_STEPS = 10**8 - 1
"""Global steps a run may count: a checkpoint folder is step-NNNNNNNN, eight digits."""
MAX_SECONDS = 1e8
"""About three years: every duration a run waits for (timeouts, the cadence) is below it, so that no
clock or timer overflows (threading's and select's limits are near 9.2e9 s)."""
MAX_ROWS = 1 << 31
"""Rows in one batch or micro-batch, tokens in one row: beyond these no device holds one."""

PositiveInt = Annotated[int, Field(gt=0, le=MAX_INT64)]
NonNegInt = Annotated[int, Field(ge=0, le=MAX_INT64)]
Steps = Annotated[int, Field(gt=0, le=MAX_STEPS)]
NonNegSteps = Annotated[int, Field(ge=0, le=MAX_STEPS)]
Rows = Annotated[int, Field(gt=0, le=MAX_ROWS)]
Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]
NonNegSeconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]


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


MAX_NESTING = 32
"""Tables and lists within each other in a schedule (or a deepspeed.config file): real ones nest a
few levels; deeper input is refused before anything recurses through it."""


def too_deep(value: Any, prefix: str = "") -> str | None:
    """The dotted key where ``value`` nests deeper than ``MAX_NESTING``, or None; without recursion."""
    todo = [(value, prefix, 0)]
    while todo:
        v, key, depth = todo.pop()
        if not isinstance(v, (dict, list)):
            continue
        if depth >= MAX_NESTING:
            return key or "(top level)"
        items = v.items() if isinstance(v, dict) else enumerate(v)
        todo += [(x, f"{key}[{k}]" if isinstance(k, int) else f"{key}{'.' if key else ''}{k}", depth + 1)
                 for k, x in items]
    return None
