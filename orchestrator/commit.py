"""Making finished phases' checkpoints durable off the orchestrator's loop.

A phase's end checkpoint is written without fsync (its writer is on, or next to, the switch's
critical path) and made durable by the orchestrator once the next phase runs. That fsync of GBs
took seconds on the H200's host, and a loop blocked in it could not see the next phase's offer
(``launch.handover``) in time: the fsync runs in a thread, and the phase is journaled done (in
order, from the loop) only once it has returned.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from orchestrator.groups import Group
from shard_tools.later import Later
from shard_tools.manifest import make_durable


# The loop journals done phases (and runs retention) while a phase trains, not during a switch; with
# phases of a step or two it is nearly always in one, so it journals during a switch too once it is
# this far behind: more than BEHIND_PHASES phases waiting, or the oldest waiting BEHIND_SECONDS.
BEHIND_PHASES = 2
BEHIND_SECONDS = 10.0


class Committer:
    """``submit`` starts a finished phase's fsync; ``poll`` journals (``done``) every phase whose
    fsync has returned, in the order submitted (``block``: waits for all of them; ``switching``:
    only where the journal is behind)."""

    def __init__(self, done: Callable[[Group, Group | None], None]):
        self.done = done
        self.queue: list[tuple[Group, Group | None, Later[None], float]] = []

    def submit(self, finished: Group, current: Group | None) -> None:
        """``finished.end`` None: its end wrote no checkpoint (``Cadence``): journaled in turn all the same."""
        durable = Later(make_durable, finished.end) if finished.end is not None else Later.now(None)
        self.queue.append((finished, current, durable, time.monotonic()))

    def behind(self) -> bool:
        return len(self.queue) > BEHIND_PHASES or \
            bool(self.queue) and time.monotonic() - self.queue[0][3] > BEHIND_SECONDS

    def poll(self, block: bool = False, switching: bool = False) -> None:
        if switching and not self.behind():
            return
        while self.queue and (block or self.queue[0][2].done()):
            finished, current, durable, _ = self.queue.pop(0)
            durable.result()  # raised here, in the loop: nothing is journaled for it
            self.done(finished, current)


class Cadence:
    """``checkpoint.every_seconds``: whether a phase that hands its state over to a successor that
    takes it writes its end checkpoint. ``due`` is asked at each such go; ``wrote`` is told of
    every go (or cold start) whose predecessor writes one. ``base``: the newest checkpoint written
    or being written, which the phases pre-warmed from now on preload (a deferred phase end's
    checkpoint never exists)."""

    def __init__(self, every_seconds: float, base: Path | None):
        self.every, self.base, self.at = every_seconds, base, time.monotonic()

    def due(self) -> bool:
        """every_seconds have passed since the newest checkpoint written (always, with every_seconds = 0)."""
        return self.every <= 0 or time.monotonic() - self.at >= self.every

    def wrote(self, restore: Path | None) -> None:
        self.base, self.at = restore, time.monotonic()
