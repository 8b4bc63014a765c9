"""The run directory: created whole (atomically) or not at all, held by one orchestrator at a time,
its copy of the schedule it was started with, and the entries a run writes and deletes through."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import tomllib
from pathlib import Path

from launch.contract.files import DATA_CACHE, PHASES, RESIDENT, PhaseDir, RunDir

from orchestrator import procs
from orchestrator.errors import RunLocked, ScheduleError
from shard_tools.files import kind_of, write_atomic
from shard_tools.history import JOURNAL
from shard_tools.manifest import CHECKPOINTS, FINAL
from shard_tools.store import Checkpoints

SCHEDULE_COPY = "schedule.toml"
LOCK = "orchestrator.lock"


class RunLock:
    """One orchestrator per run directory: an flock the kernel drops when its holder dies."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        fd = _open_lock(self.path, os.O_RDWR | os.O_CREAT)
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


def _open_lock(path: Path, flags: int) -> int:
    """The lock file's descriptor. A link there is refused, not followed (the pid written into the
    lock would overwrite what it points to), and so is anything but a file, without blocking."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        raise ScheduleError(f"{path}: {entry_fault(path, 'a file')}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ScheduleError(f"{path}: {kind_of(mode)}, where the run keeps its lock file")
    return fd


def lock_held(run_dir: Path) -> bool:
    """Whether an orchestrator holds the run (for ``status``: a look, never a wait)."""
    try:
        fd = _open_lock(Path(run_dir) / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


# What a run keeps at each of its names, as ``RunDir``/``PhaseDir`` spell them: it writes, appends
# and deletes through these, so an entry of another kind (a symbolic link out of the run, a FIFO
# or a folder where a file belongs) is refused before the run touches it, never followed.
_FILE, _DIR = "a file", "a folder"
_RUN_FILES = RunDir(".")
RUN_ENTRIES = {SCHEDULE_COPY: _FILE, JOURNAL: _FILE, _RUN_FILES.metrics.name: _FILE, LOCK: _FILE,
               _RUN_FILES.zygote_log.name: _FILE, FINAL: _DIR, CHECKPOINTS: _DIR, PHASES: _DIR, DATA_CACHE: _DIR,
               "tensorboard": _DIR, "wandb": _DIR, RESIDENT: _DIR}
_PHASE_FILES = PhaseDir(".")
PHASE_ENTRIES = {_PHASE_FILES.log.name: _FILE, _PHASE_FILES.stages.name: _FILE, _PHASE_FILES.pids.name: _DIR,
                 _PHASE_FILES.exits.name: _DIR, _PHASE_FILES.errors.name: _DIR, _PHASE_FILES.handover.name: _DIR}


def entry_fault(path: Path, kind: str = _DIR) -> str | None:
    """Why ``path`` is not ``kind`` of the run's own (missing is fine), or None."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return (f"a symbolic link (to {os.readlink(path)}), where the run keeps {kind} of its own; a run writes "
                f"and deletes nothing through a link: move it away and run again")
    if (stat.S_ISDIR(mode) if kind == _DIR else stat.S_ISREG(mode)):
        return None
    return f"{kind_of(mode)}, where the run keeps {kind}: move it away and run again"


def check_entries(rd: Path) -> None:
    """ScheduleError naming the first entry of the run directory that is not of its kind (above),
    its phase folders and data-cache entries included; nothing is written."""
    todo = [(rd / name, kind) for name, kind in RUN_ENTRIES.items()]
    todo += [(rd / RESIDENT / name, kind) for name, kind in PHASE_ENTRIES.items()]  # the holder's, a phase's kind
    for folder, names in ((rd / PHASES, PHASE_ENTRIES), (rd / DATA_CACHE, {})):
        if not entry_fault(folder, _DIR) and folder.is_dir():
            for entry in sorted(folder.iterdir()):
                if not entry.name.startswith("."):  # temporaries go, links as links
                    todo += [(entry, _DIR), *((entry / n, k) for n, k in names.items())]
    for path, kind in todo:  # a folder before what it holds
        if fault := entry_fault(path, kind):
            raise ScheduleError(f"{path}: {fault}")


def write_copy(rd: Path, schedule_text: str) -> None:
    """Replaces the run's schedule copy whole (a schedule it goes on with, accepted as changing no
    completed work); a link there is replaced, not written through."""
    write_atomic(rd / SCHEDULE_COPY, schedule_text)


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


KEEP_PHASE_DIRS = 8
"""The folders in RUN_DIR/phases of the last phases done that a run keeps, for a look at their
worker logs; an older one holds nothing a resume or ``report`` reads (its records are in the
journal), and a day-long LISA run has thousands."""


def prune_phase_dirs(rd: Path, done: int) -> list[Path]:
    """Removes the folder of every phase before ``done - KEEP_PHASE_DIRS`` (``done``: the phase just
    journaled done, so all before it are) with no process left, renamed out of the way first (a
    hidden name, never read as a phase's) so that a kill mid-way leaves no half folder under a
    phase's name; hidden ones such a kill left go too. The folders removed."""
    removed = []
    for files in RunDir(rd).phase_dirs():
        index = files.path.name.removeprefix("phase-")
        if index.isdigit() and int(index) <= done - KEEP_PHASE_DIRS and not procs.recorded(files.path):
            gone = files.path.with_name(f".{files.path.name}.gone")
            shutil.rmtree(gone, ignore_errors=True)
            os.replace(files.path, gone)
            removed.append(files.path)
    for gone in (rd / PHASES).glob(".phase-*.gone"):
        shutil.rmtree(gone, ignore_errors=True)
    return removed
