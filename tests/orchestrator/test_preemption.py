"""Kill anything at any moment; running again finishes with exactly the uninterrupted result.

Every run here is real: the orchestrator CLI in its own session, phase workers with DeepSpeed
engines on the CPU, real SIGKILL / SIGTERM, real files damaged on disk.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shard_tools.manifest import read_manifest, verify_checkpoint
from shard_tools.store import Checkpoints
from tests.conftest import alive, cli, faults_env, schedule_dict, truncated_copy, write_schedule
from tests.reference import bitwise_equal, composed, max_abs_diff

pytestmark = pytest.mark.multiprocess
ORCH = str(Path(sys.executable).parent / "orchestrator")
EVERY = 3  # mid-phase checkpoints every 3 steps: kills lose at most 2 steps


def schedule(tmp: Path, model: Path, data: Path, name: str = "s.toml", **sections) -> Path:
    sections.setdefault("checkpoint", {"every_steps": EVERY, "keep_last": 100})
    return write_schedule(tmp / name, schedule_dict(model, data, **sections))


def events(run: Path) -> list[dict]:
    path = run / "journal.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def metrics_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def rank_pids(run: Path) -> list[dict]:
    return [json.loads(f.read_text()) for f in (run / "phases").glob("phase-*/pids/*.json")]


def start(sched: Path, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([ORCH, "run", str(sched)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True, **kw)


def wait_for(cond, timeout: float = 120, what: str = "condition") -> None:
    end = time.time() + timeout
    while not cond():
        if time.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model, tiny_data) -> Path:
    d = tmp_path_factory.mktemp("uninterrupted")
    r = cli("orchestrator", "run", str(schedule(d, tiny_model, tiny_data)))
    assert r.returncode == 0, r.stderr
    return d / "run"


@pytest.fixture(scope="module")
def final(uninterrupted, tiny_model):
    return composed(tiny_model, uninterrupted)


# "cadence": each phase hands its state over (the host transport) and only a stop or the run's end
# writes a checkpoint (checkpoint.every_seconds, #23); a kill then loses everything since the last.
CADENCE = {"launch": {"handover": "on", "prewarm_depth": 1},
           "checkpoint": {"every_steps": EVERY, "keep_last": 100, "every_seconds": 1e6}}


@pytest.mark.parametrize("variant", ["checkpoints", pytest.param("cadence", marks=pytest.mark.slow)])
def test_random_kill_chain_resumes_bitwise(tmp_path, tiny_model, tiny_data, final, variant):
    """12 kills that interrupt a run, at seeded random moments; after each, running again goes on.

    Where a run completes before the next kill (fast machines), its result is checked and a new
    run starts the next chain, so every kill lands on live work.
    """
    rng = random.Random(1234)
    kinds = ["worker_sigkill", "write_sigkill", "orchestrator_sigkill", "orchestrator_sigterm"] * 3
    rng.shuffle(kinds)
    sched = schedule(tmp_path, tiny_model, tiny_data, **(CADENCE if variant == "cadence" else {}))
    run = tmp_path / "run"
    interrupted, chains, attempts = [], 0, 0

    def finish_chain() -> None:
        r = cli("orchestrator", "run", str(sched))
        assert r.returncode == 0, r.stderr
        assert bitwise_equal(composed(tiny_model, run), final)
        ev = {e["event"] for e in events(run)}
        assert "resumed" in ev, ev

    while len(interrupted) < len(kinds):
        attempts += 1
        assert attempts <= 3 * len(kinds), interrupted
        kind = kinds[len(interrupted)]
        if any(e["event"] == "run_done" for e in events(run)):
            finish_chain()
            shutil.rmtree(run)
            chains += 1
        before = metrics_steps(run)
        # Files every checkpoint has, so the kill comes at the attempt's first write.
        env = faults_env(kill_after=rng.choice(["head.safetensors", "layers.safetensors", "state.safetensors"])) \
            if kind == "write_sigkill" else None
        orch = start(sched, env)
        if kind != "write_sigkill":
            wait_for(lambda: metrics_steps(run) >= before + rng.randint(1, 3) or orch.poll() is not None,
                     what="training steps")
        if kind == "worker_sigkill":
            for r in [r for r in rank_pids(run) if alive(r)]:
                os.kill(r["pid"], signal.SIGKILL)
        elif kind == "orchestrator_sigkill":
            orch.kill()
        elif kind == "orchestrator_sigterm":
            orch.terminate()
        rc = orch.wait(timeout=120)
        _, err = orch.communicate()
        if rc != 0:
            interrupted.append(kind)
        if kind == "orchestrator_sigterm" and rc != 0:
            assert rc == 75, err
            assert events(run)[-1]["event"] == "preempted"
        if kind in ("worker_sigkill", "write_sigkill") and rc != 0:
            assert rc == 1 and "failed" in err, err
        # Whatever died, no process of the run may outlive it for long (watchdog, parent-death signal).
        wait_for(lambda: not any(alive(r) for r in rank_pids(run)), timeout=10, what="workers to die")
    finish_chain()
    assert sorted(interrupted) == sorted(kinds)


def test_a_stop_is_the_journals_last_word_after_a_late_commit(tmp_path, tiny_model, tiny_data, monkeypatch):
    """A SIGTERM while the finished phase's fsync (``orchestrator.commit``) still runs: that phase
    is journaled done, and ``preempted`` comes after it, last (CI caught ``device_after_phase``
    journaled after ``preempted``)."""
    import threading

    import orchestrator.commit as commit
    from orchestrator.errors import Preempted
    from orchestrator.runner import run_schedule
    from orchestrator.validate import load_schedule

    stopping = threading.Event()
    durable = commit.make_durable

    def late(ckpt):  # returns only once the phase after it is being stopped
        stopping.wait(120)
        durable(ckpt)

    def on_event(e: dict) -> None:
        if e["event"] == "phase_started" and e["phase"] == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the runner's own handler takes it
        elif e["event"] == "stop_requested":
            stopping.set()

    monkeypatch.setattr(commit, "make_durable", late)
    with pytest.raises(Preempted):
        run_schedule(load_schedule(schedule(tmp_path, tiny_model, tiny_data)), on_event=on_event)
    names = [(e["event"], e.get("phase")) for e in events(tmp_path / "run")]
    assert names[-1] == ("preempted", 1), names
    assert ("phase_done", 0) in names and ("device_after_phase", 0) in names, names


def test_two_processes_preempt_and_resume(tmp_path, tiny_model, tiny_data, final):
    """Two ranks stopped twice and resumed end as one uninterrupted process does (the same
    schedule; its batch split over two ranks changes no sum on this model: bitwise equal on the
    CPU, 1e-6 allowed). The first stop reaches them through the deepspeed runner; the second stop and
    the end run them forked by the run's fork server (``launch.*`` may change on a resume), each run
    of the runner costing some 25 s of CPU here (a cold start of the runner and each rank a phase)."""
    runner = schedule(tmp_path, tiny_model, tiny_data, "runner.toml",
                      launch={"launcher": "deepspeed", "nproc": 2, "grace_seconds": 20})
    forked = schedule(tmp_path, tiny_model, tiny_data, launch={"launcher": "local", "nproc": 2, "grace_seconds": 20})
    run = tmp_path / "run"
    for sched, target in ((runner, 12), (forked, 24)):
        orch = start(sched)
        wait_for(lambda: metrics_steps(run) >= target, what=f"step {target}")
        orch.terminate()
        assert orch.wait(timeout=120) == 75, orch.communicate()[1]
        assert not any(alive(p) for p in rank_pids(run))
        forks = any(e["event"] == "zygote_started" for e in events(run))
        assert forks == (sched == forked) and (sched == forked or (run / "phases/phase-0001/pids/launcher.json").exists())
    r = cli("orchestrator", "run", str(forked))
    assert r.returncode == 0, r.stderr
    assert {read_manifest(c).world_size for c in Checkpoints(run).all()} == {2}
    assert max_abs_diff(composed(tiny_model, run), final) <= 1e-6


def test_stage_0_stopped_mid_phase_resumes_bitwise(tmp_path, tiny_model, tiny_data):
    """relayer's own optimizer (``deepspeed.zero_stage = 0``): a stop mid-phase writes the body's
    moments and step beside the head's; the resume restores them and ends bitwise as one run. The
    stop is a SIGHUP (the terminal closed), which stops as SIGTERM does (seen: it killed the run,
    the steps since the last checkpoint lost). The checkpoint the stop named stays until the run's
    end (seen: "kept: step 25", which retention removed after the resume)."""
    sections = {"deepspeed": {"zero_stage": 0}}
    whole = schedule(tmp_path, tiny_model, tiny_data, "whole.toml", run={"output_dir": "whole", "seed": 0,
                                                                          "final_model": False}, **sections)
    r = cli("orchestrator", "run", str(whole))
    assert r.returncode == 0, r.stderr
    sched = schedule(tmp_path, tiny_model, tiny_data, checkpoint={"every_steps": EVERY, "keep_last": 1}, **sections)
    run = tmp_path / "run"
    # Each micro-batch waits 0.1 s: at full speed phase 1's last 6 steps took less than the stop's way
    # to the ranks, and it landed at the switch, not mid-phase (CI, 2026-12-06).
    orch = start(sched, env=faults_env(hold_at={"point": "data.micro_batch", "seconds": 0.1}))
    wait_for(lambda: metrics_steps(run) >= 14, what="step 14")
    orch.send_signal(signal.SIGHUP)
    _, err = orch.communicate(timeout=120)
    assert orch.returncode == 75, err
    stop = [e for e in events(run) if e["event"] == "preempted"][-1]
    assert stop["signal"] == signal.SIGHUP and f"kept: the checkpoint at step {stop['step']} (" in err
    mid = [read_manifest(c) for c in Checkpoints(run).all() if not read_manifest(c).phase_complete]
    assert mid and mid[-1].phase == 1 and mid[-1].body_step == mid[-1].global_step - 10
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    assert bitwise_equal(composed(tiny_model, run), composed(tiny_model, tmp_path / "whole"))
    after = [e["event"] for e in events(run) if e.get("path") == stop["checkpoint"] or e["event"] == "run_done"]
    assert after == ["run_done", "checkpoint_removed"], after  # kept until the run's end named another


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


@pytest.mark.parametrize("damage", ["truncated", "flipped_byte", "missing_manifest", "temp_dir_left"])
def test_damaged_newest_checkpoint_is_skipped(tmp_path, uninterrupted, tiny_model, final, damage):
    run = truncated_copy(uninterrupted, tmp_path / "run", keep_upto=21)
    newest = run / "checkpoints" / "step-00000021"
    if damage == "truncated":
        f = newest / "head.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "flipped_byte":
        flip_byte(newest / "layers.safetensors")
    elif damage == "missing_manifest":
        (newest / "manifest.json").unlink()
    else:
        shutil.copytree(newest, run / "checkpoints" / ".tmp-step-00000024.12345")
    if damage != "temp_dir_left":
        faults = verify_checkpoint(newest)
        assert faults and str(newest) in faults[0]
        r = cli("shard-tools", "verify", str(newest))
        assert r.returncode == 1 and str(newest) in r.stdout + r.stderr
    sched = run / "schedule.toml"
    r = cli("orchestrator", "run", str(sched), "--output-dir", str(run))
    assert r.returncode == 0, r.stderr
    assert bitwise_equal(composed(tiny_model, run), final)
    ev = events(run)
    if damage == "temp_dir_left":
        assert any(e["event"] == "stray_removed" for e in ev)
        assert not list((run / "checkpoints").glob(".tmp-*"))
    else:
        resumed = [e for e in ev if e["event"] == "resumed"][-1]
        assert resumed["checkpoint"].endswith("step-00000020")
        assert any(e["event"] == "checkpoint_skipped" for e in ev)
        # Nothing is deleted on the way: the damaged checkpoint was moved aside, not removed.
        assert list((run / "checkpoints").glob("step-00000021.damaged-*"))


def test_disk_full_keeps_previous_checkpoint(tmp_path, uninterrupted):
    run = truncated_copy(uninterrupted, tmp_path / "run", keep_upto=10)

    def limit():  # files over 40 kB cannot grow: the head file (~75 kB) hits it
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    r = subprocess.run([ORCH, "run", str(run / "schedule.toml"), "--output-dir", str(run)], capture_output=True,
                       text=True, preexec_fn=limit, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "could not write the checkpoint" in r.stderr and "earlier checkpoints are intact" in r.stderr
    assert [read_manifest(c).global_step for c in Checkpoints(run).all()] == [3, 6, 9, 10]
    assert all(not verify_checkpoint(c) for c in Checkpoints(run).all())
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_second_orchestrator_is_refused(tmp_path, tiny_model, tiny_data):
    sched = schedule(tmp_path, tiny_model, tiny_data)
    run = tmp_path / "run"
    first = start(sched)
    wait_for(lambda: any(e["event"] == "phase_started" for e in events(run)), what="first phase")
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 1
    assert f"another orchestrator (pid {first.pid}) is running this run" in r.stderr
    first.terminate()
    assert first.wait(timeout=120) == 75
    r = cli("orchestrator", "status", str(run))
    assert r.returncode == 0 and "preempted" in r.stdout


def test_changed_schedule_is_refused_unless_it_only_changes_the_future(tmp_path, uninterrupted, tiny_model, tiny_data):
    run = truncated_copy(uninterrupted, tmp_path / "run", keep_upto=20)
    changed = schedule(tmp_path, tiny_model, tiny_data, "lr.toml", optimizer={"lr": 2e-3})
    r = cli("orchestrator", "run", str(changed), "--output-dir", str(run))
    assert r.returncode == 2
    assert "optimizer.lr: 0.001 -> 0.002" in r.stderr and "--force" in r.stderr
    phases = [{"steps": 10, "layers": [0]}, {"steps": 10, "layers": [1]}, {"steps": 10, "layers": [0]},
              {"steps": 4, "layers": [3]}]
    longer = schedule(tmp_path, tiny_model, tiny_data, "longer.toml", schedule={"phases": phases})
    r = cli("orchestrator", "run", str(longer), "--output-dir", str(run))
    assert r.returncode == 0, r.stderr
    assert read_manifest(Checkpoints(run).all()[-1]).global_step == 34


def test_retention_keeps_what_kept_checkpoints_need(tmp_path, tiny_model, tiny_data, final):
    sched = schedule(tmp_path, tiny_model, tiny_data, checkpoint={"every_steps": EVERY, "keep_last": 2})
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    # The last two, and step 20: the newest weights of layer 1, which step 30's model is made of,
    # its layers file alone (no head nor state kept for its layers' sake).
    ckpts = Checkpoints(run).all()
    assert [read_manifest(c).global_step for c in ckpts] == [20, 27, 30]
    assert [read_manifest(c).layers_only for c in ckpts] == [True, False, False]
    assert sorted(p.name for p in ckpts[0].iterdir()) == ["layers.safetensors", "manifest.json"]
    assert bitwise_equal(composed(tiny_model, run), final)
    r = cli("orchestrator", "status", str(run))
    assert r.returncode == 0 and "done" in r.stdout


def test_damaged_older_layer_source_is_not_silently_replaced(tmp_path, uninterrupted, tiny_model, final):
    """Step 20's layer 0 comes from step 10; with step 10's layers file damaged, steps 12-20 cannot
    be composed (falling back to the base layer 0 would be wrong) and the run resumes from step 9."""
    run = truncated_copy(uninterrupted, tmp_path / "run", keep_upto=20)
    # Truncated: a size check alone already tells, and must not make the checkpoint disappear.
    f = run / "checkpoints" / "step-00000010" / "layers.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    r = cli("orchestrator", "run", str(run / "schedule.toml"), "--output-dir", str(run))
    assert r.returncode == 0, r.stderr
    resumed = [e for e in events(run) if e["event"] == "resumed"][-1]
    assert resumed["checkpoint"].endswith("step-00000009")
    assert bitwise_equal(composed(tiny_model, run), final)
