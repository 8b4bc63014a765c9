"""Random damage to the layer store (#23): a layers-only checkpoint, kept by retention for its
layers alone, damaged as ``test_fuzz`` damages a whole one (bytes, headers, manifest fields, file
kinds; seeded). Reading stays clean and changes nothing, and a full checkpoint that composes from
a damaged source is never restored from or exported: skipping the source would compose an older
copy of the layer, or the base model's, silently."""

from __future__ import annotations

import random
import stat
from pathlib import Path

import pytest

from shard_tools.errors import CheckpointError
from shard_tools.manifest import read_manifest, verify_checkpoint
from shard_tools.store import Checkpoints
from tests.conftest import cli, schedule_dict, write_schedule
from tests.shard_tools.conftest import invoke
from tests.shard_tools.test_fuzz import _clean, copied, damage, read_cleanly
from tests.trees import snapshot
STORE_CASES = 60
"""Cases on the layer store: checkpoints that retention kept for their layers alone (#23)."""


@pytest.fixture(scope="module")
def store_run(tmp_path_factory, tiny_model, tiny_data) -> Path:
    """A LISA run with checkpoint.keep_last 1: one full checkpoint, which composes its layers from
    layers-only ones (manifest and layers file alone) that retention kept for them."""
    d = tmp_path_factory.mktemp("store-run")
    s = schedule_dict(tiny_model, tiny_data, checkpoint={"keep_last": 1})
    s["schedule"] = {"strategy": "lisa", "total_steps": 8, "interval": 1, "layers_per_phase": 1}
    r = cli("orchestrator", "run", str(write_schedule(d / "s.toml", s)))
    assert r.returncode == 0, r.stderr
    run = d / "run"
    assert sum(read_manifest(c).layers_only for c in Checkpoints(run).all()) >= 2
    return run


@pytest.mark.parametrize("seed", range(STORE_CASES))
def test_damaged_layer_store(seed, store_run, tmp_path):
    """A layers-only checkpoint damaged: every command clean and nothing changed by reading, as
    above; and where the damage shows, the full checkpoint that composes from it is no longer a
    restore point and does not export, since skipping the source would compose an older layer."""
    rng = random.Random(seed)
    run, elsewhere = copied(store_run, tmp_path)
    checkpoints = Checkpoints(run).all()
    full = checkpoints[-1]
    original = {l: s.name for l, s in Checkpoints(run).layer_sources(full).items()}
    sources = set(Checkpoints(run).layer_sources(full).values()) - {full}
    target = rng.choice(sorted(sources))
    what = f"seed {seed}: {target.name} (layers only): {damage(rng, target, elsewhere)}"
    before = snapshot(run)
    fifo = any(stat.S_ISFIFO(p.lstat().st_mode) for p in target.iterdir())
    for args in (["verify", run], ["verify", target], ["inspect", run], ["inspect", "--json", run],
                 ["diff", target, full]):
        read_cleanly(args, fifo, what)
    exported = invoke("export", full, "--out", tmp_path / "out") if not fifo else None
    if exported is not None:
        _clean(exported, f"{what}: export")
    assert snapshot(run) == before, what

    damaged = bool(verify_checkpoint(target))
    try:
        point = Checkpoints(run).restore_point().path
    except CheckpointError as e:  # a recorded source lost, and no older restore point: a damaged run
        assert damaged and "a damaged run" in str(e), (what, e)
        point = None
    if not damaged:  # damage verify cannot see must not change what the full checkpoint composes
        assert {l: s.name for l, s in Checkpoints(run).layer_sources(full).items()} == original, what
    assert point == (None if damaged else full), what
    if exported is not None:
        assert exported.exit_code == (1 if damaged else 0), (what, exported.output)
