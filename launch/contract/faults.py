"""Named points where a test can make a process fail or wait; in production nothing is installed
and a point does nothing.

The crash tests install handlers in the phase processes from a ``sitecustomize`` they put on
PYTHONPATH (tests/faults/); the fork server imports it before it forks, so its children inherit
the handlers. Points:

- ``checkpoint.file_written`` (``name``: the file): one checkpoint file is written in full.
- ``phase.first_step`` (``prewarm``: whether the phase was pre-warmed; ``phase``: its index): a
  phase is about to take its first step.
- ``handover.offered`` (``rank``): a finished phase's rank has written its offer
  (``launch.handover``), before it waits for the answer.
- ``handover.copying`` (``phase``: the successor's index; ``rank``): a successor's rank has
  mapped its predecessor's offer, before it copies and answers.
- ``resident.writing`` (``phase``, ``rank``): a finished phase's rank has written some of its
  trained weights back into the holder's block (``launch.resident``), not all.
- ``warm_up.toy`` (``phase``, ``small``: the toy of the least widths): a pre-warmed phase is
  about to build its warm-up's toy engine.
- ``data.batch``: a batch of records is about to be rendered and tokenized (``datasets.map``,
  in its workers too).
- ``journal.fsync`` (``event``, ``phase``): the orchestrator has written a journal event and is
  about to fsync it.
- ``data.micro_batch`` (``batch``: the dict): a micro-batch is made, before it is fed; a handler
  may change it (the packing tests take the position ids away, to see examples attend across).
"""

from __future__ import annotations

from typing import Callable

_handlers: dict[str, Callable[..., None]] = {}


def install(name: str, handler: Callable[..., None]) -> None:
    _handlers[name] = handler


def point(name: str, /, **context: object) -> None:
    if handler := _handlers.get(name):
        handler(**context)
