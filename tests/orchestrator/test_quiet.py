"""The pauser of quiet switches (orchestrator.quiet) on real processes and real signals."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil

from launch.contract.pids import started
from orchestrator.quiet import Pauser


def _record(phase_dir, rank: int, proc: subprocess.Popen) -> None:
    pids = phase_dir / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    record = {"pid": proc.pid, "started": started(proc.pid)}
    (pids / f"rank-{rank}.json").write_text(json.dumps(record))


def _stopped(proc: subprocess.Popen, want: bool) -> bool:
    """Whether ``proc`` is (``want``) or is not stopped within 5 s: signals act asynchronously."""
    deadline = time.time() + 5
    while time.time() < deadline:
        if (psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED) == want:
            return True
        time.sleep(0.01)
    return False


def test_a_group_forked_after_its_pause_is_stopped_too(tmp_path):
    # A group started just before a switch: its ranks are recorded only after the pause began.
    events = []
    pauser = Pauser(30.0, lambda name, **kw: events.append((name, kw)))
    group = SimpleNamespace(phase_dir=tmp_path, proc=SimpleNamespace(poll=lambda: None),
                            work=SimpleNamespace(phase=SimpleNamespace(index=3)))
    ranks = []
    try:
        pauser.pause([group])
        assert pauser.active and events == [("preparing_paused", {"phases": [3], "pids": []})]
        for r in range(2):
            ranks.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            _record(tmp_path, r, ranks[-1])
        pauser.stop_new_ranks()  # what the supervisor does every turn of its loop
        assert all(_stopped(p, True) for p in ranks)
        pauser.resume("first_step")
        assert not pauser.active and events[-1][1]["reason"] == "first_step"
        assert all(_stopped(p, False) for p in ranks)
    finally:
        for p in ranks:
            p.kill()
            p.wait()
