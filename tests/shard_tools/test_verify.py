"""``shard-tools verify``: a one-line summary when whole, each faulty file named and exit 1 otherwise."""

from __future__ import annotations

from shard_tools.verify import verify_path
from tests.shard_tools.conftest import assert_fails, ckpt, flip_byte, invoke


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
    stray = run_copy / "checkpoints" / ".tmp-step-00000040.1234"
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
