"""A finished run's RUN_DIR/final as hostile input (a link to the user's folder, changed weights, another
run's), its files' modes, and a schedule extended after the run: real runs, two short phases."""

from __future__ import annotations

import json
import shutil
import stat
import tomllib
from pathlib import Path

import pytest

from tests.conftest import cli, make_tokens, schedule_dict, write_schedule
from tests.orchestrator.test_final_and_resume_from import events, make_example_model
from tests.orchestrator.test_run_entries import snapshot

pytestmark = pytest.mark.multiprocess
ONE = [{"steps": 2, "layers": [0]}]
TWO = [*ONE, {"steps": 2, "layers": [1]}]


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """(schedule, run directory, final/'s files as written) of a complete two-phase run."""
    tmp = tmp_path_factory.mktemp("hostile-final")
    model = make_example_model(tmp / "base")  # its tokenizer files are 0644, as the umask made them
    sched = write_schedule(tmp / "s.toml", schedule_dict(model, make_tokens(tmp / "train.jsonl"),
                                                         run={"final_model": True}, schedule={"phases": TWO}))
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    return sched, tmp / "run", snapshot(tmp / "run" / "final")


def written(run: Path) -> int:
    return sum(e["event"] == "final_model_written" for e in events(run))


def test_final_files_have_the_runs_modes(done):
    _, run, _ = done
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (run / "final").iterdir()}
    assert "tokenizer.json" in modes and set(modes.values()) == {0o600}, modes


def test_a_final_linked_to_a_users_folder_is_never_replaced(done, tmp_path):
    sched, run, _ = done
    user = tmp_path / "my-models"
    shutil.copytree(run / "final", user)  # an export, as --force would replace it...
    marker = json.loads((user / "relayer.json").read_text())
    (user / "relayer.json").write_text(json.dumps({**marker, "global_step": 2}))  # ...of another step
    (user / "my-notes.txt").write_text("mine\n")
    aside = run.parent / "final-aside"
    (run / "final").rename(aside)
    (run / "final").symlink_to(user)
    before = snapshot(user)
    try:
        r = cli("orchestrator", "run", str(sched))
        assert r.returncode == 2, r.stderr
        assert f"{run / 'final'}: a symbolic link (to {user})" in r.stderr and "Traceback" not in r.stderr
        assert snapshot(user) == before
    finally:
        (run / "final").unlink()
        aside.rename(run / "final")


@pytest.mark.parametrize("change", ["weights changed", "another run's"])
def test_a_final_that_is_not_this_runs_is_written_again(done, change):
    sched, run, original = done
    final = run / "final"
    if change == "weights changed":
        data = bytearray((final / "model.safetensors").read_bytes())
        data[-1] ^= 1
        (final / "model.safetensors").write_bytes(bytes(data))
    else:
        marker = json.loads((final / "relayer.json").read_text())
        (final / "relayer.json").write_text(json.dumps({**marker, "run": "/elsewhere/run"}))
    n = written(run)
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    assert written(run) == n + 1
    now = snapshot(final)
    assert {k: v for k, v in now.items() if k != "relayer.json"} == {k: v for k, v in original.items()
                                                                     if k != "relayer.json"}


def test_a_complete_runs_own_final_is_kept(done):
    sched, run, _ = done
    n = written(run)
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    assert written(run) == n


def test_a_schedule_extended_after_the_run_goes_on_without_force(tmp_path, tiny_model, tiny_data):
    """Phases appended once a run is under way are the future: accepted, and the run's copy of its
    schedule says so, so that running the extended file again is accepted too."""
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data, schedule={"phases": ONE}))
    run = tmp_path / "run"
    assert cli("orchestrator", "run", str(sched)).returncode == 0
    write_schedule(sched, schedule_dict(tiny_model, tiny_data, schedule={"phases": TWO}))
    for _ in range(2):  # the second go finds the extended schedule as the run's own
        r = cli("orchestrator", "run", str(sched))
        assert r.returncode == 0, r.stderr
    assert tomllib.loads((run / "schedule.toml").read_text())["schedule"]["phases"] == TWO
    changed = [e for e in events(run) if e["event"] == "schedule_changed"]
    assert len(changed) == 1 and "schedule.phases" in changed[0]["differences"][0]
    assert [e["step"] for e in events(run) if e["event"] == "run_done"] == [2, 4, 4]
