"""docs/schedule.md, the reference of every schedule key, generated from orchestrator/schedule.py.

    python -m orchestrator.docs            # rewrites docs/schedule.md
    python -m orchestrator.docs --check    # exit 1 when docs/schedule.md is stale or a key has no docstring

Each key's text is the docstring under its field in schedule.py (pydantic reads them with
``use_attribute_docstrings``), so the reference cannot drift from the code: a test runs ``--check``.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from orchestrator.schedule import Schedule, _show
from orchestrator.sections import MAX_INT64

DOC = Path(__file__).resolve().parent.parent / "docs" / "schedule.md"

HEADER = """\
# Schedule keys

Every key of the schedule file (TOML), generated from `orchestrator/schedule.py` by
`python -m orchestrator.docs`; do not edit by hand. Relative paths are relative to the schedule
file; unknown keys are errors (exit 2, naming the key). `orchestrator plan SCHEDULE.toml` checks a
file without starting anything, and `--set section.key=value` overrides any key on `plan` and `run`.
`examples/tiny/schedule.toml` is a commented example; [coming-from.md](coming-from.md) maps
LMFlow's and the Hugging Face Trainer's arguments to these keys.
"""

_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _number(v: Any) -> str:
    """A bound as a reader takes it in: 2,147,483,648 and 1e+08, not 2147483648 and 100000000.0."""
    return f"{v:,}" if isinstance(v, int) else f"{v:g}"


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The section class inside an annotation (``list[PhaseEntry] | None`` -> PhaseEntry)."""
    todo = [annotation]
    while todo:
        t = todo.pop()
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
        todo.extend(typing.get_args(t))
    return None


def _type(annotation: Any, metadata: list[Any] = ()) -> str:
    """A type as a TOML user reads it: ``integer > 0``, ``"a" | "b"``, ``list of integer``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        # Field(gt=0) inside Annotated is a FieldInfo whose own metadata holds the bounds.
        meta = [m for x in annotation.__metadata__ for m in (x.metadata if isinstance(x, FieldInfo) else [x])]
        return _type(args[0], meta)
    bounds = " ".join(f"{_BOUNDS[k]} {_number(getattr(m, k))}" for m in metadata for k in _BOUNDS
                      if getattr(m, k, None) not in (None, MAX_INT64))  # int64's bound goes without saying
    if origin is Literal:
        return " \\| ".join(_show(a) if not isinstance(a, str) else f'"{a}"' for a in args)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        text = " or ".join(_type(a) for a in rest)
        return f"{text} (optional)" if len(rest) < len(args) else text
    if origin in (list, tuple):
        inner = {_type(a) for a in args if a is not Ellipsis}
        return f"list of {' or '.join(sorted(inner))}" + (f" ({len(args)})" if origin is tuple else "")
    if origin is dict or annotation is dict:
        return "table"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    name = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(annotation, str(annotation))
    return f"{name} {bounds}".strip()


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
        return "`{}`" if value == {} else "(the section's defaults)"
    if field.default is None or field.default is PydanticUndefined:
        return "none"
    value = field.default
    if isinstance(value, tuple):
        value = list(value)
    text = _show(value) if not isinstance(value, str) else f'"{value}"'
    return f"`{text}`"


def keys(model: type[BaseModel] = Schedule, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(dotted key, field) for every key, depth first; the sections themselves are not keys."""
    for name, field in model.model_fields.items():
        sub = _submodel(field.annotation)
        if not prefix and sub is not None:  # a section, not a key
            yield from keys(sub, f"{name}.")
            continue
        yield prefix + name, field
        if sub is not None:
            yield from keys(sub, f"{prefix}{name}[i].")


def undocumented(model: type[BaseModel] = Schedule) -> list[str]:
    return [key for key, field in keys(model) if not (field.description or "").strip()]


def render() -> str:
    out = [HEADER]
    section = None
    for key, field in keys():
        top = key.split(".")[0]
        if top != section:
            section = top
            out += [f"\n## [{section}]\n", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        text = " ".join((field.description or "").split()).replace("|", "\\|")
        out.append(f"| `{key}` | {_type(field.annotation, field.metadata)} | {_default(field)} | {text} |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    missing = undocumented()
    if missing:
        print(f"orchestrator/schedule.py: keys without a docstring: {', '.join(missing)}", file=sys.stderr)
        return 1
    text = render()
    if "--check" in argv:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC}: stale; run python -m orchestrator.docs", file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    print(DOC)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
