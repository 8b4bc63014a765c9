"""Space checked first: ``plan`` prints the run directory's peak disk need and its file system's free
space; ``run`` refuses (exit 2, nothing written) where the need exceeds it; a disk that another
writer fills mid-run ends the run with exit 1 within seconds, naming the file system, the earlier
checkpoints intact and no process left. Small tmpfs mounts stand in for small disks (root only).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from orchestrator.estimate import model_config, param_count, trained_head
from orchestrator.plan import plan_phases
from orchestrator.space import disk_need, file_system_of
from orchestrator.validate import load_schedule
from tests.conftest import cli, make_llama, said, schedule_dict, write_schedule


@pytest.fixture
def tmpfs(tmp_path):
    """A function mounting a tmpfs of the given size on a fresh folder; all unmounted after."""
    mounts = []

    def mount(size: str) -> Path:
        where = tmp_path / f"tmpfs-{len(mounts)}"
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root and CAP_SYS_ADMIN): {r.stderr.strip()}")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture(scope="module")
def model16(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("model16") / "llama16", layers=16)


def lisa(model: Path, data: Path, run: Path, phases: int, **sections) -> dict:
    sched = schedule_dict(model, data, **{"run": {"output_dir": str(run)}, **sections})
    sched["schedule"] = {"strategy": "lisa", "total_steps": phases, "interval": 1, "layers_per_phase": 2}
    return sched


def test_plan_prints_the_peak_disk_need_and_the_free_space(tmp_path, model16, tiny_data):
    sched = write_schedule(tmp_path / "s.toml", lisa(model16, tiny_data, tmp_path / "run", 8))
    r = cli("orchestrator", "plan", str(sched))
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("disk: "))
    assert "checkpoints" in line and "data cache" in line and "final model" in line
    assert f"{file_system_of(tmp_path).mount} has " in line and " free" in line
    assert not (tmp_path / "run").exists()


def test_run_on_a_too_small_file_system_is_refused_before_anything_starts(tmp_path, tmpfs, model16, tiny_data):
    """``plan`` exits 2 on it as well (seen: plan exited 0 on a shortfall that run then refused)."""
    disk = tmpfs("256k")
    sched = write_schedule(tmp_path / "s.toml", lisa(model16, tiny_data, disk / "run", 8))
    r = cli("orchestrator", "plan", str(sched))
    assert r.returncode == 2, r.stderr
    assert "more disk space at its peak" in r.stderr and f"{disk} has " in r.stderr, r.stderr
    assert "disk: the run directory needs" in r.stdout  # the plan is printed, then refused
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 2, r.stderr
    assert "more disk space at its peak" in r.stderr and f"{disk} has " in r.stderr and "free" in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr  # one message
    assert os.listdir(disk) == []  # no run directory, no staged data


def fill(disk: Path) -> None:
    """Another writer takes every free byte of ``disk``."""
    with open(disk / "other-writer", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass


@pytest.mark.multiprocess
def test_a_disk_filled_mid_run_ends_it_naming_the_file_system(tmp_path, tmpfs, model16, tiny_data):
    disk = tmpfs("64m")
    run = disk / "run"
    # Cold phases: the disk fills under the orchestrator and a phase writing its checkpoint alike.
    sched = write_schedule(tmp_path / "s.toml", lisa(model16, tiny_data, run, 40, launch={"prewarm": False}))
    orch = subprocess.Popen([str(Path(sys.executable).parent / "orchestrator"), "run", str(sched)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300  # a first phase may build DeepSpeed's CPU extension first
        while len(list((run / "checkpoints").glob("step-*/manifest.json"))) < 2:
            assert orch.poll() is None, said(orch)
            assert time.time() < deadline, "no two checkpoints in 300 s"
            time.sleep(0.05)
        fill(disk)
        filled = time.monotonic()
        _, err = orch.communicate(timeout=60)
        took = time.monotonic() - filled
    finally:
        if orch.poll() is None:
            os.killpg(orch.pid, 9)
    assert orch.returncode == 1, err
    assert took < 20, took
    # Whichever write meets the full disk first: the orchestrator's own (ENOSPC named) or a phase's
    # (its failure adds that its file system is full).
    assert str(disk) in err and ("No space left" in err or f"({disk}) is full: " in err), err
    (disk / "other-writer").unlink()  # room for verify's own reading, none for writing needed
    ckpts = sorted((run / "checkpoints").glob("step-*"))
    assert ckpts
    for ckpt in ckpts:
        r = cli("shard-tools", "verify", str(ckpt))
        assert r.returncode == 0, r.stdout + r.stderr
    assert not left_in_session(orch.pid)


def left_in_session(sid: int) -> list[int]:
    left = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                left.append(p.pid)
        except OSError:
            pass
    return left


def test_every_phase_end_counts_the_waiting_phases_preloads(tmp_path, model16, tiny_data):
    """Where every phase end writes, retention spares each pre-warmed phase's preload, older than
    keep_last with short phases: the need counts launch.prewarm_depth more whole checkpoints (on an
    H200, 1.1B, 2-s phases: five whole at once with keep_last 2 and depth 3)."""
    def need(**launch) -> int:
        sched = write_schedule(tmp_path / "s.toml", lisa(model16, tiny_data, tmp_path / "run", 40, launch=launch))
        loaded = load_schedule(sched)
        return disk_need(loaded, plan_phases(loaded), 0).checkpoints

    cold, one, three = need(prewarm=False), need(prewarm_depth=1), need(prewarm_depth=3)
    assert cold < one < three and three - one == 2 * (one - cold), (cold, one, three)


def test_under_the_cadence_no_more_layer_copies_than_the_run_writes(tmp_path, model16, tiny_data):
    """Where a phase end may write no checkpoint (handed over, ``checkpoint.every_seconds``), the next one
    holds the layers trained since the one before: each phase's layers land in one checkpoint (again in
    each of its mid-phase ones, ``every_steps``, and in a stop's), so the kept checkpoints and the
    layers-only sources together hold no more layer copies than that. Counted as each kept checkpoint
    holding every layer the run trains, 13B's 30 LISA phases needed 210 GiB of disk; so, 113 GiB."""
    def need(phases: int, interval: int, every_steps: int = 0) -> tuple[int, int, int]:
        sched = lisa(model16, tiny_data, tmp_path / "run", phases, launch={"handover": "on"},
                     checkpoint={"every_steps": every_steps, "every_seconds": 300, "keep_last": 2})
        sched["schedule"] |= {"total_steps": phases * interval, "interval": interval}
        loaded = load_schedule(write_schedule(tmp_path / "s.toml", sched))
        count = param_count(model_config(loaded))
        head = trained_head(loaded, count) * 12 * 3  # keep_last 2: three kept whole
        stop = 2 * count.per_layer * 8  # a stop's body moments
        return disk_need(loaded, plan_phases(loaded), 0).checkpoints - head - stop, count.per_layer * 4, phases

    layers, per_layer, phases = need(4, 1)
    assert layers == (phases * 2 + 2) * per_layer  # four phases of two layers, and a stop's two
    layers, per_layer, phases = need(3, 4, every_steps=2)
    assert layers == (phases * 2 * 2 + 2) * per_layer  # each phase's layers at its end and once mid-phase
    layers, _, _ = need(40, 1)
    assert layers < 40 * 2 * per_layer  # 16 layers, each kept checkpoint of all of them and the sources: fewer
