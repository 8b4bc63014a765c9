"""What a run writes and deletes through, as untrusted input: a symbolic link out of the run, a FIFO
or a folder where a file belongs, a file where a folder belongs, at every name the run keeps. Each
is refused (exit 2 naming it) before the run writes anything, and nothing outside the run is read
through, written or deleted. RUN_DIR/final counts as this run's only where it is this run's export,
unchanged. Nothing here starts a phase."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from orchestrator import final
from orchestrator.errors import RelayerError, ScheduleError
from orchestrator.journal import Journal
from orchestrator.rundir import LOCK, PHASE_ENTRIES, RUN_ENTRIES, RunLock, check_entries, create_run_dir
from orchestrator.runner import Runner
from orchestrator.validate import load_schedule
from shard_tools.digest import folder_digests
from shard_tools.manifest import EXPORT_MARKER, FINAL
from tests.conftest import schedule_dict, write_schedule
from tests.trees import snapshot

KINDS = ("link to a folder", "link to a file", "dangling link", "link loop", "FIFO", "other kind")


@pytest.fixture
def user(tmp_path) -> Path:
    """The user's own files outside the run, which no link may get the run to touch."""
    home = tmp_path / "user"
    (home / "folder").mkdir(parents=True)
    (home / "folder" / "thesis.tex").write_text("years of work\n")
    (home / "notes.txt").write_text("precious\n")
    return home


def plant(path: Path, kind: str, user: Path, expected: str) -> None:
    """Puts an entry of ``kind`` at ``path``, where the run keeps ``expected`` ("a file"/"a folder")."""
    if kind == "link to a folder":
        path.symlink_to(user / "folder")
    elif kind == "link to a file":
        path.symlink_to(user / "notes.txt")
    elif kind == "dangling link":
        path.symlink_to(user / "nothing")
    elif kind == "link loop":
        path.symlink_to(path)
    elif kind == "FIFO":
        os.mkfifo(path)
    elif expected == "a file":
        path.mkdir()
    else:
        path.write_text("a file where a folder belongs\n")


@pytest.fixture
def run(tmp_path, tiny_model, tiny_data) -> tuple[Path, Path]:
    """(schedule, run directory) of a run that has started: its copy, a journal, one phase folder."""
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data))
    rd = tmp_path / "run"
    create_run_dir(rd, sched.read_text())
    Journal(rd).write("run_started", phases=3, total_steps=30)
    (rd / "phases" / "phase-0000").mkdir()
    (rd / "data-cache" / "0123456789abcdef0123").mkdir(parents=True)
    return sched, rd


ENTRIES = ([(name, kind) for name, kind in RUN_ENTRIES.items()]
           + [(f"phases/phase-0000/{name}", kind) for name, kind in PHASE_ENTRIES.items()]
           + [("phases/phase-0001", "a folder"), ("data-cache/fedcba9876543210fedc", "a folder")])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name,expected", ENTRIES)
def test_an_entry_of_another_kind_is_refused_before_the_run_writes(name, expected, kind, run, user):
    sched, rd = run
    target = rd / name
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    plant(target, kind, user, expected)
    before, outside = snapshot(rd), snapshot(user)
    with pytest.raises(ScheduleError) as e:
        Runner(load_schedule(sched))._prepare_run_dir()
    assert str(target) in str(e.value) and "\n" not in str(e.value)
    assert snapshot(rd) == before and snapshot(user) == outside


def test_a_run_directory_of_its_own_kinds_passes(run):
    check_entries(run[1])


def test_a_linked_lock_is_never_written_through(tmp_path, user):
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / LOCK).symlink_to(user / "notes.txt")
    with pytest.raises(ScheduleError, match="symbolic link"):
        RunLock(rd).__enter__()
    assert (user / "notes.txt").read_text() == "precious\n"


def test_a_linked_journal_is_never_appended_to(tmp_path, user):
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "journal.jsonl").symlink_to(user / "notes.txt")
    with pytest.raises(OSError, match="symbolic link"):
        Journal(rd).write("run_started")
    assert (user / "notes.txt").read_text() == "precious\n"


def fake_final(rd: Path, step: int) -> Path:
    """RUN_DIR/final as this run's export of ``step`` records itself in relayer.json."""
    folder = rd / FINAL
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}\n')
    (folder / "model.safetensors").write_bytes(b"weights" * 100)
    marker = {"export": "relayer", "run": str(rd.resolve()), "global_step": step,
              "checkpoint": str((rd / "checkpoints" / f"step-{step:08d}").resolve()),
              "files": folder_digests(folder, skip=EXPORT_MARKER)}
    (folder / EXPORT_MARKER).write_text(json.dumps(marker))
    return folder


def test_final_is_current_only_as_this_runs_unchanged_export(run, tmp_path):
    rd = run[1]
    folder = fake_final(rd, 30)
    assert final.is_current(rd, 30)
    assert not final.is_current(rd, 20)
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[3] ^= 1  # changed weights, same size, same step
    (folder / "model.safetensors").write_bytes(bytes(data))
    assert not final.is_current(rd, 30)


def test_another_runs_final_is_not_this_runs(run, tmp_path):
    rd = run[1]
    other = tmp_path / "other-run"
    (other / "checkpoints").mkdir(parents=True)
    os.replace(fake_final(other, 30), rd / FINAL)
    assert not final.is_current(rd, 30)


def test_a_final_linked_out_of_the_run_is_neither_current_nor_written(run, tmp_path, user):
    rd = run[1]
    copy = fake_final(rd, 30).rename(user / "export")
    (rd / FINAL).symlink_to(copy)
    outside = snapshot(user)
    assert not final.is_current(rd, 30)
    with pytest.raises(RelayerError, match="symbolic link"):
        final.write_final(rd)
    assert snapshot(user) == outside
