"""What the orchestrator and the phases were doing around each go, seen from outside (nothing in
relayer changes for it): ``switch.py`` starts these beside a relayer run.

- ``ThreadWatch``: every 10 ms, the main thread of the orchestrator and of every phase's rank 0:
  its scheduler state (R running, S sleeping, D in an uninterruptible wait: disk, page faults on
  a file), the kernel function it sleeps in (``wchan``) and its system call (``/proc/PID/syscall``:
  74 is fsync on x86-64), kept as intervals of the same (state, wchan, syscall). A loop waiting in
  ``jbd2_log_wait_commit`` or ``fsync`` while an offer waits is one blocked behind the disk; a
  successor running (R) between its go and reading it was busy when the go came.
- ``StallDump``: where the go is more than ``after`` seconds late after every rank offered, or
  the answer that long after the go, ``py-spy dump --nonblocking`` of the orchestrator and the
  successor's rank 0 (py-spy from the wheels; skipped without it): the Python stack they were in.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import psutil

from _switch_watch import _Poller, phase_pids, read_jsonl

IDLE_WCHANS = ("hrtimer_nanosleep", "do_nanosleep", "do_select", "poll_schedule_timeout", "do_sys_poll",
               "ep_poll", "futex_wait_queue", "futex_wait", "pipe_read", "do_wait", "wait_woken")
"""Where a thread sleeps when it waits on purpose (a timer, select, a futex, a pipe): not recorded."""


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def thread_state(pid: int) -> tuple[str, str, str] | None:
    """(state, wchan, syscall number or "running") of ``pid``'s main thread; None once it is gone."""
    stat = _read(f"/proc/{pid}/task/{pid}/stat")
    if stat is None:
        return None
    state = stat.rsplit(")", 1)[1].split()[0]
    wchan = _read(f"/proc/{pid}/task/{pid}/wchan") or "?"
    syscall = _read(f"/proc/{pid}/task/{pid}/syscall")
    return state, wchan, (syscall.split()[0] if syscall else "?")


class ThreadWatch(_Poller):
    """Intervals of the orchestrator's and each phase's rank 0's main thread outside a deliberate
    sleep: {"who", "t0", "t1", "state", "wchan", "syscall"}."""

    interval = 0.01

    def __init__(self, run_dir: Path, interval: float = 0.01):
        super().__init__("thread-watch")
        self.run_dir, self.interval = run_dir, interval
        self.intervals: list[dict] = []
        self.open: dict[str, dict] = {}
        self.known: dict[str, int] = {}
        self.looked = 0.0

    def targets(self) -> dict[str, int]:
        out = {}
        for child in psutil.Process().children():
            try:
                if any("orchestrator" in part for part in child.cmdline()):
                    out["orchestrator"] = child.pid
            except psutil.Error:
                continue
        for d in (self.run_dir / "phases").glob("phase-*"):
            pids = phase_pids(d, "rank-0")
            if pids:
                out[f"phase {int(d.name.split('-')[1])}"] = pids[0]
        return out

    def look(self) -> None:
        now = time.time()
        if now - self.looked > 0.2:  # new phases start seconds apart; their pids are files to read
            self.known, self.looked = self.targets(), now
        for who, pid in self.known.items():
            seen = thread_state(pid)
            key = None if seen is None or (seen[0] == "S" and seen[1].startswith(IDLE_WCHANS)) else seen
            cur = self.open.get(who)
            if cur is not None and (cur["state"], cur["wchan"], cur["syscall"]) == key:
                cur["t1"] = now
                continue
            if cur is not None:
                self.intervals.append(self.open.pop(who))
            if key is not None:
                self.open[who] = {"who": who, "t0": now, "t1": now, "state": key[0], "wchan": key[1],
                                  "syscall": key[2]}

    def finish(self) -> None:
        super().finish()
        self.intervals.extend(self.open.values())
        self.open = {}

    def between(self, who: str, t0: float, t1: float) -> list[dict]:
        return [i for i in self.intervals if i["who"] == who and i["t1"] >= t0 and i["t0"] <= t1]


class StallDump(_Poller):
    """py-spy stacks of whoever keeps a switch waiting: the orchestrator where every rank offered
    and no go came ``after`` seconds on, the successor where the go came and no answer."""

    interval = 0.02

    def __init__(self, run_dir: Path, after: float = 0.1, most: int = 8):
        super().__init__("stall-dump")
        self.run_dir, self.after, self.most = run_dir, after, most
        self.py_spy = shutil.which("py-spy")
        self.dumps: list[dict] = []
        self.done: set[tuple[str, int]] = set()

    def look(self) -> None:
        if self.py_spy is None or len(self.dumps) >= self.most:
            return
        started = {e["phase"]: e["time"] for e in read_jsonl(self.run_dir / "journal.jsonl")
                   if e.get("event") == "phase_started"}
        now = time.time()
        for d in sorted((self.run_dir / "phases").glob("phase-*")):
            k = int(d.name.split("-")[1])
            offers = list((d / "handover").glob("offer-rank-*.json"))
            answers = list((d / "handover").glob("answer-rank-*.json"))
            if offers and not answers and k + 1 not in started:
                since = max(o.stat().st_mtime for o in offers)
                self._maybe("go", k, since, now, ["orchestrator"])
            elif offers and not answers and k + 1 in started:
                self._maybe("answer", k, started[k + 1], now, [f"phase {k + 1}"])

    def _maybe(self, what: str, phase: int, since: float, now: float, whom: list[str]) -> None:
        if now - since < self.after or (what, phase) in self.done:
            return
        self.done.add((what, phase))
        targets = ThreadWatch(self.run_dir).targets()
        for who in whom:
            pid = targets.get(who)
            if pid is None:
                continue
            r = subprocess.run([self.py_spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True,
                               text=True, timeout=10)
            self.dumps.append({"waiting_for": what, "offering_phase": phase, "who": who, "time": now,
                               "late_seconds": round(now - since, 3), "stack": (r.stdout or r.stderr)[-6000:]})
