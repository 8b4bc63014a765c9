"""``run.report_to = ["wandb"]``: every phase reports to one W&B run, here offline (WANDB_MODE=offline),
its files under RUN_DIR/wandb."""

from __future__ import annotations

import os
import re

import pytest

from launch.report_wandb import run_id
from tests.conftest import cli, schedule_dict, write_schedule

pytestmark = pytest.mark.multiprocess


def test_wandb_offline_run_files(tmp_path, tiny_model, tiny_data):
    pytest.importorskip("wandb")
    phases = [{"steps": 2, "layers": [0]}, {"steps": 2, "layers": [1]}]
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data, run={"report_to": ["wandb"]},
                                                              schedule={"phases": phases}))
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "TMPDIR": str(tmp)}
    r = cli("orchestrator", "run", str(sched), env=env)
    assert r.returncode == 0, r.stderr
    # W&B's media and artifact folders (made at its import, removed at interpreter exit, which a
    # phase's os._exit skips) go with each phase; a hostile trial found tmp*wandb-* piling up.
    assert [p.name for p in tmp.iterdir()] == []
    # Off a terminal the progress is log lines: each start-up stage, then steps with lr and an ETA.
    for stage in ("starting its processes", "starting the process group", "loading the model", "preparing data",
                  "building the engine", "first step"):
        assert f"phase 0: {stage}" in r.stderr
    assert re.search(r"^\d\d:\d\d:\d\d step 4/4  phase 1  layers \[1\]  loss [\d.]+  lr [\d.e+-]+  \d+ tok/s  ETA 0:00$",
                     r.stderr, re.M), r.stderr
    run = tmp_path / "run"
    offline = sorted((run / "wandb").glob(f"offline-run-*-{run_id(run)}"))
    assert len(offline) == 2, sorted(p.name for p in (run / "wandb").iterdir())  # one per phase, one W&B run id
    for d in offline:
        data, = d.glob("run-*.wandb")
        assert data.stat().st_size > 0
