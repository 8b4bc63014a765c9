"""The device handover (#18) end to end: a run that hands each phase's state to its pre-warmed
successor gives checkpoints bitwise equal to one that goes through the checkpoint, the phases
overlap as designed, and a process killed anywhere in the choreography fails the run cleanly and
a run again resumes to the same result.

On the CPU the handover goes through a file (``launch.handover = "on"``, the host transport); on
CUDA (``-m cuda``) the same tests run with CUDA IPC (``"auto"``, bfloat16), and the phases map the
holder's weights there (``launch.resident = "auto"``). The references go through the checkpoint,
each phase with its own copy of the model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import psutil
import pytest
import torch

from launch.contract.files import RANK, PhaseDir
from orchestrator.procs import recorded
from shard_tools.checkpoint import load_tensors
from shard_tools.store import Checkpoints
from tests.conftest import cli, faults_env, schedule_dict, write_schedule
from tests.orchestrator.test_handover_plan import CONFIG as TINY_CONFIG
from tests.reference import bitwise_equal, composed

pytestmark = pytest.mark.multiprocess
THREE = [{"steps": 4, "layers": [0]}, {"steps": 4, "layers": [1]}, {"steps": 4, "layers": [0]}]
# Layers 0 and 1 are trained again two phases on: with prewarm_depth 3 their successors were
# preloaded before those layers' last phases ended, so they come from older checkpoints.
AGAIN = [{"steps": 3, "layers": [i]} for i in (0, 1, 2, 0, 1)]
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module", params=[
    "cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")])])
def device(request) -> str:
    return request.param


def handing_over(device: str) -> str:
    """What ``launch.handover`` hands over with on ``device``."""
    return "on" if device == "cpu" else "auto"


def run(tmp: Path, model: Path, data: Path, device: str, handover: str, phases: list[dict] = THREE,
        env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """Runs (or runs again) the schedule in ``tmp``."""
    return cli("orchestrator", "run", str(schedule(tmp, model, data, device, handover, phases, **kw)),
               env={**os.environ, **device_env(device), **(env or {})})


def schedule(tmp: Path, model: Path, data: Path, device: str, handover: str, phases: list[dict] = THREE,
             dtype: str | None = None, checkpoint: dict | None = None, **launch) -> Path:
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    s = schedule_dict(model, data, schedule={"phases": phases}, model={"dtype": dtype},
                      launch={"handover": handover, "prewarm_depth": 1, **launch}, checkpoint=checkpoint or {})
    tmp.mkdir(parents=True, exist_ok=True)
    return write_schedule(tmp / "s.toml", s)


def device_env(device: str) -> dict[str, str]:
    return {"DS_ACCELERATOR": device}


def finished(tmp: Path, *args, **kw) -> Path:
    r = run(tmp, *args, **kw)
    assert r.returncode == 0, r.stderr
    return tmp / "run"


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "journal.jsonl").read_text().splitlines()]


def done_records(run_dir: Path) -> dict[int, dict]:
    return {e["phase"]: e["records"] for e in events(run_dir) if e["event"] == "phase_done"}


def checkpoint_tensors(run_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every committed checkpoint's tensors, by "step-N/file"."""
    return {f"{f.parent.name}/{f.name}": load_tensors(f)
            for f in sorted((run_dir / "checkpoints").glob("step-*/*.safetensors"))}


def assert_same_checkpoints(a: Path, b: Path) -> None:
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    assert ta and ta.keys() == tb.keys(), ta.keys() ^ tb.keys()
    for key in ta:
        assert ta[key].keys() == tb[key].keys(), key
        differ = [n for n in ta[key] if not torch.equal(ta[key][n], tb[key][n])]
        assert not differ, f"{key}: {differ[:5]}"


def leftovers(run_dir: Path) -> list[Path]:
    """Temporaries in the checkpoints folder, and offers' bytes (the host transport's files)."""
    return [*(run_dir / "checkpoints").glob(".tmp-*"), *run_dir.glob("phases/*/handover/*.bin")]


def assert_clean(run_dir: Path, files: bool = True) -> None:
    """No process of the run is left, nor (``files``) a temporary or an offer's bytes."""
    live = [p for d in [*(run_dir / "phases").glob("phase-*"), run_dir / "resident"] for p in recorded(d)]
    _, alive = psutil.wait_procs(live, timeout=10)
    assert not alive, alive
    if files:
        assert not leftovers(run_dir)


def assert_handed_over(run_dir: Path, phases: int) -> None:
    """Every switch handed over: the successor took the state and trained while its predecessor,
    alive, wrote its checkpoint; the predecessor was done only after the successor started."""
    rec = done_records(run_dir)
    assert sorted(rec) == list(range(phases))
    for k in range(1, phases):
        before, after = rec[k - 1], rec[k]
        assert (after["handover"], after["handover_reason"]) == ("device", None), after
        assert (before["handover_taken"], before["handover_answer"]) == (True, "successor"), before
        assert before["t_offered"] <= after["t_taken"] and before["t_answered"] <= before["t_saved"]
        assert after["t_go"] < before["t_gone"]  # the overlap
    order = [(e["event"], e["phase"]) for e in events(run_dir) if e["event"] in ("phase_started", "phase_done")]
    for k in range(phases - 1):
        assert order.index(("phase_done", k)) > order.index(("phase_started", k + 1)), order


# -- the same result ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model, tiny_data, device) -> Path:
    """The three phases through the checkpoint, each with a copy of the model of its own."""
    return finished(tmp_path_factory.mktemp("off"), tiny_model, tiny_data, device, "off", resident="off")


@pytest.fixture(scope="module")
def handed(tmp_path_factory, tiny_model, tiny_data, device) -> Path:
    return finished(tmp_path_factory.mktemp("on"), tiny_model, tiny_data, device, handing_over(device))


def test_handover_gives_the_same_checkpoints(reference, handed):
    assert_same_checkpoints(reference, handed)
    assert_handed_over(handed, 3)
    assert_clean(handed)
    rec = done_records(reference)
    assert all(rec[k].get("handover") is None and "t_offered" not in rec[k] for k in rec)


def test_report_measures_every_switch_handed_over(handed):
    r = cli("orchestrator", "report", str(handed), "--json")
    assert r.returncode == 0, r.stderr
    switches = {p["index"]: p["switch_seconds"] for p in json.loads(r.stdout)["phases"]}
    assert all(isinstance(switches[k], float) for k in (1, 2)), switches


@pytest.fixture(scope="module")
def reference2(tmp_path_factory, tiny_model, tiny_data, device) -> Path:
    """The three phases through the checkpoint, two processes each."""
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    return finished(tmp_path_factory.mktemp("off2"), tiny_model, tiny_data, device, "off", nproc=2, resident="off")


def test_two_processes(tmp_path, tiny_model, tiny_data, device, reference2):
    on = finished(tmp_path, tiny_model, tiny_data, device, handing_over(device), nproc=2)
    assert_same_checkpoints(reference2, on)
    assert_handed_over(on, 3)
    assert_clean(on)


def test_one_rank_not_taken(tmp_path, tiny_model, tiny_data, device, reference2):
    """The successor's rank 1 dies while it copies: the predecessor's rank 1 gets "not taken" from
    the orchestrator (rank 0 too unless the successor's rank 0 answered first), and its rank 0
    writes the checkpoint either way."""
    how = handing_over(device)
    r = run(tmp_path, tiny_model, tiny_data, device, how, nproc=2,
            env=faults_env(kill_at={"point": "handover.copying", "rank": 1}))
    assert r.returncode == 1 and "phase 1 " in r.stderr, r.stderr
    run_dir = tmp_path / "run"
    ev = events(run_dir)
    declined = [(e["phase"], e["ranks"]) for e in ev if e["event"] == "handover_declined"]
    assert declined in ([(0, [1])], [(0, [0, 1])]), declined
    assert [e["phase"] for e in ev if e["event"] == "phase_done"] == [0]
    assert [e["phase"] for e in ev if e["event"] == "phase_failed"] == [1]
    assert_clean(run_dir, files=False)
    again = run(tmp_path, tiny_model, tiny_data, device, how, nproc=2)
    assert again.returncode == 0, again.stderr
    assert_same_checkpoints(reference2, run_dir)
    assert_clean(run_dir)


def test_the_ranks_agree_whether_the_predecessor_writes(tmp_path, tiny_model, tiny_data, device, reference2):
    """Under a cadence (the go says defer) the successor's rank 1 fails its copy at the switch to
    phase 1, as an out-of-memory would, and answers "not taken"; its rank 0, which took the state
    and could keep the carried layers, keeps none: the predecessor's save is collective, and both of
    its ranks write its end checkpoint. The switch to phase 2 carries layer 1 on, as without a fault."""
    fault = faults_env(raise_at={"point": "handover.copying", "phase": 1, "rank": 1})
    run_dir = finished(tmp_path, tiny_model, tiny_data, device, handing_over(device), nproc=2, env=fault,
                       checkpoint={"every_seconds": 3600})
    rec = done_records(run_dir)
    assert (rec[0]["handover_taken"], rec[0]["handover_answer"]) == (True, "successor"), rec[0]
    assert "checkpoint_written" not in rec[0] and rec[1]["handover"] == "device"
    assert "predecessor_wrote" not in rec[1] and "carried_layers" not in rec[1], rec[1]
    assert rec[1]["checkpoint_written"] is False and rec[2]["predecessor_wrote"] is False, rec[2]
    assert [c.name for c in Checkpoints(run_dir).all()] == ["step-00000004", "step-00000012"]
    assert bitwise_equal(composed(tiny_model, run_dir), composed(tiny_model, reference2))
    ours, theirs = checkpoint_tensors(run_dir), checkpoint_tensors(reference2)
    written = [k for k in theirs if k.startswith("step-00000004/")]
    assert written and all(bitwise_equal(ours[k], theirs[k]) for k in written), written
    assert_clean(run_dir)


def test_layers_trained_since_the_preload_come_from_their_checkpoints(tmp_path, tiny_model, tiny_data, device):
    # In bfloat16 a layer's module weights are not its fp32 masters: those must come from the
    # checkpoints written since the successor was preloaded (in float32 they would be the same).
    kw = {"phases": AGAIN, "prewarm_depth": 3, "dtype": "bfloat16"}
    off = finished(tmp_path / "off", tiny_model, tiny_data, device, "off", **kw)
    on = finished(tmp_path / "on", tiny_model, tiny_data, device, handing_over(device), **kw)
    assert_same_checkpoints(off, on)
    assert_handed_over(on, 5)
    assert_clean(on)
    # Phase 3 was preloaded at phase 0's start and phase 4 at phase 1's: layer 0 comes from step 3
    # and layer 1 from step 6, read once: while the phase waited (next test) or, here, where the
    # phase was not waiting yet (phases of 3 steps on a CPU are over before it is), at its go.
    rec = done_records(on)
    for k, layer in ((3, 0), (4, 1)):
        assert sorted(rec[k].get("layers_refreshed", []) + rec[k]["layers_at_go"]) == [layer], rec[k]


def test_layers_trained_while_a_phase_waits_go_on_its_device_before_its_go(tmp_path, tiny_model, tiny_data, device):
    """A layer LISA samples again within prewarm_depth phases is put on the device while its phase
    waits (``preload.LayerRefresh``), as soon as the checkpoint that holds it is committed, not read
    at the go. Every pre-warmed phase holds 3 s before its first step, and no phase pauses the ones
    ahead of it meanwhile, so phases 3 and 4 are ready long before their go."""
    kw = {"phases": AGAIN, "prewarm_depth": 3, "dtype": "bfloat16", "pause_preparing_seconds": 0}
    off = finished(tmp_path / "off", tiny_model, tiny_data, device, "off", **kw)
    on = finished(tmp_path / "on", tiny_model, tiny_data, device, handing_over(device),
                  env=faults_env(hold_first_step=3), **kw)
    assert_same_checkpoints(off, on)
    assert_handed_over(on, 5)
    assert_clean(on)
    rec = done_records(on)
    for k, layer, step in ((3, 0, 3), (4, 1, 6)):
        r = rec[k]
        created = json.loads((on / "checkpoints" / f"step-{step:08d}" / "manifest.json").read_text())["created"]
        assert max(created, r["t_waiting"]) < r["t_go"] - 1.0, r  # the hold did give it time to look
        assert (r.get("layers_refreshed"), r["layers_at_go"]) == ([layer], []), r


def test_auto_on_the_cpu_goes_through_the_checkpoint(tmp_path, tiny_model, tiny_data, reference, device):
    if device != "cpu":
        pytest.skip("the CPU's fallback")
    auto = finished(tmp_path, tiny_model, tiny_data, device, "auto")
    assert_same_checkpoints(reference, auto)
    rec = done_records(auto)
    for k in (1, 2):
        assert rec[k]["handover_refusal"].startswith("no GPU"), rec[k]
        assert "t_taken" not in rec[k] and "t_offered" not in rec[k - 1]
    assert not list(auto.glob("phases/*/handover"))


# -- a process killed during the handover ------------------------------------------------------
@pytest.mark.parametrize("fault, failed", [
    ({"point": "handover.offered", "rank": 0}, 0),
    ({"point": "checkpoint.file_written", "name": "layers.safetensors"}, 0),
    ({"point": "handover.copying", "rank": 0}, 1),
], ids=["predecessor-after-offer", "predecessor-writing", "successor-copying"])
def test_a_kill_fails_the_phase_and_a_run_again_resumes(tmp_path, tiny_model, tiny_data, device, reference,
                                                        fault, failed):
    how = handing_over(device)
    r = run(tmp_path, tiny_model, tiny_data, device, how, env=faults_env(kill_at=fault))
    assert r.returncode == 1 and f"phase {failed} " in r.stderr, r.stderr
    run_dir = tmp_path / "run"
    ev = events(run_dir)
    assert [e["phase"] for e in ev if e["event"] == "phase_failed"] == [failed]
    if failed == 0:  # the successor, which took the state, is stopped: its checkpoints would lack it
        assert any(e["event"] == "successor_stopped" and e["phase"] == 1 for e in ev)
        assert not any(e["event"] == "phase_done" for e in ev)
    else:  # the predecessor is told "not taken" and writes its checkpoint as without a handover
        declined = [e for e in ev if e["event"] == "handover_declined"]
        assert [(e["phase"], e["ranks"]) for e in declined] == [(0, [0])], declined
        assert [e["phase"] for e in ev if e["event"] == "phase_done"] == [0]
    assert_clean(run_dir, files=False)
    assert not leftovers(run_dir), "a failed run leaves temporaries or offered bytes behind"
    again = run(tmp_path, tiny_model, tiny_data, device, how)
    assert again.returncode == 0, again.stderr
    assert_same_checkpoints(reference, run_dir)
    assert_clean(run_dir)


def wait_recorded(phase_dir: Path, orch: subprocess.Popen, what: str) -> list[psutil.Process]:
    """The phase's live ranks on record, once there are any (these schedules run one process)."""
    deadline = time.time() + 300
    while not (ranks := recorded(phase_dir, RANK)):
        assert time.time() < deadline and orch.poll() is None, what
        time.sleep(0.02)
    return ranks


def test_a_successor_gone_before_the_switch_is_not_waited_for(tmp_path, tiny_model, tiny_data, device, reference):
    """The pre-warmed successor dies while it prepares: the orchestrator answers its predecessor
    "not taken" (which then writes its checkpoint) and starts the phase afresh.

    Phase 0 is stopped (SIGSTOP) from its start until the successor's death is on record, so that
    it cannot reach its switch first however the machine schedules the processes."""
    sched = schedule(tmp_path, tiny_model, tiny_data, device, handing_over(device))
    orch = subprocess.Popen([str(Path(sys.executable).parent / "orchestrator"), "run", str(sched)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **device_env(device)})
    run_dir = tmp_path / "run"
    first, second = run_dir / "phases" / "phase-0000", run_dir / "phases" / "phase-0001"
    try:
        running = wait_recorded(first, orch, "phase 0 did not start")
        for p in running:
            p.send_signal(signal.SIGSTOP)
        ranks = wait_recorded(second, orch, "phase 1 was not pre-warmed")
        assert not (first / "handover").exists(), "too late: phase 0 offered"
        for p in ranks:
            p.send_signal(signal.SIGKILL)
        deadline = time.time() + 60
        while PhaseDir(second).read_exit(0) is None:  # the fork server reaped it: the orchestrator sees it gone
            assert time.time() < deadline and orch.poll() is None, "the successor's end was not recorded"
            time.sleep(0.05)
        for p in running:
            p.send_signal(signal.SIGCONT)
        _, err = orch.communicate(timeout=600)
    finally:
        if orch.poll() is None:
            orch.kill()
            orch.wait()
    assert orch.returncode == 0, err
    ev = events(run_dir)
    declined = [e for e in ev if e["event"] == "handover_declined"]
    assert [(e["phase"], e["reason"]) for e in declined] == [(0, "the next phase is not pre-warmed to take it")]
    assert [e["phase"] for e in ev if e["event"] == "prewarm_unused"] == [1]
    rec = done_records(run_dir)
    assert (rec[0]["handover_taken"], rec[0]["handover_answer"]) == (False, "the next phase is not pre-warmed to take it")
    assert rec[2]["handover"] == "device"  # the next switch hands over again
    assert_same_checkpoints(reference, run_dir)
    assert_clean(run_dir)


# -- one copy of the model per device (launch.resident) ------------------------------------------
def test_phases_that_map_the_holders_weights_give_the_same_checkpoints(tmp_path, tiny_model, tiny_data, device,
                                                                      reference2):
    """Two processes, each phase's model the holder's block (a memfd on the CPU, CUDA IPC on a GPU),
    handing over: the checkpoints are those of phases with models of their own, through the
    checkpoint; the offers carry no weights; the holder goes with the run."""
    on = finished(tmp_path, tiny_model, tiny_data, device, handing_over(device), nproc=2, resident="on")
    assert_same_checkpoints(reference2, on)
    assert_handed_over(on, 3)
    assert_clean(on)
    for rank in (0, 1):
        record = json.loads((on / "resident" / f"rank-{rank}.json").read_text())
        assert record["transport"] == ("memfd" if device == "cpu" else "cuda"), record
        assert {"model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight"} <= \
            {t["name"] for t in record["tensors"]}
    for k, r in done_records(on).items():
        assert r["t_resident_mapped"] < r["t_first_step_end"] and r["t_written_back"] <= (r.get("t_offered") or 1e20), r
    offered = [t["name"] for f in on.glob("phases/*/handover/offer-*.json")
               for t in json.loads(f.read_text())["tensors"]]
    assert offered and not [n for n in offered if n.startswith(("module/", "buffer/"))], offered


def test_the_holders_end_fails_the_run_and_a_run_again_resumes(tmp_path, tiny_model, tiny_data, device, reference):
    """The holder is SIGKILLed while phase 0 trains (stopped there, so that the run cannot end first):
    the run exits 1 within seconds naming it, no process is left, and a run again resumes."""
    sched = schedule(tmp_path, tiny_model, tiny_data, device, handing_over(device), resident="on")
    orch = subprocess.Popen([str(Path(sys.executable).parent / "orchestrator"), "run", str(sched)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **device_env(device)})
    run_dir = tmp_path / "run"
    try:
        running = wait_recorded(run_dir / "phases" / "phase-0000", orch, "phase 0 did not start")
        for p in running:
            p.send_signal(signal.SIGSTOP)
        holder = wait_recorded(run_dir / "resident", orch, "no holder")
        for p in holder:
            p.send_signal(signal.SIGKILL)
        t0 = time.time()
        _, err = orch.communicate(timeout=60)
        took = time.time() - t0
    finally:
        if orch.poll() is None:
            orch.kill()
            orch.wait()
    assert orch.returncode == 1 and "the holder of the model's weights (launch.resident" in err, err
    assert "ended by signal SIGKILL" in err and took < 15, (took, err)
    assert any(e["event"] == "holder_failed" for e in events(run_dir))
    assert_clean(run_dir, files=False)
    again = run(tmp_path, tiny_model, tiny_data, device, handing_over(device), resident="on")
    assert again.returncode == 0, again.stderr
    assert_same_checkpoints(reference, run_dir)
    assert_clean(run_dir)


def test_a_phase_killed_writing_back_and_a_run_again_resumes(tmp_path, tiny_model, tiny_data, device, reference):
    """Phase 1 is killed halfway through writing its weights into the holder's block, through the
    checkpoint (launch.handover = "off"): the run fails; a run again builds a new holder from phase
    0's checkpoint and ends with the checkpoints of a run without the holder."""
    fault = faults_env(kill_at={"point": "resident.writing", "phase": 1, "rank": 0})
    r = run(tmp_path, tiny_model, tiny_data, device, "off", resident="on", env=fault)
    assert r.returncode == 1 and "phase 1 " in r.stderr, r.stderr
    run_dir = tmp_path / "run"
    assert [e["phase"] for e in events(run_dir) if e["event"] == "phase_done"] == [0]
    assert_clean(run_dir, files=False)
    again = run(tmp_path, tiny_model, tiny_data, device, "off", resident="on")
    assert again.returncode == 0, again.stderr
    assert_same_checkpoints(reference, run_dir)
    assert_clean(run_dir)
    assert [e["restore"] for e in events(run_dir) if e["event"] == "holder_started"] == \
        [None, str(run_dir / "checkpoints" / "step-00000004")]


@pytest.mark.parametrize("launch, config, why", [
    ({"prewarm": False}, {}, "launch.prewarm = true"),
    ({"device_memory": "24GiB"}, {"model_type": "falcon"}, "launch.device_memory with a model the estimate cannot size"),
], ids=["no-prewarm", "unsized-under-a-budget"])
def test_resident_on_where_it_cannot_be_is_refused(tmp_path, tiny_model, tiny_data, launch, config, why):
    """Under a budget the holder is counted once per device (orchestrator.budget), so the estimate
    must know the model's size: an inline config of a family it does not know cannot be."""
    path = schedule(tmp_path, tiny_model, tiny_data, "cpu", "auto", resident="on", **launch)
    if config:
        raw = tomllib.loads(path.read_text())
        raw["model"] = {"config": {**TINY_CONFIG, **config}, "dtype": "float32"}
        write_schedule(path, raw)
    r = cli("orchestrator", "run", str(path), env={**os.environ, **device_env("cpu")})
    assert r.returncode == 2 and 'launch.resident = "on", but' in r.stderr and why in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()
