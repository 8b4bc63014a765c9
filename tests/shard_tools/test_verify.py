"""``shard-tools verify``: a one-line summary when whole, each faulty file named and exit 1 otherwise."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import shard_tools.verify
from shard_tools.manifest import HEAD
from shard_tools.store import Checkpoints, Purged
from shard_tools.verify import verify_path
from tests.shard_tools.conftest import assert_fails, ckpt, flip_byte, invoke

NO_PID = int(Path("/proc/sys/kernel/pid_max").read_text())
"""No process has this pid: pids are below it."""


def test_whole_run(tiny_run):
    result = invoke("verify", tiny_run)
    assert result.exit_code == 0, result.output
    [line] = result.stdout.splitlines()
    assert line.startswith(f"ok: {tiny_run}: 3 checkpoint(s), 9 files")


def test_whole_checkpoint(tiny_run):
    result = invoke("verify", ckpt(tiny_run, 20))
    assert result.exit_code == 0, result.output
    assert "1 checkpoint(s), 3 files" in result.stdout


def test_every_fault_of_a_run_is_named(run_copy):
    flip_byte(ckpt(run_copy, 10) / "head.safetensors")
    (ckpt(run_copy, 30) / "layers.safetensors").unlink()
    stray = run_copy / "checkpoints" / f".tmp-step-00000040.{NO_PID}"
    stray.mkdir()
    result = invoke("verify", run_copy)
    assert_fails(result, 1, ckpt(run_copy, 10) / "head.safetensors: checksum mismatch",
                 ckpt(run_copy, 30) / "layers.safetensors: missing", f"{stray}: stray temporary",
                 "3 fault(s) in 3 checkpoint(s)")
    assert "step-00000020" not in result.stdout
    assert len(verify_path(run_copy).faults) == 3


def test_run_without_checkpoints(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    result = invoke("verify", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "0 checkpoint(s)" in result.stdout


def test_a_checkpoint_folder_that_is_a_symbolic_link_is_a_fault_and_ignored(run_copy, tmp_path):
    """A step folder linked to a whole copy elsewhere: not the run's own bytes (and retention could
    not remove it): verify names it, and the restore point is the newest folder of the run's own."""
    from shard_tools.store import Checkpoints

    elsewhere = tmp_path / "elsewhere"
    ckpt(run_copy, 30).rename(elsewhere)
    ckpt(run_copy, 30).symlink_to(elsewhere, target_is_directory=True)
    result = invoke("verify", run_copy)
    assert_fails(result, 1, f"{ckpt(run_copy, 30)}: a symbolic link", "1 fault(s)")
    found, manifest, skipped = Checkpoints(run_copy).newest_whole()
    assert found == ckpt(run_copy, 20) and manifest.global_step == 20
    assert len(skipped) == 1 and "symbolic link" in skipped[0]
    assert invoke("verify", elsewhere).exit_code == 0  # the folder itself, named directly, is whole


@pytest.mark.parametrize("during", [10, 20])
def test_a_run_in_training_verifies_whole(run_copy, monkeypatch, during):
    """``verify`` on a run while it trains: its retention removes step 10 and makes step 20
    layers-only (the manifest first, then the files go) while verify reads step ``during``, which
    finds a listed file gone; a checkpoint being written is a temporary of a process running here.
    None of it is a fault; a temporary whose process is gone still is."""
    store = Checkpoints(run_copy)
    writer = subprocess.Popen(["sleep", "60"])
    try:
        being_written = run_copy / "checkpoints" / f".tmp-step-00000040.{writer.pid}"
        being_written.mkdir()
        real, purged = shard_tools.verify.verify_checkpoint, []

        def read_while_retention_runs(c, **kw):
            if c == ckpt(run_copy, during) and not purged:  # the read began with the manifests as they were
                purged.extend(store.purge(1, set()))
                return [f"{c / HEAD}: missing"]
            return real(c, **kw)

        monkeypatch.setattr(shard_tools.verify, "verify_checkpoint", read_while_retention_runs)
        report = verify_path(run_copy)
        assert purged == [Purged(ckpt(run_copy, 20), removed=False), Purged(ckpt(run_copy, 10), removed=True)]
        assert report.faults == [] and report.writing == [being_written]
        assert report.removed == ([ckpt(run_copy, 10)] if during == 10 else [])
        assert report.checkpoints == [ckpt(run_copy, s) for s in (10, 20, 30) if s != 10 or during != 10]
        monkeypatch.undo()
        result = invoke("verify", run_copy)
        assert result.exit_code == 0, result.output
        assert "2 checkpoint(s)" in result.stdout and f"1 being written or removed ({being_written.name})" in result.stdout
        inspected = invoke("inspect", run_copy)
        assert f"being written or removed by a running process: {being_written}" in inspected.stdout
        assert "stray temporary" not in inspected.stdout
    finally:
        writer.kill()
        writer.wait()
    result = invoke("verify", run_copy)
    assert_fails(result, 1, f"{being_written}: stray temporary", "1 fault(s) in 2 checkpoint(s)")


def test_a_fault_that_stays_is_a_fault_in_a_run_in_training(run_copy):
    """A checkpoint still there with its manifest unchanged is read once: its fault is a fault."""
    (ckpt(run_copy, 20) / HEAD).unlink()
    result = invoke("verify", run_copy)
    assert_fails(result, 1, f"{ckpt(run_copy, 20) / HEAD}: missing", "1 fault(s) in 3 checkpoint(s)")
