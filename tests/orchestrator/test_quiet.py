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


def test_a_rank_holding_a_file_lock_goes_on_and_is_not_stopped_again(tmp_path):
    """A phase preparing ahead holds the warm-up's flock (``launch.prepare``): stopped, it would keep
    the next phase waiting for it until the pause's limit (30 s on an H100). It is let go on at once,
    stays going through the pause, and the lock is free for the next phase to take as soon as it lets it go."""
    import fcntl

    from orchestrator.quiet import lock_holders

    events = []
    pauser = Pauser(30.0, lambda name, **kw: events.append((name, kw)))
    group = SimpleNamespace(phase_dir=tmp_path, proc=SimpleNamespace(poll=lambda: None),
                            work=SimpleNamespace(phase=SimpleNamespace(index=2)))
    lock = tmp_path / "warm-up.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                               f"fd = open({str(lock)!r}, 'w'); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True)\n"
                               "sys.stdin.readline(); fcntl.flock(fd, fcntl.LOCK_UN); time.sleep(60)"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert holder.stdout.readline().strip() == "held" and holder.pid in lock_holders()
        _record(tmp_path, 0, holder)
        _record(tmp_path, 1, idle)
        pauser.pause([group])
        assert _stopped(idle, True) and _stopped(holder, False)
        assert ("preparing_not_paused", {"phase": 2, "pids": [holder.pid], "reason": "holds a file lock"}) in events
        assert events[-1] == ("preparing_paused", {"phases": [2], "pids": [idle.pid]})
        pauser.stop_new_ranks()  # every turn of the supervisor's loop: the holder stays going
        assert _stopped(holder, False) and sum(e[0] == "preparing_not_paused" for e in events) == 1
        holder.stdin.write("\n")
        holder.stdin.flush()
        with open(lock, "w") as fd:
            fcntl.flock(fd, fcntl.LOCK_EX)  # the next phase takes it: the holder was never left stopped on it
        pauser.resume("first_step")
        assert _stopped(idle, False) and not pauser.exempt
    finally:
        for p in (holder, idle):
            p.kill()
            p.wait()
