"""What a schedule's validation error says: the key, what it expected, and the keys a section
takes (pydantic's ``ValidationError`` turned into one message naming the key)."""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from orchestrator.schedule import Schedule
from orchestrator.sections import KeyProblem, _show


def _section_at(loc: tuple) -> type[BaseModel] | None:
    """The section class that holds the last key of ``loc``, for suggesting the keys it takes."""
    cls: type[BaseModel] | None = Schedule
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = cls.model_fields.get(part)
        if field is None:
            return None
        todo, cls = [field.annotation], None
        while todo:
            t = todo.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                cls = t
                break
            todo.extend(typing.get_args(t))
        if cls is None:
            return None
    return cls


def _unknown_key(loc: tuple) -> str:
    section = _section_at(loc)
    if section is None:
        return "unknown key"
    known = list(section.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if close:
        return f"unknown key (did you mean {close[0]}?)"
    return f"unknown key; expected one of {', '.join(known)}"


_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _bound(err: dict[str, Any]) -> str:
    (op, limit), = ((k, v) for k, v in err["ctx"].items() if k in _BOUNDS)
    noun = "integer" if isinstance(err["input"], int) else "number"
    if limit == 0 and op in ("gt", "ge"):
        return f"expected a {'positive' if op == 'gt' else 'non-negative'} {noun}"
    shown = f"{limit:,}" if isinstance(limit, int) else f"{limit:g}"
    return f"expected a{'n' if noun == 'integer' else ''} {noun} {_BOUNDS[op]} {shown}"


_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number",
    "string_type": "a string", "bool_type": "true or false", "bool_parsing": "true or false",
    "list_type": "a list", "tuple_type": "a list", "dict_type": "a table",
    "model_type": "a table", "model_attributes_type": "a table",
}


def _plain(err: dict[str, Any]) -> tuple[str, str]:
    """(dotted key, what is expected) for one pydantic error, in the schedule's own words."""
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
    key = ""
    for p in loc:
        key += f"[{p}]" if isinstance(p, int) else (("." if key else "") + str(p))
    kind, got = err["type"], f", got {_show(err['input'])}"
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, KeyProblem):
        return cause.key, str(cause)
    if kind == "extra_forbidden":
        return key, _unknown_key(loc)
    if kind == "missing":
        return key, "required, but missing"
    if kind in _EXPECTED:
        return key, f"expected {_EXPECTED[kind]}{got}"
    if kind == "literal_error":
        return key, f"expected {err['ctx']['expected']}{got}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return key, _bound(err) + got
    if kind == "too_short":
        return key, f"expected at least {err['ctx']['min_length']} item(s){got}"
    return key, err["msg"].removeprefix("Value error, ")


def format_validation(err: ValidationError, source: Path) -> str:
    return "\n".join(f"{source}: {key or '(top level)'}: {msg}" for key, msg in map(_plain, err.errors()))

