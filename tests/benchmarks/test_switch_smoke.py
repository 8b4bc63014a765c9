"""``benchmarks/switch.py --tiny`` runs all three ways and writes a table, a PNG and numbers; with
``--nproc 2`` relayer alone (the one-process ways are left out, and say so).

About a minute each on 2 idle CPU cores (four phase processes each for relayer and the naive way,
one for inprocess).
"""

from __future__ import annotations

import json
import numbers
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.multiprocess

WAYS = ("relayer", "inprocess", "naive")
PNG = b"\x89PNG\r\n\x1a\n"


def switch(tmp_path: Path, *args: str) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "switch.py"), "--tiny", "--results-dir",
                        str(tmp_path), "--out", "tiny", *args], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((tmp_path / "tiny" / "results.json").read_text())


def check_relayer(result: dict) -> None:
    """Per switch: the go and the successor's readiness; per phase: its waiting memory (or None)."""
    w, bare = result["ways"]["relayer"], result["bare_process"]
    assert bare["uss"] > 0 and bare["cuda"] is False
    for s in w["switches"]:
        assert s["successor_prewarmed"] and isinstance(s["go_sent"], numbers.Real)
        assert isinstance(s["ready_at_go"], bool) and s["late_seconds"] >= 0
    for p in w["phases"][1:]:
        for key in ("uss", "rss"):
            peak = p[f"waiting_{key}_peak"]
            assert peak is None or p[f"waiting_{key}_over_bare"] == peak - bare[key]
    assert result["plan_estimate"]["phase_max"] > 0


def test_tiny_benchmark_writes_table_png_and_numbers(tmp_path: Path):
    result = switch(tmp_path)
    out = tmp_path / "tiny"
    phases = result["shape"]["phases"]
    assert len(phases) >= 2 and all(len(p["layers"]) == 2 for p in phases)
    assert result["shape"]["nproc"] == 1 and not result["notes"]
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
    check_relayer(result)
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
        assert f"\n| {k} | {','.join(map(str, phases[k]['layers']))} |" in table


def test_tiny_benchmark_on_two_processes_runs_relayer_alone(tmp_path: Path):
    result = switch(tmp_path, "--nproc", "2", "--handover", "off", "--layers", "lisa")
    assert result["shape"]["nproc"] == 2 and result["shape"]["handover"] == "off"
    # LISA's order: 2 distinct layers a phase, sampled with the seed (a layer may come back).
    phases = result["shape"]["phases"]
    assert result["shape"]["layer_order"] == "lisa"
    assert all(len(set(p["layers"])) == 2 and p["layers"] == sorted(p["layers"]) for p in phases)
    n = result["shape"]["model"]["num_hidden_layers"]
    rng = random.Random(0)
    assert [p["layers"] for p in phases] == [sorted(rng.sample(range(n), 2)) for _ in phases]
    assert result["shape"]["batch_size"] == 2 * 8  # the shape's batch is a process's
    assert set(result["ways"]) == {"relayer"}
    assert [n.split(" ")[1] for n in result["notes"]] == ["b", "c"]
    check_relayer(result)
    assert len(result["ways"]["relayer"]["steps"]) == sum(p["steps"] for p in result["shape"]["phases"])


def test_tiny_handover_records_each_switch_piece_by_piece(tmp_path: Path):
    """Through the host transport (``handover = "on"``): every switch cut at its go and the
    successor's read of it, the manifests as they came, the page cache and relayer's plan."""
    # every_seconds 0: a checkpoint at every phase end, whose manifests are watched as they come.
    result = switch(tmp_path, "--ways", "a", "--handover", "on", "--layers", "lisa", "--phases", "3",
                    "--every-seconds", "0")
    w = result["ways"]["relayer"]
    gaps = w["switch_gaps"]
    assert [(g["from"], g["to"]) for g in gaps] == [(0, 1), (1, 2)]
    for g in gaps:
        # The journal's time is taken just after the go is written: the successor may read it first.
        assert g["t_last_step_end"] <= g["t_offered"] <= g["t_go"] <= g["t_go_read"] + 0.05
        assert g["t_go_read"] <= g["t_taken"]
        assert set(g["gaps"]) == {"last_step_to_offer", "offer_to_go", "go_to_read", "read_to_taken", "offer_to_taken"}
        assert isinstance(g["causes"], list) and isinstance(g["orchestrator_offer_to_go"], dict)
    ends = sorted(m["global_step"] for m in w["manifests"].values() if m["phase_complete"])
    steps = result["shape"]["phases"][0]["steps"]
    assert ends == [steps * (k + 1) for k in range(3)]
    disk = w["disk"]
    assert disk["checkpoints_written"] == 3 and disk["bytes_written"] == sum(m["bytes"] for m in w["manifests"].values())
    assert 0 < disk["peak_checkpoint_bytes"] <= disk["peak_run_dir_bytes"]
    assert w["meminfo_trace"] and "hands over" in w["plan_text"]
    assert "| 0 -> 1 |" in (tmp_path / "tiny" / "table.md").read_text().split("piece by piece")[1]
