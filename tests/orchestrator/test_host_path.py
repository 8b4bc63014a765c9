"""The host path of the handover (#42, ``launch.handover = "host"``; launch/hostpath.py) end to end
on the CPU: the predecessor's fp32 state goes through a file in shared memory, the predecessor lets
go of its engine's memory and writes its checkpoint from that file, the successor reads it into the
host model it prepared; the checkpoints are bitwise those of a run through the checkpoint, and a
process killed before, during or after the write to host memory, or while the successor reads it,
fails the run, and running it again ends bitwise where the uninterrupted run did.

bfloat16, so that a layer's module weights are not its fp32 masters (a frozen layer read from the
wrong source shows); layers sampled again within the pre-warm depth, so that the successor reads
layers that phases after its preload trained from their checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.contract.files import PhaseDir
from tests.conftest import faults_env
from tests.orchestrator.test_handover_run import (
    AGAIN, assert_clean, assert_same_checkpoints, done_records, events, finished, run,
)

pytestmark = pytest.mark.multiprocess
KW = {"phases": AGAIN, "prewarm_depth": 3, "dtype": "bfloat16"}


def shm_left(run_dir: Path) -> list[Path]:
    """The host path's files in shared memory that the run's phases left."""
    return [b for d in (run_dir / "phases").glob("phase-*") for b in PhaseDir(d).blobs()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, tiny_data) -> Path:
    """The five phases through the checkpoint."""
    return finished(tmp_path_factory.mktemp("off"), tiny_model, tiny_data, "cpu", "off", **KW)


def test_the_host_path_gives_the_same_checkpoints(tmp_path, tiny_model, tiny_data, reference):
    """Under a device budget, the phases mapping the holder's copy of the model (launch.resident;
    a memfd here) as on a small GPU: the successor reads only the fp32 state from host memory, its
    layers' weights are the holder's. (The kills below run without the holder.)"""
    host = finished(tmp_path, tiny_model, tiny_data, "cpu", "host", resident="on", device_memory="64GB", **KW)
    assert_same_checkpoints(reference, host)
    rec = done_records(host)
    assert all(r["t_resident_mapped"] < r["t_first_step_end"] for r in rec.values()), rec
    for k in range(1, 5):
        before, after = rec[k - 1], rec[k]
        assert (after["handover"], after["handover_reason"]) == ("host", None), after
        assert (before["handover_taken"], before["handover_answer"]) == (True, "successor"), before
        assert "device_released" in before and before["t_offered"] <= after["t_taken"], before
        assert before["offer_file_ahead"] is True, before  # made after its first step (hostpath.prepare)
        assert after["t_go"] < before["t_gone"]  # the successor went on before its predecessor was gone
    # Phase 3 was preloaded at phase 0's start, phase 4 at phase 1's: their layers 0 and 1 (trained
    # since by phases 0 and 1) come from those checkpoints, read at the go, into the host model; its
    # own layer (phase 3's 0, phase 4's 1) read while it waited instead where that checkpoint was
    # committed before its go (``preload.LayerRefresh``: a matter of timing here).
    for k, own, other in ((3, 0, 1), (4, 1, 2)):
        assert other in rec[k]["layers_at_go"], rec[k]
        assert own in {*rec[k]["layers_at_go"], *rec[k].get("layers_refreshed", [])}, rec[k]
    assert_clean(host)
    assert not shm_left(host)


def test_kills_around_the_host_path_then_a_run_again_is_the_same(tmp_path, tiny_model, tiny_data, reference):
    """One run killed four ways in turn, each time run again from where it stood: the predecessor
    (phase 0) before it writes to host memory, the predecessor (phase 1) while it writes, the
    predecessor (phase 1 again) once written and offered, the successor (phase 3) while it reads."""
    run_dir = tmp_path / "run"
    kills = [({"point": "handover.gathered", "phase": 0}, 0), ({"point": "handover.writing", "phase": 1}, 1),
             ({"point": "handover.offered", "rank": 0}, 1), ({"point": "handover.copying", "phase": 3}, 3)]
    for fault, failed in kills:
        r = run(tmp_path, tiny_model, tiny_data, "cpu", "host", env=faults_env(kill_at=fault), **KW)
        assert r.returncode == 1 and f"phase {failed} " in r.stderr, (fault, r.stderr)
        assert [e["phase"] for e in events(run_dir) if e["event"] == "phase_failed"][-1] == failed
        assert_clean(run_dir, files=False)
        assert not shm_left(run_dir), fault
    again = run(tmp_path, tiny_model, tiny_data, "cpu", "host", **KW)
    assert again.returncode == 0, again.stderr
    assert_same_checkpoints(reference, run_dir)
    assert_clean(run_dir)
    assert not shm_left(run_dir)
