"""``orchestrator report``: a PNG drawn from a real run's metrics and journal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from orchestrator.cli import main
from orchestrator.report import memory_series, read_metrics, read_run


def invoke(*args: str | Path):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    """A copy of the tiny run this test may write into or edit."""
    return Path(shutil.copytree(tiny_run, tmp_path / "run"))


def test_report_of_a_real_run(run_copy):
    r = invoke("report", run_copy)
    assert r.exit_code == 0, r.output
    png = run_copy / "report.png"
    assert r.stdout == f"report written: {png}\n"
    assert png.stat().st_size > 20_000
    image = imread(png)
    assert image.shape[:2] == (1100, 1100)
    colours = np.unique(image.reshape(-1, image.shape[-1]), axis=0)
    # Lines, bars, legend and antialiased text: a blank or one-colour image has a handful at most.
    assert len(colours) > 50
    assert not list(run_copy.glob(".tmp-*"))


def test_report_to_another_file(tiny_run, tmp_path):
    out = tmp_path / "tiny.png"
    for _ in range(2):  # the second replaces the report the first wrote
        r = invoke("report", tiny_run, "--out", out)
        assert r.exit_code == 0, r.output
        assert imread(out).shape[:2] == (1100, 1100)
    assert not (tiny_run / "report.png").exists()


def test_report_replaces_nothing_it_did_not_write(tmp_path):
    """--out names a device, a FIFO, a socket, a link, a folder or someone's file: exit 2 naming it,
    and it stays as it was (the write would replace it); nor are folders made for it. Checked before
    the run is read, so no run is needed."""
    import os
    import socket

    os.mkfifo(tmp_path / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    (tmp_path / "notes.png").write_text("mine")
    (tmp_path / "null").symlink_to("/dev/null")
    (tmp_path / "folder").mkdir()
    for name, says in [("fifo", "a FIFO"), ("sock", "a socket"), ("null", "a symbolic link"),
                       ("folder", "a directory"), ("notes.png", "a file this command did not write"),
                       ("nosuch/dir/r.png", "is not a directory; report makes no folders")]:
        r = invoke("report", tmp_path, "--out", tmp_path / name)
        assert r.exit_code == 2 and says in r.output and str(tmp_path / name) in r.output, (name, r.output)
    assert (tmp_path / "notes.png").read_text() == "mine" and (tmp_path / "null").is_symlink()
    assert not (tmp_path / "nosuch").exists() and os.path.exists("/dev/null")
    sock.close()


def test_what_the_report_plots(tiny_run):
    report = read_run(tiny_run)
    assert list(report.loss) == list(range(1, 31))
    assert [(p.index, p.start_step, p.end_step, p.layers) for p in report.phases] == [
        (0, 0, 10, [0]), (1, 10, 20, [1]), (2, 20, 30, [0])]
    # A switch is measured, positive, and bounded (timings themselves belong to benchmarks/).
    assert sorted(report.switch_seconds) == [1, 2]
    assert all(0 < s < 60 for s in report.switch_seconds.values()), report.switch_seconds
    series = memory_series(report.phases)
    assert set(series) == {"start rss", "engine rss", "peak"}
    assert all(sorted(s) == [0, 1, 2] for s in series.values())


def test_the_report_plots_the_eval_loss_and_the_lr(run_copy, monkeypatch):
    from matplotlib.figure import Figure

    metrics = run_copy / "metrics.jsonl"
    with metrics.open("a") as f:
        for step, value in ((10, 4.5), (20, 4.25), (30, 4.0)):
            f.write(json.dumps({"time": 0.0, "step": step, "phase": step // 10 - 1, "eval_loss": value}) + "\n")
    report = read_run(run_copy)
    assert report.eval_loss == {10: 4.5, 20: 4.25, 30: 4.0}
    assert list(report.lr) == list(range(1, 31)) and set(report.lr.values()) == {1e-3}
    drawn: list[Figure] = []
    saved = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (drawn.append(fig), saved(fig, *a, **kw)))
    assert invoke("report", run_copy).exit_code == 0
    lines = {line.get_label(): line for ax in drawn[0].axes for line in ax.get_lines()}
    assert list(lines["eval loss"].get_xdata()) == [10, 20, 30] and list(lines["eval loss"].get_ydata()) == [4.5, 4.25, 4.0]
    assert list(lines["lr"].get_xdata()) == list(range(1, 31))
    assert list(lines["loss"].get_ydata()) == list(report.loss.values())


def test_a_step_run_twice_keeps_its_last_loss(run_copy):
    metrics = run_copy / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    again = {**json.loads(lines[14]), "loss": 123.0}
    metrics.write_text("\n".join(lines + [json.dumps(again), '{"step": 16, "lo']) + "\n")
    loss = read_metrics(run_copy)
    assert list(loss) == list(range(1, 31))
    assert loss[15] == 123.0


def test_a_switch_across_a_resume_is_not_measured(run_copy):
    journal = run_copy / "journal.jsonl"
    events = [json.loads(line) for line in journal.read_text().splitlines()]
    at = next(i for i, e in enumerate(events) if e["event"] == "phase_started" and e["phase"] == 2)
    events.insert(at, {"time": events[at]["time"], "event": "resumed", "step": 20})
    journal.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert sorted(read_run(run_copy).switch_seconds) == [1]


def test_a_directory_that_is_not_a_run(tmp_path):
    r = invoke("report", tmp_path)
    assert r.exit_code == 2
    assert r.stderr == f"orchestrator: {tmp_path}: not a relayer run directory (no journal.jsonl)\n"
    assert list(tmp_path.iterdir()) == []


def test_a_run_without_steps(run_copy):
    (run_copy / "metrics.jsonl").unlink()
    r = invoke("report", run_copy)
    assert r.exit_code == 2
    assert r.stderr == (f"orchestrator: {run_copy}: no training steps recorded yet "
                        f"({run_copy / 'metrics.jsonl'} is missing or empty)\n")
    assert not (run_copy / "report.png").exists()


def test_json_prints_the_phases_and_draws_nothing(run_copy):
    r = invoke("report", run_copy, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    report = read_run(run_copy)
    assert [(p["index"], p["start_step"], p["end_step"], p["layers"], p["status"]) for p in out["phases"]] == [
        (p.index, p.start_step, p.end_step, p.layers, "done") for p in report.phases]
    assert {p["index"]: p["switch_seconds"] for p in out["phases"] if p["switch_seconds"] is not None} == \
        report.switch_seconds
    assert out["last_event"] == "run_done" and not (run_copy / "report.png").exists()
    both = invoke("report", run_copy, "--json", "--out", run_copy / "r.png")
    assert both.exit_code == 2 and "--out draws the report, --json prints it: give one" in both.stderr
    assert not (run_copy / "r.png").exists()


def test_phases_an_orchestrator_never_journaled_done_are_recovered_at_the_resume(run_copy, tiny_model, tiny_data):
    """The journal as an orchestrator SIGKILLed after phase 1's checkpoint was committed, but before
    it journaled that (``orchestrator.commit``), leaves it: running again journals phases 1 and 2
    done, since the restore point (step 30) is past their ends."""
    from shard_tools.history import read_history
    from tests.conftest import cli, schedule_dict, write_schedule

    journal = run_copy / "journal.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if json.loads(line)["event"] == "checkpoint_committed"
               and json.loads(line)["step"] == 20)
    journal.write_text("".join(lines[:cut]))
    assert [(p.index, p.status) for p in read_history(run_copy).phases] == [(0, "done"), (1, "started"), (2, "started")]
    sched = write_schedule(run_copy.parent / "s.toml", schedule_dict(tiny_model, tiny_data))
    r = cli("orchestrator", "run", str(sched), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "phase 1 done at step 20 (found at the resume: its checkpoint is whole" in r.stderr
    history = read_history(run_copy)
    assert [(p.index, p.status) for p in history.phases] == [(0, "done"), (1, "done"), (2, "done")]
    assert history.last_event == "run_done"
    recovered = [e for e in map(json.loads, journal.read_text().splitlines()) if e.get("recovered")]
    assert [(e["event"], e["phase"], e["step"], e["layers"]) for e in recovered] == [
        ("phase_done", 1, 20, [1]), ("phase_done", 2, 30, [0])]
    r = invoke("report", run_copy)  # a recovered phase has no records nor seconds: still drawn
    assert r.exit_code == 0, r.output


def test_data_and_plan_read_what_the_run_prepared_and_write_nothing(run_copy, tiny_model, tiny_data):
    """``orchestrator data`` and ``plan`` of a schedule whose run has prepared its data read that
    entry (the same key) instead of preparing it again; nothing is written to the run."""
    from tests.conftest import schedule_dict, write_schedule

    sched = write_schedule(run_copy.parent / "s.toml", schedule_dict(tiny_model, tiny_data))
    [stats] = (run_copy / "data-cache").glob("*/stats.json")
    marked = json.loads(stats.read_text())
    marked["train"]["examples"] = 12345  # what only that entry says
    stats.write_text(json.dumps(marked))
    before = sorted((p.relative_to(run_copy), p.stat().st_mtime_ns) for p in run_copy.rglob("*"))
    r = invoke("data", sched, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["train"]["examples"] == 12345
    r = invoke("plan", sched)
    assert r.exit_code == 0, r.output
    assert "data: 12345 examples" in r.stdout
    assert sorted((p.relative_to(run_copy), p.stat().st_mtime_ns) for p in run_copy.rglob("*")) == before


def test_an_interrupted_run_marks_its_stop_and_its_resume(run_copy, monkeypatch):
    """Seen: the report of a run stopped and resumed drew it as one uninterrupted run."""
    from matplotlib.figure import Figure

    journal = run_copy / "journal.jsonl"
    events = [json.loads(line) for line in journal.read_text().splitlines()]
    at = next(i for i, e in enumerate(events) if e["event"] == "phase_started" and e["phase"] == 2)
    events[at:at] = [{"time": events[at]["time"], "event": "preempted", "step": 20, "signal": 2},
                     {"time": events[at]["time"], "event": "resumed", "step": 20}]
    journal.write_text("".join(json.dumps(e) + "\n" for e in events))
    report = read_run(run_copy)
    assert report.stops == [20] and report.resumes == [20]
    drawn: list[Figure] = []
    saved = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **kw: (drawn.append(fig), saved(fig, *a, **kw)))
    assert invoke("report", run_copy).exit_code == 0
    labels = {line.get_label() for ax in drawn[0].axes for line in ax.get_lines()}
    assert {"stopped at step 20", "resumed from step 20"} <= labels
