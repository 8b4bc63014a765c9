"""``--set section.key=value`` on ``plan`` and ``run``: validated like the file, recorded in the
run's schedule copy."""

from __future__ import annotations

import tomllib

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from orchestrator.rundir import SCHEDULE_COPY
from orchestrator.runner import Runner
from orchestrator.validate import load_schedule
from tests.conftest import schedule_dict, write_schedule
from tests.orchestrator.test_cli_plan import table_rows


@pytest.fixture
def sched(tmp_path, tiny_model, tiny_data):
    return write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data))


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def test_plan_applies_overrides(sched):
    r = invoke("plan", str(sched), "--set", "schedule.phases[0].steps=5", "--set", "schedule.phases[1].layers=[2, 3]")
    assert r.exit_code == 0, r.output
    assert table_rows(r.stdout)[:2] == [["0", "5", "0-4", "0", "1"], ["1", "10", "5-14", "2, 3", "1"]]


@pytest.mark.parametrize("command", ["run", "plan", "data"])
@pytest.mark.parametrize("item, message", [
    ("optimizer.lrr=3e-4", "optimizer.lrr: unknown key (did you mean lr?)"),
    ("optimizer.lr=-1", "optimizer.lr: expected a positive number, got -1"),
    ("model.dtype=float8", "model.dtype: expected 'float32', 'bfloat16' or 'float16', got 'float8'"),
    ("data.batch_size=7", "data.batch_size: expected a multiple of micro_batch_size x processes"),
    ("schedule.phases[0].layers=[9]", "schedule.phases[0].layers: layer 9 is out of range"),
    ("schedule.strategy=lisa", "schedule.strategy: expected either schedule.phases or schedule.strategy"),
    ("schedule.phases[7].steps=5", "schedule.phases has 3 item(s), so there is no schedule.phases[7]"),
    ("optimizer.lr", "expected KEY=VALUE, such as optimizer.lr=3e-4"),
])
def test_bad_override_exits_2_naming_the_set_and_writes_nothing(command, item, message, sched, tmp_path):
    """The --set is to blame, not the schedule file, which may be fine as it stands."""
    r = invoke(command, str(sched), "--set", item)
    assert r.exit_code == 2, r.output
    assert f"orchestrator: --set {item}: " in r.stderr and message in r.stderr, r.stderr
    assert str(sched) not in r.stderr
    assert not (tmp_path / "run").exists()


def test_a_bad_key_of_the_file_still_names_the_file_beside_a_set(tmp_path, tiny_model, tiny_data):
    bad = write_schedule(tmp_path / "bad.toml", schedule_dict(tiny_model, tiny_data, optimizer={"lr": -1}))
    r = invoke("plan", str(bad), "--set", "optimizer.eps=1e-6")
    assert r.exit_code == 2 and f"{bad}: optimizer.lr: expected a positive number" in r.stderr, r.stderr


def test_run_records_the_merged_schedule(sched):
    loaded = load_schedule(sched, overrides=["optimizer.lr=3e-4", "model.dtype=bfloat16",
                                             "schedule.phases[0].steps=5"])
    Runner(loaded)._prepare_run_dir()
    copy = tomllib.loads((loaded.output_dir / SCHEDULE_COPY).read_text())
    assert copy == loaded.raw
    assert (copy["optimizer"]["lr"], copy["model"]["dtype"], copy["schedule"]["phases"][0]["steps"]) == (
        3e-4, "bfloat16", 5)


def test_run_without_overrides_copies_the_file_as_written(sched):
    loaded = load_schedule(sched)
    Runner(loaded)._prepare_run_dir()
    assert (loaded.output_dir / SCHEDULE_COPY).read_text() == sched.read_text()
