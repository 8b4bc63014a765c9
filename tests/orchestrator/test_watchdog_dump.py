"""What a stall's message shows of rank 0 when its stacks cannot be had from its own dump (a rank
that does not answer the dump signal; seen on the GPU: its phase folder's disk was full)."""

from __future__ import annotations

import signal
import subprocess
import sys


from launch.contract.files import RANK, PhaseDir
from launch.contract.pids import started
from orchestrator import watchdog

SILENT = "import signal, time; signal.signal(signal.SIGUSR2, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


def test_a_rank_that_writes_no_stacks_is_said_so_with_py_spy_s_or_why_not(tmp_path, monkeypatch):
    rank = subprocess.Popen([sys.executable, "-c", SILENT], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout.readline().strip() == "ready"
        files = PhaseDir(tmp_path)
        files.pids.mkdir(parents=True)
        files.stacks.mkdir(parents=True)
        files.record_pid(f"{RANK}0", rank.pid, started(rank.pid))
        monkeypatch.setattr(watchdog, "DUMP_SECONDS", 0.2)
        monkeypatch.setattr(watchdog.shutil, "which", lambda name: None)  # no py-spy
        folder, frames = watchdog.dump_stacks(tmp_path)
        assert folder == files.stacks
        assert frames.startswith("  (rank 0 wrote no stacks within 0.2 s") and "py-spy is not installed" in frames, frames
        monkeypatch.setattr(watchdog, "NEARLY_FULL", 1 << 62)  # every disk is nearly full
        assert "that file system has" in watchdog.dump_stacks(tmp_path)[1]
    finally:
        rank.send_signal(signal.SIGKILL)
        rank.wait()


def test_no_rank_started(tmp_path):
    assert watchdog.dump_stacks(tmp_path)[1] == "  (no rank had started)"


def test_the_fork_server_ends_where_it_cannot_record_a_rank_s_end(tmp_path):
    """Seen on the H200 with a full disk: the fork server's reaper died writing a rank's exit file,
    no later end was recorded, and the orchestrator waited for phases long gone."""
    (tmp_path / "exit").write_text("")  # where the exit/ folder goes: its mkdir fails, as a full disk's write does
    code = ("import sys; from launch.zygote import Zygote; from launch.contract.files import PhaseDir; "
            "Zygote._record_exit(PhaseDir(sys.argv[1]), 0, 3)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    from launch.contract.files import UNRECORDED
    assert proc.returncode == UNRECORDED, proc.stderr
    assert "could not record the end of rank 0 (exit code 3)" in proc.stderr


def test_a_failure_on_a_full_disk_says_so(tmp_path, monkeypatch):
    from orchestrator import space
    assert space.full_disk(tmp_path) == []
    monkeypatch.setattr(space, "NEARLY_FULL", 1 << 62)
    (line,) = space.full_disk(tmp_path)
    assert line.startswith(f"the file system of {tmp_path} (") and line.endswith(" free")
