"""Installs the fault handlers a crash test asked for, in every Python process of the run.

A test puts this folder on PYTHONPATH and its plan in RELAYER_TEST_FAULTS (JSON) with
``tests.conftest.faults_env``: ``kill_after`` (a checkpoint file name: SIGKILL the writer right
after writing it) and ``hold_first_step`` (seconds a pre-warmed phase waits before its first step).
"""

import json
import os

_plan = json.loads(os.environ.get("RELAYER_TEST_FAULTS") or "{}")
if _plan:
    import signal
    import time

    from launch import faults

    if kill_after := _plan.get("kill_after"):
        def _kill(name: str) -> None:
            if name == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)

        faults.install("checkpoint.file_written", _kill)
    if hold := float(_plan.get("hold_first_step", 0)):
        def _hold(prewarm: bool) -> None:
            if prewarm:
                time.sleep(hold)

        faults.install("phase.first_step", _hold)
