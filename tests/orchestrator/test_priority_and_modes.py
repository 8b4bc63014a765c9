"""A run started under ``nice -n 5`` trains at 5 (pre-warmed phases prepare lower and come back to
exactly the priority they inherited), and ``run.group_readable`` opens the run folder to the group."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import schedule_dict, write_schedule

pytestmark = pytest.mark.multiprocess


def test_nice_run_trains_at_its_nice_value_and_group_reads(tmp_path, tiny_model, tiny_data):
    phases = [{"steps": 2, "layers": [0]}, {"steps": 2, "layers": [1]}, {"steps": 2, "layers": [2]}]
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data, run={"group_readable": True},
                                                              schedule={"phases": phases}))
    orchestrator = Path(sys.executable).parent / "orchestrator"
    r = subprocess.run(["nice", "-n", "5", str(orchestrator), "run", str(sched)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    records = [json.loads(p.read_text()) for p in sorted(run.glob("phases/phase-*/records.json"))]
    assert [rec["nice"] for rec in records] == [5, 5, 5]
    assert [bool(rec.get("background")) for rec in records] == [False, False, False]  # restored at the go
    assert [("background" in rec) for rec in records] == [False, True, True]  # phases 1, 2 were pre-warmed
    modes = {p.relative_to(run): stat.S_IMODE(p.stat().st_mode) for p in [run, *run.rglob("*")]
             if p.is_dir() or p.is_file() and p.name != "orchestrator.lock"}
    assert {str(p): m for p, m in modes.items() if m != (0o750 if (run / p).is_dir() else 0o640)} == {}
