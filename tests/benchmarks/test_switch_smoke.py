"""``benchmarks/switch.py --tiny`` runs all three ways and writes a table, a PNG and numbers.

About a minute on 2 idle CPU cores (four phase processes each for relayer and the naive way, one for inprocess).
"""

from __future__ import annotations

import json
import numbers
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.multiprocess

WAYS = ("relayer", "inprocess", "naive")
PNG = b"\x89PNG\r\n\x1a\n"


def test_tiny_benchmark_writes_table_png_and_numbers(tmp_path: Path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "switch.py"), "--tiny", "--results-dir",
                        str(tmp_path), "--out", "tiny"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "tiny"
    result = json.loads((out / "results.json").read_text())
    phases = result["shape"]["phases"]
    assert len(phases) >= 2
    assert set(result["ways"]) == set(WAYS)
    for way in WAYS:
        w = result["ways"][way]
        assert isinstance(w["steady_step_seconds"], numbers.Real) and w["steady_step_seconds"] > 0
        assert [p["phase"] for p in w["phases"]] == list(range(len(phases)))
        for p in w["phases"]:
            for key in ("t_first_step_end", "t_last_step_end", "step_seconds_median", "memory_peak"):
                assert isinstance(p[key], numbers.Real), (way, p["phase"], key)
            for key in ("memory_start", "memory_engine"):
                assert p[key]["rss"] > 0, (way, p["phase"], key)
        assert len(w["switches"]) == len(phases) - 1
        assert all(isinstance(s["overhead_seconds"], numbers.Real) for s in w["switches"])
        assert len(w["steps"]) == sum(p["steps"] for p in phases)
    for key in ("torch", "deepspeed", "transformers", "python"):
        assert result["versions"][key]
    assert result["hardware"]["cpu"] and result["date"]

    png = (out / "switch.png").read_bytes()
    assert png.startswith(PNG) and len(png) > 1000

    table = (out / "table.md").read_text()
    for way in WAYS:
        assert f"| {way} |" in table
    for k in range(len(phases) - 1):
        assert f"| {k} -> {k + 1} |" in table
    for k in range(len(phases)):
        assert f"\n| {k} | {phases[k]['layers'][0]} |" in table
