"""What a phase process records about itself (its records.json): wall-clock marks, spans and values,
all through one object, so the logic that is timed does not spell the keys it is timed under."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator


class Timeline:
    """The phase's records: ``t_*`` marks are ``time.time()`` seconds; other keys are values."""

    def __init__(self, **values: Any):
        self._records: dict[str, Any] = dict(values)

    def mark(self, name: str) -> float:
        """Records the time now under ``name`` and returns it."""
        now = self._records[name] = time.time()
        return now

    @contextlib.contextmanager
    def span(self, start: str, end: str) -> Iterator[None]:
        """Marks ``start`` before the block and ``end`` after it (not when it raises)."""
        t0 = time.time()
        yield
        self._records.update({start: t0, end: time.time()})

    def add(self, **values: Any) -> None:
        self._records.update(values)

    def append(self, name: str, value: Any) -> None:
        """Adds ``value`` to the list under ``name`` (one entry per checkpoint, say)."""
        self._records.setdefault(name, []).append(value)

    def get(self, name: str, default: Any = None) -> Any:
        return self._records.get(name, default)

    def as_records(self) -> dict[str, Any]:
        return dict(self._records)
