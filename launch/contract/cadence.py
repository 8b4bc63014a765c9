"""``checkpoint.every_seconds``: whether a phase end writes its checkpoint, decided by one function
for every caller, as torchtitan's ``CheckpointManager._should_save`` decides for its trainer: the
plan (may any end write none: ``orchestrator.space.carries``), the orchestrator at each go (may this
one: the go's ``defer``, ``orchestrator.runner.Runner._go``) and the successor that takes the state
over (does it carry it on: the answer's ``write``, ``launch.handover.take``). Its outcome reaches the
orchestrator in the typed answer (``PhaseDir.end_written``)."""

from __future__ import annotations


def end_writes(*, due: bool, takes: bool, carries: bool = True) -> bool:
    """Whether a phase end writes its checkpoint: where one is ``due`` (every_seconds have passed
    since the last one written; with every_seconds = 0, at every end), and where its successor does
    not take its state over (``takes``) and carry what it trained on to its own checkpoint
    (``carries``)."""
    return due or not (takes and carries)
