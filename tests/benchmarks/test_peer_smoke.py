"""``benchmarks/peer.py --tiny``: the LISA job through the Hugging Face Trainer with a LISA callback
and through relayer, end to end on the CPU, into one results file, a table and a PNG; and the
check of the body's optimizer state tells the two ways apart (the peer keeps it, relayer resets it).

About a minute on 2 idle CPU cores (one Trainer process; relayer's 3 phases and its final model).
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

PNG = b"\x89PNG\r\n\x1a\n"
STEPS = 6


def test_tiny_side_by_side_writes_results_table_png_and_tells_reset_from_kept(tmp_path: Path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer.py"), "--tiny", "--steps", str(STEPS),
                        "--callback", "same-algorithm", "--results-dir", str(tmp_path), "--out", "tiny",
                        "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "tiny"
    result = json.loads((out / "results.json").read_text())
    phases = result["shape"]["phases"]
    assert sum(p["steps"] for p in phases) == STEPS and all(len(p["layers"]) == 2 for p in phases)
    assert result["ways"]["peer"]["callback"]["name"] == "same-algorithm"
    # relayer trained what the peer's callback unfroze, step by step.
    peer_layers = [s["layers"] for s in result["ways"]["peer"]["steps"]]
    assert [s["layers"] for s in result["ways"]["relayer"]["steps"]] == peer_layers
    assert result["ways"]["relayer"]["final_written"] and result["ways"]["relayer"]["model_bytes"] > 0
    assert result["ways"]["peer"]["model_bytes"] > 0
    for name in ("peer", "relayer"):
        w = result["summary"][name]
        assert w["wall_seconds"] > 0 and w["steady_step_seconds"] > 0, name
        assert [s for s, _ in w["loss"]] == list(range(1, STEPS + 1)), name
        assert all(isinstance(v, numbers.Real) for _, v in w["loss"]), name
        assert len(w["memory"]["phases"]) == len(phases) and w["memory"]["peak"] > 0, name
        assert w["trace"] and max(u for _, u in w["trace"]) > 0, name
        assert w["comebacks"], f"{name}: no layer came back (the check would prove nothing)"
    # Where a layer comes back, its Adam step: the peer's counts every step it ever trained, relayer's
    # only its new phase's (and the peer's moments were not zero when it came back).
    assert result["summary"]["peer"]["body_state"] == "kept"
    assert result["summary"]["relayer"]["body_state"] == "reset"
    assert all(c["adam_step_start"] == c["trained_before"] and c["exp_avg_abs_sum_start"] > 0
               for c in result["summary"]["peer"]["comebacks"])
    targets = result["summary"]["targets"]
    assert isinstance(targets["wall_ratio"], numbers.Real) and isinstance(targets["wall_met"], bool)
    for key in ("torch", "transformers", "python", "relayer"):
        assert result["versions"][key]
    assert result["hardware"]["cpu"] and result["date"] and result["command"]

    assert (out / "peer.png").read_bytes().startswith(PNG)
    table = (out / "table.md").read_text()
    assert "| peer |" in table and "| relayer |" in table and "shape.layer_order" in table
    for k, p in enumerate(phases):
        assert f"\n| {k} | {','.join(map(str, p['layers']))} | {p['steps']} |" in table
    assert not (tmp_path / "work" / "relayer").exists(), "relayer's run (checkpoints, final) is removed"
