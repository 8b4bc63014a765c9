"""The run directory: created whole (atomically) or not at all, held by one orchestrator at a time,
and its copy of the schedule it was started with."""

from __future__ import annotations

import fcntl
import os
import shutil
import tomllib
from pathlib import Path

from launch.contract.files import PHASES

from orchestrator.errors import RunLocked, ScheduleError
from shard_tools.store import Checkpoints

SCHEDULE_COPY = "schedule.toml"
LOCK = "orchestrator.lock"


class RunLock:
    """One orchestrator per run directory: an flock the kernel drops when its holder dies."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLocked(f"{self.path.parent}: another orchestrator (pid {holder}) is running this run") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)


def create_run_dir(rd: Path, schedule_text: str) -> None:
    """Makes ``rd`` with its schedule copy and empty checkpoints/ and phases/, all at once: a
    sibling temporary renamed into place. A folder holding only a lock file is taken over."""
    if rd.exists() and any(p.name != LOCK for p in rd.iterdir()):
        raise ScheduleError(f"{rd}: the output directory exists, is not empty and holds no relayer run")
    tmp = rd.parent / f".tmp-{rd.name}.{os.getpid()}"
    try:
        rd.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(mode=0o750)
    except OSError as e:
        raise ScheduleError(f"{rd}: cannot create the run directory: {e.strerror or e}") from None
    try:
        (tmp / SCHEDULE_COPY).write_text(schedule_text)
        Checkpoints(tmp).root.mkdir()
        (tmp / PHASES).mkdir()
        if rd.exists():
            # Only a lock file is there (the rest removed by hand, say): the folder is free
            # unless an orchestrator holds the lock.
            with RunLock(rd):
                (rd / LOCK).unlink(missing_ok=True)
            rd.rmdir()
        os.replace(tmp, rd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_copy(copy: Path) -> dict:
    """The run's own copy of its schedule, which a person may have edited: bad input naming it."""
    if not copy.is_file():  # a FIFO would block the read
        raise ScheduleError(f"{copy}: expected the run's copy of its schedule, a regular file")
    try:
        return tomllib.loads(copy.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ScheduleError(f"{copy}: expected a UTF-8 TOML file: {e.reason} at byte {e.start}") from None
    except tomllib.TOMLDecodeError as e:
        raise ScheduleError(f"{copy}: TOML syntax error: {e}") from None
    except OSError as e:
        raise ScheduleError(f"{copy}: cannot read the run's schedule copy: {e.strerror or e}") from None
