"""Retention: the newest ``checkpoint.keep_last`` checkpoints stay whole; of every older one whose
layers file they still read only that file stays; the rest go (``Checkpoints.purge``), each journaled.

A checkpoint a stop named to the user ("kept: the checkpoint at step 25") stays whole too, until a
later stop names another or the run ends: the user may export it meanwhile (seen: retention
removed it after the resume, and the export said "no such file or directory").
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from orchestrator.groups import Group
from orchestrator.supervisor import Supervisor
from shard_tools.errors import CheckpointError
from shard_tools.history import read_journal
from shard_tools.store import Checkpoints


def retain(store: Checkpoints, keep_last: int, protect: set[Path], event: Callable[..., None]) -> None:
    """Keeps the newest ``keep_last`` checkpoints and everything they still need; removes the rest.

    ``protect``: checkpoints a pre-warmed successor may still be reading, or a stop named.
    """
    try:
        for done in store.purge(keep_last, protect):
            event("checkpoint_removed" if done.removed else "checkpoint_layers_kept", path=str(done.path))
    except CheckpointError as e:  # a damaged older checkpoint: keep everything rather than guess
        event("retention_skipped", reason=str(e))


def named_at_stop(store: Checkpoints) -> set[Path]:
    """The checkpoint the run's last stop named to the user (a ``preempted`` event with a
    ``checkpoint``, at its ``step``), where the run has not ended since and it is still there (not
    set aside by --resume-from); else none."""
    for e in reversed(read_journal(store.run_dir)):
        if e.get("event") == "run_done":
            return set()
        if e.get("event") == "preempted" and e.get("checkpoint") and isinstance(e.get("step"), int):
            named = store.at(e["step"])
            return {named} if named.is_dir() else set()
    return set()


def in_use(current: Group | None, running: Supervisor | None, ahead: list[Group]) -> set[Path]:
    """The checkpoints live phases may still read, which retention spares with what they compose
    from: those of ``current`` (the group whose go closed the finished phase's switch), of the
    phases running now (``running`` and the predecessors it follows on: journaling lags a few phases
    behind) and of those pre-warmed ``ahead``. Each one's preload, read as it prepares, which can
    outlast its go (seen: with one-step phases, retention trimmed a layer from under the preload of
    the phase running by then); the one it starts from; the one its predecessor started from
    (``Group.before``), which its go reads."""
    groups = [current, *ahead]
    while running is not None:
        groups, running = groups + [running.group], running.predecessor
    live = [g for g in groups if g is not None and g.proc.poll() is None]
    return {p for g in live for p in (g.preload, g.work.restore, g.before) if p is not None}
