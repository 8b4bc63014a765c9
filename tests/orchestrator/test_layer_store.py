"""Each layer stored once, head and optimizer state never kept for a layer's sake: a LISA run of 60
one-step phases on a 16-layer model ends with checkpoint.keep_last full checkpoints and, beside
them, only the layers files the kept ones compose from; a resume from the older kept checkpoint
(which composes older copies of the layers the newest retrained) ends bitwise equal; verify,
inspect and export read the run as before. The bookkeeping keeps up meanwhile: phases of one step
are nearly always switching, and the journal and retention keep pace all the same
(``orchestrator.commit.BEHIND_PHASES``): an orchestrator killed at any moment has journaled all
but the last few phases done, and the checkpoints never pile up.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from orchestrator.commit import BEHIND_PHASES
from orchestrator.rundir import KEEP_PHASE_DIRS
from shard_tools.history import read_journal
from shard_tools.manifest import HEAD, STATE, read_manifest
from shard_tools.store import Checkpoints
from tests.conftest import cli, make_llama, make_tokens, schedule_dict, write_schedule

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

PHASES, LAYERS_PER_PHASE, KEEP = 60, 2, 2


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def journal_lag(run: Path) -> int:
    """Phases started but not yet journaled done."""
    return sum({"phase_started": 1, "phase_done": -1}.get(e["event"], 0) for e in read_journal(run))


def watched_run(path: Path, run: Path) -> tuple[subprocess.CompletedProcess, int, int]:
    """``orchestrator run``, and the most phases it ever had not journaled done and the most
    checkpoint folders there ever were, looked at every 0.1 s."""
    worst = [0, 0]
    done = threading.Event()

    def look() -> None:
        while not done.wait(0.1):
            worst[0] = max(worst[0], journal_lag(run))
            worst[1] = max(worst[1], len(list(run.glob("checkpoints/step-*"))))

    watcher = threading.Thread(target=look, daemon=True)
    watcher.start()
    try:
        r = subprocess.run([str(Path(sys.executable).parent / "orchestrator"), "run", str(path)], capture_output=True,
                           text=True, timeout=1200)
    finally:
        done.set()
        watcher.join()
    return r, *worst


def test_a_long_lisa_run_keeps_each_layer_once_and_resumes_bitwise(tmp_path):
    model = make_llama(tmp_path / "llama16", layers=16)
    data = make_tokens(tmp_path / "train.jsonl")
    sched = schedule_dict(model, data, run={"final_model": True}, checkpoint={"keep_last": KEEP})
    sched["schedule"] = {"strategy": "lisa", "total_steps": PHASES, "interval": 1, "layers_per_phase": LAYERS_PER_PHASE}
    path = write_schedule(tmp_path / "s.toml", sched)
    run = tmp_path / "run"
    r, lag, most = watched_run(path, run)
    assert r.returncode == 0, r.stderr
    # The phase training, BEHIND_PHASES waiting, and those whose fsyncs are under way (a few on a loaded
    # machine); before the journal kept up during switches, 46 of 60 piled up.
    assert lag <= BEHIND_PHASES + 6, lag

    store = Checkpoints(run)
    ckpts = store.all()
    manifests = {c: read_manifest(c) for c in ckpts}
    full = [c for c in ckpts if not manifests[c].layers_only]
    assert full == ckpts[-KEEP:] and len(list(run.glob(f"checkpoints/*/{HEAD}"))) == KEEP
    assert len(list(run.glob(f"checkpoints/*/{STATE}"))) == KEEP
    needed = {src for c in full for src in store.layer_sources(c).values()}
    trained = {layer for m in manifests.values() for layer in m.layers}
    # Beside the full ones: only layers files a kept checkpoint composes from: one for each layer's
    # newest copy, and the older copies of the layers the newest retrained, which the older kept one composes.
    bound = KEEP + len(trained) + (KEEP - 1) * LAYERS_PER_PHASE
    assert set(ckpts) - set(full) <= needed and len(ckpts) <= bound
    assert most <= bound + BEHIND_PHASES + 6, (most, bound)
    # The exact bound: each of them holds only the layers a kept checkpoint composes from it.
    wanted: dict[Path, set[int]] = {}
    for c in full:
        for layer, src in store.layer_sources(c).items():
            wanted.setdefault(src, set()).add(layer)
    for c in set(ckpts) - set(full):
        m = manifests[c]
        assert sorted(p.name for p in c.iterdir()) == sorted([m.layers_name, "manifest.json"])
        assert sorted(m.stored_layers) == sorted(wanted[c]), (c, m.stored_layers, wanted[c])
    assert any(m.kept_layers is not None for m in manifests.values())  # some were trimmed

    assert cli("shard-tools", "verify", str(run)).returncode == 0
    assert cli("shard-tools", "inspect", str(run)).returncode == 0
    # phases/ keeps the last phases' folders only, and report still has every phase (from the journal).
    assert sorted(p.name for p in (run / "phases").iterdir()) == [
        f"phase-{i:04d}" for i in range(PHASES - KEEP_PHASE_DIRS, PHASES)]
    report = cli("orchestrator", "report", "--json", str(run))
    assert report.returncode == 0 and len(json.loads(report.stdout)["phases"]) == PHASES, report.stderr
    before = weights(run / "final")
    older = full[0]
    r = cli("orchestrator", "run", str(path), "--resume-from", str(older))
    assert r.returncode == 0, r.stderr
    after = weights(run / "final")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
