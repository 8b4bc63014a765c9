"""``--set section.key=value``: one schedule key overridden from the command line, as torchtitan's
``--section.key=value``. Applied to the parsed file before validation, so an override is checked
exactly like the file (an unknown key exits 2 naming it) and lands in the run's schedule copy.

    --set optimizer.lr=3e-4 --set schedule.phases[0].steps=5 --set model.dtype=bfloat16
"""

from __future__ import annotations

import copy
import re
import tomllib
from typing import Any

from orchestrator.errors import ScheduleError
from orchestrator.sections import MAX_NESTING

_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*)((?:\[\d+\])*)")


def parse_value(text: str) -> Any:
    """A TOML value; a bare word that is not TOML (``bfloat16``, ``runs/a``) is taken as a string."""
    try:
        parsed = tomllib.loads(f"v = {text}")
    except RecursionError:
        raise ScheduleError(f"--set: {text[:40]!r}...: nested deeper than {MAX_NESTING} levels") from None
    except tomllib.TOMLDecodeError as e:
        if text and not any(c in text for c in "\"'[]{}=\n"):
            return text
        raise ScheduleError(f"--set: expected a TOML value, got {text!r} ({e})") from None
    if set(parsed) != {"v"}:  # "1\nother = 2": what follows a newline is more TOML, never dropped
        raise ScheduleError(f"--set: expected one TOML value, got {text!r}, which goes on past it")
    return parsed["v"]


def parse_key(key: str, item: str) -> list[str | int]:
    """``schedule.phases[0].steps`` -> ["schedule", "phases", 0, "steps"]."""
    path: list[str | int] = []
    for part in key.split("."):
        m = _PART.fullmatch(part)
        if m is None:
            raise ScheduleError(f"--set {item}: expected KEY=VALUE with a dotted key such as optimizer.lr "
                                f"or schedule.phases[0].steps, got key {key!r}")
        path.append(m.group(1))
        path += [int(i) for i in re.findall(r"\d+", m.group(2))]
    return path


def apply_overrides(raw: dict[str, Any], items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """A copy of ``raw`` with each ``KEY=VALUE`` of ``items`` set, in order; tables are made as needed."""
    out = copy.deepcopy(raw)
    for item in items:
        key, eq, text = item.partition("=")
        if not eq:
            raise ScheduleError(f"--set {item}: expected KEY=VALUE, such as optimizer.lr=3e-4")
        path = parse_key(key.strip(), item)
        value = parse_value(text.strip())
        node: Any = out
        for i in range(len(path)):
            part, here, parent = path[i], _dotted(path[:i + 1]), _dotted(path[:i]) or "the schedule"
            if isinstance(part, int):
                if not isinstance(node, list):
                    raise ScheduleError(f"--set {item}: {parent} is not a list")
                if part >= len(node):
                    raise ScheduleError(f"--set {item}: {parent} has {len(node)} item(s), so there is no {here}")
            elif not isinstance(node, dict):
                raise ScheduleError(f"--set {item}: {parent} is not a table")
            if i == len(path) - 1:
                node[part] = value
            elif isinstance(part, str) and part not in node:
                if isinstance(path[i + 1], int):
                    raise ScheduleError(f"--set {item}: {here} is not in the schedule, so it has no items")
                node = node.setdefault(part, {})
            else:
                node = node[part]
    return out


def _dotted(path: list[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else ("." if i else "") + p for i, p in enumerate(path))


def blame_overrides(message: str, source: object, items: list[str] | tuple[str, ...]) -> str:
    """``message`` (a ScheduleError's, a line per problem as ``SOURCE: KEY: what``) with each line
    about a key that an item of ``items`` set, or a table holding it or held by it, blaming that
    ``--set`` instead of the schedule file ``source``."""
    keys = []
    for item in items:
        key = item.partition("=")[0].strip()
        keys.append((item, _dotted(parse_key(key, item))))
    head, lines = f"{source}: ", []
    for line in message.split("\n"):
        rest = line.removeprefix(head)
        key = rest.split(": ", 1)[0]
        item = next((i for i, k in reversed(keys) if _within(key, k) or _within(k, key)), None)
        lines.append(f"--set {item}: {rest}" if line.startswith(head) and item is not None else line)
    return "\n".join(lines)


def _within(key: str, table: str) -> bool:
    return key == table or key.startswith((f"{table}.", f"{table}["))
