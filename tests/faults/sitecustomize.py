"""Installs the fault handlers a crash test asked for, in every Python process of the run.

A test puts this folder on PYTHONPATH and its plan in RELAYER_TEST_FAULTS (JSON) with
``tests.conftest.faults_env``. The plan's keys:

- ``kill_after``: a checkpoint file name: SIGKILL the writer right after writing it (the same as
  ``kill_at={"point": "checkpoint.file_written", "name": ...}``).
- ``kill_at``: ``{"point": NAME, **context}``: SIGKILL the process that reaches the fault point
  NAME (``launch.faults``) with a context holding every other key at that value, e.g.
  ``{"point": "handover.offered", "rank": 0}`` (the predecessor's rank 0 after its offer),
  ``{"point": "handover.copying", "rank": 1}`` (the successor's rank 1 while it copies) or
  ``{"point": "checkpoint.file_written", "name": "layers.safetensors"}``.
- ``hold_first_step``: seconds a pre-warmed phase waits before its first step.
- ``hold_data_batch``: seconds each batch of records waits before it is tokenized (the data
  tool and its ``datasets.map`` workers), so that a test can stop a long preparation.
"""

import json
import os

_plan = json.loads(os.environ.get("RELAYER_TEST_FAULTS") or "{}")
if _plan:
    import signal
    import time

    from launch import faults

    kill_at = dict(_plan.get("kill_at") or {})
    if kill_after := _plan.get("kill_after"):
        kill_at = {"point": "checkpoint.file_written", "name": kill_after}
    if point := kill_at.pop("point", None):
        def _kill(**context: object) -> None:
            if all(context.get(k) == v for k, v in kill_at.items()):
                os.kill(os.getpid(), signal.SIGKILL)

        faults.install(point, _kill)
    if hold := float(_plan.get("hold_first_step", 0)):
        def _hold(prewarm: bool) -> None:
            if prewarm:
                time.sleep(hold)

        faults.install("phase.first_step", _hold)
    if hold_batch := float(_plan.get("hold_data_batch", 0)):
        faults.install("data.batch", lambda: time.sleep(hold_batch))
