"""Installs the fault handlers a crash test asked for, in every Python process of the run.

A test puts this folder on PYTHONPATH and its plan in RELAYER_TEST_FAULTS (JSON) with
``tests.conftest.faults_env``. The plan's keys:

- ``kill_after``: a checkpoint file name: SIGKILL the writer right after writing it (the same as
  ``kill_at={"point": "checkpoint.file_written", "name": ...}``).
- ``kill_at``: ``{"point": NAME, **context}``: SIGKILL the process that reaches the fault point
  NAME (``launch.contract.faults``) with a context holding every other key at that value, e.g.
  ``{"point": "handover.offered", "rank": 0}`` (the predecessor's rank 0 after its offer),
  ``{"point": "handover.copying", "rank": 1}`` (the successor's rank 1 while it copies) or
  ``{"point": "checkpoint.file_written", "name": "layers.safetensors"}``.
- ``stall_at``: ``{"point": NAME, **context}`` as for ``kill_at``: the process that reaches it
  says so on stderr (``stalled at NAME``) and sleeps for good, its other threads going on, as a
  rank hung in a collective or a write does, e.g. ``{"point": "phase.first_step", "phase": 1}``.
- ``block_at``: ``{"point": NAME, **context}`` as for ``stall_at``, but the thread that reaches it
  also blocks the stop signals and so never runs Python again, as a main thread in an fsync on a
  full disk (uninterruptible sleep) does not: e.g. ``{"point": "journal.fsync", "event": "phase_started",
  "phase": 1}`` (the orchestrator's own journal).
- ``raise_at``: ``{"point": NAME, **context}`` as for ``kill_at``: the process that reaches it
  raises RuntimeError there (``raised at NAME (a test's fault)``), as a rank whose copy runs out of
  memory does, e.g. ``{"point": "handover.copying", "phase": 1, "rank": 1}`` (the successor's rank
  1 answers "not taken").
- ``oom_at``: ``{"point": NAME, **context}`` as for ``raise_at``, but it raises
  torch.OutOfMemoryError, as a device without room does, e.g. ``{"point": "warm_up.toy", "small": False}``
  (every pre-warmed phase's warm-up on one layer finds no room).
- ``hold_first_step``: seconds a pre-warmed phase waits before its first step.
- ``hold_data_batch``: seconds each batch of records waits before it is tokenized (the data
  tool and its ``datasets.map`` workers), so that a test can stop a long preparation.
- ``cross_examples``: micro-batches of rows packed whole lose their position ids, so that their
  examples' positions run on and their attention crosses from one example to the next.
- ``hold_at``: ``{"point": NAME, "seconds": S, "skip": K, **context}``: the process that reaches
  NAME with that context sleeps S seconds there (a checkpoint write that takes long), from its
  K+1-th time there on (``skip``, default 0).
"""

import json
import os

_plan = json.loads(os.environ.get("RELAYER_TEST_FAULTS") or "{}")
if _plan:
    import signal
    import sys
    import time

    from launch.contract import faults

    def _matching(at: dict, act) -> None:
        at = dict(at)
        name = at.pop("point")

        def _handler(**context: object) -> None:
            if all(context.get(k) == v for k, v in at.items()):
                act(name)

        faults.install(name, _handler)

    def _stall(name: str) -> None:
        print(f"stalled at {name}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)

    def _block(name: str) -> None:
        print(f"blocked at {name}", file=sys.stderr, flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP})
        while True:
            time.sleep(3600)

    def _raise(name: str) -> None:
        raise RuntimeError(f"raised at {name} (a test's fault)")

    if stall_at := _plan.get("stall_at"):
        _matching(stall_at, _stall)
    if block_at := _plan.get("block_at"):
        _matching(block_at, _block)
    if raise_at := _plan.get("raise_at"):
        _matching(raise_at, _raise)

    def _oom(name: str) -> None:
        import torch

        raise torch.OutOfMemoryError(f"no room at {name} (a test's fault)")

    if oom_at := _plan.get("oom_at"):
        _matching(oom_at, _oom)
    kill_at = dict(_plan.get("kill_at") or {})
    if kill_after := _plan.get("kill_after"):
        kill_at = {"point": "checkpoint.file_written", "name": kill_after}
    if "point" in kill_at:
        _matching(kill_at, lambda name: os.kill(os.getpid(), signal.SIGKILL))
    hold_at = dict(_plan.get("hold_at") or {})
    if hold_point := hold_at.pop("point", None):
        seconds, passes = float(hold_at.pop("seconds")), [int(hold_at.pop("skip", 0))]

        def _sleep(**context: object) -> None:
            if all(context.get(k) == v for k, v in hold_at.items()):
                if passes[0] == 0:
                    time.sleep(seconds)
                passes[0] = max(0, passes[0] - 1)

        faults.install(hold_point, _sleep)
    if hold := float(_plan.get("hold_first_step", 0)):
        def _hold(prewarm: bool, **_: object) -> None:
            if prewarm:
                time.sleep(hold)

        faults.install("phase.first_step", _hold)
    if hold_batch := float(_plan.get("hold_data_batch", 0)):
        faults.install("data.batch", lambda: time.sleep(hold_batch))
    if _plan.get("cross_examples"):
        faults.install("data.micro_batch", lambda batch, **_: batch.pop("position_ids", None))
