"""Making finished phases' checkpoints durable off the orchestrator's loop.

A phase's end checkpoint is written without fsync (its writer is on, or next to, the switch's
critical path) and made durable by the orchestrator once the next phase runs. That fsync of GBs
took seconds on the H200's host, and a loop blocked in it could not see the next phase's offer
(``launch.handover``) in time: the fsync runs in a thread, and the phase is journaled done (in
order, from the loop) only once it has returned.
"""

from __future__ import annotations

from typing import Callable

from orchestrator.groups import Group
from shard_tools.later import Later
from shard_tools.manifest import make_durable


class Committer:
    """``submit`` starts a finished phase's fsync; ``poll`` journals (``done``) every phase whose
    fsync has returned, in the order submitted (``block``: waits for all of them)."""

    def __init__(self, done: Callable[[Group, Group | None], None]):
        self.done = done
        self.queue: list[tuple[Group, Group | None, Later[None]]] = []

    def submit(self, finished: Group, current: Group | None) -> None:
        self.queue.append((finished, current, Later(make_durable, finished.end)))

    def poll(self, block: bool = False) -> None:
        while self.queue and (block or self.queue[0][2].done()):
            finished, current, durable = self.queue.pop(0)
            durable.result()  # raised here, in the loop: nothing is journaled for it
            self.done(finished, current)
