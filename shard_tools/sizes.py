"""Sizes as people write them (80GiB, 500MB, 141e9): ``orchestrator plan --device-memory`` and
``shard-tools export --max-shard-size`` read them here, and every command prints them here. No torch."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int | None:
    """Bytes of a size such as 80GiB, 500MB, 1.5TiB or 141e9 (a bare number is bytes; units in any
    case); None unless ``text`` is one of at least one byte. Each command words its own refusal."""
    m = _SIZE.fullmatch(str(text))
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if unit is None:
        return None
    size = float(m.group(1)) * unit
    return int(size) if math.isfinite(size) and size >= 1 else None


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: 512 B, 1.5 KiB ... 2.0 TiB (the largest unit)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
