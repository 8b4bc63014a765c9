"""Making finished phases' checkpoints durable off the orchestrator's loop.

A phase's end checkpoint is written without fsync (its writer is on, or next to, the switch's
critical path) and made durable by the orchestrator once the next phase runs. That fsync of GBs
took seconds on the H200's host, and a loop blocked in it could not see the next phase's offer
(``launch.handover``) in time: the fsync runs in a thread, and the phase is journaled done (in
order, from the loop) only once it has returned.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from orchestrator.groups import Group
from shard_tools.manifest import make_durable


@dataclass
class _Commit:
    finished: Group
    current: Group | None
    thread: threading.Thread
    errors: list[BaseException] = field(default_factory=list)


class Committer:
    """``submit`` starts a finished phase's fsync; ``poll`` journals (``done``) every phase whose
    fsync has returned, in the order submitted (``block``: waits for all of them)."""

    def __init__(self, done: Callable[[Group, Group | None], None]):
        self.done = done
        self.queue: list[_Commit] = []

    def submit(self, finished: Group, current: Group | None) -> None:
        errors: list[BaseException] = []

        def durable() -> None:
            try:
                make_durable(finished.end)
            except BaseException as e:  # noqa: BLE001 - raised in the loop by poll
                errors.append(e)

        thread = threading.Thread(target=durable, name="durable", daemon=True)
        self.queue.append(_Commit(finished, current, thread, errors))
        thread.start()

    def poll(self, block: bool = False) -> None:
        while self.queue and (block or not self.queue[0].thread.is_alive()):
            commit = self.queue.pop(0)
            commit.thread.join()
            if commit.errors:
                raise commit.errors[0]
            self.done(commit.finished, commit.current)
