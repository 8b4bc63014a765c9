"""How the orchestrator reaches launch's processes: the modules it starts them as, and the framing
of the two FIFOs in the run directory, fixed-size JSON records (the fork server's requests, a
pre-warmed phase's go)."""

from __future__ import annotations

import json
import os
import select
import sys
from dataclasses import dataclass
from typing import Any, Callable

PHASE_LAUNCHER = "launch"
"""``python -m launch SPEC``: a phase's launcher (``launch/__main__.py``), which execs the command
that starts its ranks."""
FORK_SERVER = "launch.zygote"
"""``python -m launch.zygote SPEC FIFO``: the run's fork server, forking ranks on ``FORK_REQUESTS``;
``python -m launch.zygote --early``: one started before the run has a spec, which imports what every
phase imports meanwhile and then reads ``FORK_SERVER_START`` on stdin (EOF: not needed, it exits)."""
EARLY = "--early"
DATA_TOOL = "launch.data.tool"
"""``python -m launch.data.tool``: prepares and checks the data; the request on stdin, the answer on
stdout, both JSON."""


def python_m(module: str, *args: str) -> list[str]:
    """The command that runs ``module`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


@dataclass(frozen=True)
class Channel:
    """Fixed-size records on a FIFO: a JSON object padded with spaces to ``size`` bytes. ``size``
    is at most PIPE_BUF, so each write reaches one reader whole, even with many readers on one
    FIFO (the ranks of a pre-warmed phase)."""

    size: int
    keys: frozenset[str]

    def encode(self, **record: Any) -> bytes:
        if set(record) != self.keys:
            raise ValueError(f"a record of keys {sorted(record)}, expected {sorted(self.keys)}")
        data = json.dumps(record).encode()
        if len(data) > self.size:
            raise ValueError(f"a record of {len(data)} bytes does not fit the channel's {self.size}: {data[:80]!r}...")
        return data.ljust(self.size)

    def decode(self, data: bytes) -> dict[str, Any]:
        if len(data) != self.size:
            raise ValueError(f"a record of {len(data)} bytes, expected {self.size}")
        record = json.loads(data)
        if not isinstance(record, dict) or set(record) != self.keys:
            raise ValueError(f"not a record of keys {sorted(self.keys)}: {data.rstrip()[:80]!r}")
        return record

    def read(self, fd: int, idle: Callable[[], None] | None = None, interval: float = 0.005) -> dict[str, Any] | None:
        """The next record from ``fd``; None at EOF (every writer gone) before a whole one.

        With ``idle`` (``fd`` is then non-blocking) it is called every ``interval`` seconds while
        nothing is there; a record that another reader took first is waited past."""
        data = b""
        while len(data) < self.size:
            if idle is not None and not select.select([fd], [], [], interval)[0]:
                idle()
                continue
            try:
                chunk = os.read(fd, self.size - len(data))
            except BlockingIOError:  # another reader took the record that woke this one
                continue
            if not chunk:
                return None
            data += chunk
        return self.decode(data)


GO = Channel(4096, frozenset({"restore", "handover", "defer"}))
"""phase-NNNN/go: a pre-warmed phase's checkpoint to restore (or None: the base model), one record
per rank, written once its predecessor's processes are gone; or, with ``handover`` (the
predecessor's phase directory), once every rank of the predecessor has made its offer: the
checkpoint is then the one the predecessor commits after the answers."""
FORK_SERVER_START = Channel(4096, frozenset({"spec", "fifo", "log"}))
"""An early fork server's stdin: serve with the spec.json at ``spec`` (its model, its run) on the
requests FIFO ``fifo``, writing to the log ``log``."""
FORK_REQUESTS = Channel(4096, frozenset({"spec", "nproc"}))
"""RUN_DIR/zygote.fifo: fork the ranks of the phase whose spec.json is at ``spec``."""
