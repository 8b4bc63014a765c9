"""Each layer stored once, head and optimizer state never kept for a layer's sake: a LISA run of 60
one-step phases on a 16-layer model ends with checkpoint.keep_last full checkpoints and, beside
them, only the layers files the kept ones compose from; a resume from the older kept checkpoint
(which composes older copies of the layers the newest retrained) ends bitwise equal; verify,
inspect and export read the run as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shard_tools.manifest import HEAD, STATE, read_manifest
from shard_tools.store import Checkpoints
from tests.conftest import cli, make_llama, make_tokens, schedule_dict, write_schedule

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

PHASES, LAYERS_PER_PHASE, KEEP = 60, 2, 2


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_a_long_lisa_run_keeps_each_layer_once_and_resumes_bitwise(tmp_path):
    model = make_llama(tmp_path / "llama16", layers=16)
    data = make_tokens(tmp_path / "train.jsonl")
    sched = schedule_dict(model, data, run={"final_model": True}, checkpoint={"keep_last": KEEP})
    sched["schedule"] = {"strategy": "lisa", "total_steps": PHASES, "interval": 1, "layers_per_phase": LAYERS_PER_PHASE}
    path = write_schedule(tmp_path / "s.toml", sched)
    r = cli("orchestrator", "run", str(path))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"

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
    assert set(ckpts) - set(full) <= needed and len(ckpts) - KEEP <= len(trained) + (KEEP - 1) * LAYERS_PER_PHASE
    for c in set(ckpts) - set(full):
        assert sorted(p.name for p in c.iterdir()) == ["layers.safetensors", "manifest.json"]

    assert cli("shard-tools", "verify", str(run)).returncode == 0
    assert cli("shard-tools", "inspect", str(run)).returncode == 0
    before = weights(run / "final")
    older = full[0]
    r = cli("orchestrator", "run", str(path), "--resume-from", str(older))
    assert r.returncode == 0, r.stderr
    after = weights(run / "final")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
