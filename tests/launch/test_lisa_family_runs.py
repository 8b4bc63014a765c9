"""The LISA family's runs (issue 46) equal the independent plain-PyTorch reference
(``tests.reference``), which takes explicit phases: a strategy reduces to its phase table
(``orchestrator plan``'s, checked against the run's manifests), the optimizer-state policy and the
warm-up after each switch are the reference's own.

One run per variant, several checks on each: BAdam's block walk with its "drop-all" policy and a
warm-up after each switch on one process (ZeRO-2, each switch through the checkpoint), then stopped
mid-phase and resumed (bitwise); weighted, windowed lisa with "drop-all" on two processes of
relayer's own optimizer (ZeRO 0) handing each phase's state over (through the host here); and
"keep" (each layer's Adam state parked in the checkpoint between its visits) on one process of
relayer's own optimizer, killed mid-phase and resumed (bitwise), and on two of ZeRO-2 (one in
between).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from orchestrator.plan import plan_phases
from orchestrator.validate import load_schedule
from shard_tools.manifest import read_manifest
from shard_tools.store import Checkpoints
from shard_tools.state import kept_state
from tests.conftest import cli, faults_env, killed_then_rerun, schedule_dict, truncated_copy, write_schedule
from tests.reference import bitwise_equal, composed, max_abs_diff, reference_run

TOL = 1e-5  # tests/launch/test_equivalence.py says why
WARMUP = 2

pytestmark = pytest.mark.multiprocess


def strategy_schedule(path: Path, model_dir: Path, data_path: Path, schedule: dict, **sections) -> Path:
    raw = schedule_dict(model_dir, data_path, lr_schedule={"phase_warmup_steps": WARMUP},
                        schedule={"phases": None, "total_steps": 30, "interval": 5, "layers_per_phase": 1,
                                  "optimizer_state": "drop-all", **schedule}, **sections)
    del raw["schedule"]["phases"]
    return write_schedule(path, raw)


def planned(sched: Path) -> list[tuple[int, list[int]]]:
    return [(p.steps, list(p.layers)) for p in plan_phases(load_schedule(sched))]


def trained(run: Path) -> list[tuple[int, list[int]]]:
    """Each phase's steps and layers, as its phase-end manifest says."""
    ends = sorted((m.phase, m) for m in map(read_manifest, Checkpoints(run).all()) if m.phase_complete)
    return [(m.body_step, m.layers) for _, m in ends]


@pytest.fixture(scope="module")
def badam(tmp_path_factory, tiny_model, tiny_data) -> tuple[Path, Path]:
    """(schedule, run): BAdam's walk, drop-all, a warm-up after each switch; a checkpoint every 3 steps."""
    d = tmp_path_factory.mktemp("badam")
    sched = strategy_schedule(d / "s.toml", tiny_model, tiny_data, {"strategy": "badam"},
                              checkpoint={"every_steps": 3, "keep_last": 100})
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    return sched, d / "run"


def test_badam_with_drop_all_and_a_warm_up_after_switches_matches_reference(badam, tiny_model, tiny_data):
    sched, run = badam
    phases = planned(sched)
    assert sorted(layers for _, layers in phases[:4]) == [[0], [1], [2], [3]]  # a pass: each block once
    assert trained(run) == phases
    ref = reference_run(tiny_model, tiny_data, phases, reset_head=True, phase_warmup=WARMUP)
    assert max_abs_diff(ref, composed(tiny_model, run)) <= TOL
    # The policy and the warm-up are each seen: LISA's head carried, or no warm-up, is far off.
    carried = reference_run(tiny_model, tiny_data, phases, phase_warmup=WARMUP)
    assert max_abs_diff(ref, carried) > 10 * TOL
    assert max_abs_diff(ref, reference_run(tiny_model, tiny_data, phases, reset_head=True)) > 10 * TOL
    # Every phase's head state started anew: its step counts this phase's steps only.
    ends = sorted((m.phase, m.head_step) for m in map(read_manifest, Checkpoints(run).all()) if m.phase_complete)
    assert [s for _, s in ends] == [5] * 6
    assert {v for m in map(read_manifest, Checkpoints(run).all()) for v in m.extra["state_from"].values()} == {"fresh"}
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["lr"] for m in logged[5:11]] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3, 1e-3, 1e-3 / 3])


def test_badam_stopped_mid_phase_resumes_bitwise(badam, tmp_path, tiny_model):
    """A stop at step 21 (phase 4, one step past its switch): the resume restores the head's state
    from the phase's own checkpoint (not reset again) and ends bitwise as the uninterrupted run."""
    sched, whole = badam
    run = truncated_copy(whole, tmp_path / "run", keep_upto=21)
    mid = read_manifest(Checkpoints(run).newest_whole()[0])
    assert (mid.global_step, mid.phase, mid.phase_complete, mid.head_step) == (21, 4, False, 1)
    r = cli("orchestrator", "run", str(shutil.copy(sched, tmp_path / "s.toml")))
    assert r.returncode == 0, r.stderr
    assert bitwise_equal(composed(tiny_model, run), composed(tiny_model, whole))
    # The resumed phase's checkpoints say its state came from step 21's, kept (9 tensors of a layer, 3 of the head).
    shown = cli("shard-tools", "inspect", str(run / "checkpoints" / "step-00000024"))
    assert shown.returncode == 0 and "optimizer state started from: phase 4 step 21: 12 tensors" in shown.stdout


def test_weighted_windowed_lisa_with_drop_all_on_two_processes_handing_over(tmp_path, tiny_model, tiny_data):
    """Also a head option: the embeddings frozen (``model.persistent`` names the head's modules
    that train), as the reference's head."""
    head = ("lm_head", "model.norm")
    sched = strategy_schedule(tmp_path / "s.toml", tiny_model, tiny_data, {
        "strategy": "lisa", "total_steps": 20, "layer_weights": [1, 0, 3, 2], "window": 3},
        model={"persistent": list(head)}, deepspeed={"zero_stage": 0}, launch={"nproc": 2, "handover": "on"})
    phases = planned(sched)
    assert all(layers != [1] for _, layers in phases)
    assert len({layers[0] for _, layers in phases[:3]}) == 3  # no layer twice within a window
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    taken = [json.loads((run / "phases" / f"phase-{i:04d}" / "records.json").read_text()).get("handover")
             for i in range(1, 4)]
    assert taken == ["device"] * 3
    assert trained(run) == phases
    ref = reference_run(tiny_model, tiny_data, phases, reset_head=True, phase_warmup=WARMUP, head_modules=head)
    weights = composed(tiny_model, run)
    assert max_abs_diff(ref, weights) <= TOL
    assert torch.equal(weights["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])  # untrained


# Layer 0 comes back after a phase away (its step 4 -> 9), layer 1 straight after its visit (6 ->
# 11), layer 2 is new (0 -> 5): three body steps in one phase; layer 3's state of phase 0 is kept in
# phase 1 and parked, after it, in a layers-only checkpoint whose file retention trimmed to it.
KEEP_PHASES = [(4, [0, 3]), (6, [1, 3]), (5, [0, 1, 2])]


def keep_schedule(path: Path, model_dir: Path, data_path: Path, nprocs: tuple[int, ...] = (1, 1, 1),
                  **sections) -> Path:
    phases = [{"steps": s, "layers": l, "nproc": n} for (s, l), n in zip(KEEP_PHASES, nprocs)]
    return write_schedule(path, schedule_dict(
        model_dir, data_path, schedule={"phases": phases, "optimizer_state": "keep"},
        checkpoint={"every_steps": 3, "keep_last": 1}, **sections))


@pytest.fixture(scope="module")
def keep(tmp_path_factory, tiny_model, tiny_data) -> tuple[Path, Path]:
    """(schedule, run): "keep" on one process, ZeRO 0 (relayer's own AdamW)."""
    d = tmp_path_factory.mktemp("keep")
    sched = keep_schedule(d / "s.toml", tiny_model, tiny_data, deepspeed={"zero_stage": 0})
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    return sched, d / "run"


@pytest.fixture(scope="module")
def keep_reference(tiny_model, tiny_data) -> dict[str, torch.Tensor]:
    return reference_run(tiny_model, tiny_data, KEEP_PHASES, keep_body=True)


def layer_of(name: str) -> int | None:
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


def test_keep_matches_reference_and_says_where_each_state_came_from(keep, keep_reference, tiny_model, tiny_data):
    sched, run = keep
    assert max_abs_diff(keep_reference, composed(tiny_model, run)) <= TOL
    assert max_abs_diff(keep_reference, reference_run(tiny_model, tiny_data, KEEP_PHASES)) > 10 * TOL  # "reset"
    ends = {m.global_step: (c, m) for c in Checkpoints(run).all() for m in [read_manifest(c)]}
    assert sorted(ends) == [10, 15] and ends[10][1].layers_only and ends[10][1].kept_layers == [3]
    last, m = ends[15]
    origin = {10: {1: "fresh", 3: "phase 0 step 4", None: "phase 0 step 4"},
              15: {0: "phase 0 step 4", 1: "phase 1 step 10", 2: "fresh", None: "phase 1 step 10"}}
    for step, (_, manifest) in ends.items():
        assert {n: origin[step][layer_of(n)] for n in manifest.extra["state_from"]} == manifest.extra["state_from"]
    # Each layer's kept step: where it left off before, plus this visit's (per parameter, as torch's).
    steps = {layer_of(n): int(t) for n, t in kept_state({0: last, 1: last, 2: last, 3: ends[10][0]})["step"].items()}
    assert steps == {0: 9, 1: 11, 2: 5, 3: 10}
    shown = cli("shard-tools", "inspect", str(last))
    assert shown.returncode == 0, shown.stderr
    # The head's and layer 1's from the phase before, layer 0's from phase 0, layer 2's new (9 tensors a layer).
    assert ("optimizer state started from: phase 1 step 10: 12 tensors; phase 0 step 4: 9 tensors; fresh: 9 tensors"
            in shown.stdout)


@pytest.mark.parametrize("handover", ["on", "host"])
def test_keep_handing_over_is_keep_through_the_checkpoint(keep, tmp_path, tiny_model, tiny_data, handover):
    """Handing over (through a file, "on"; through shared memory, "host"): the head's state and the
    layers' masters come by the offer, each returning layer's kept state from the checkpoint that
    holds it (layer 1 straight after its visit: the predecessor's end, waited for); every phase end
    writes its checkpoint. Bitwise the run through the checkpoint, ZeRO 0."""
    sched = keep_schedule(tmp_path / "s.toml", tiny_model, tiny_data, deepspeed={"zero_stage": 0},
                          launch={"handover": handover})
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    run, (_, whole) = tmp_path / "run", keep
    taken = [json.loads((run / "phases" / f"phase-{i:04d}" / "records.json").read_text()).get("handover")
             for i in (1, 2)]
    assert taken == ["device" if handover == "on" else "host"] * 2
    assert bitwise_equal(composed(tiny_model, run), composed(tiny_model, whole))
    for c in Checkpoints(run).all():  # each phase end's kept state, as the run through the checkpoint wrote it
        m = read_manifest(c)
        assert m.extra["state_from"] == read_manifest(whole / "checkpoints" / c.name).extra["state_from"]
    ends = {read_manifest(c).global_step for c in Checkpoints(run).all()}
    assert ends == {10, 15}


def test_keep_handing_over_on_two_processes_of_zero_2_is_keep_through_the_checkpoint(tmp_path, tiny_model, tiny_data,
                                                                                        keep_reference):
    """Every phase on two processes, ZeRO 2, handing over: the reference's "keep", and bitwise the
    same run through the checkpoint (each rank's kept state gathered whole at the predecessor's end)."""
    runs = {}
    for handover in ("off", "on"):
        (tmp_path / handover).mkdir()
        sched = keep_schedule(tmp_path / handover / "s.toml", tiny_model, tiny_data, nprocs=(2, 2, 2),
                              deepspeed={"zero_stage": 2}, launch={"handover": handover})
        r = cli("orchestrator", "run", str(sched))
        assert r.returncode == 0, r.stderr
        runs[handover] = composed(tiny_model, tmp_path / handover / "run")
    records = [json.loads((tmp_path / "on" / "run" / "phases" / f"phase-{i:04d}" / "records.json").read_text())
               for i in (1, 2)]
    assert [r["handover"] for r in records] == ["device", "device"]
    assert bitwise_equal(runs["on"], runs["off"])
    assert max_abs_diff(keep_reference, runs["on"]) <= TOL


def test_keep_handing_over_a_layer_back_from_two_phases_before_and_killed_there(tmp_path, tiny_model, tiny_data):
    """Layer 0 returns in phase 2 from phase 0, its predecessor trained layer 1 only: its kept state
    comes from the checkpoint the predecessor built on. The run handing over is killed first as phase 1
    reads phase 0's offer, and run again: bitwise the run through the checkpoint."""
    phases = [{"steps": 3, "layers": [0]}, {"steps": 3, "layers": [1]}, {"steps": 3, "layers": [0]}]

    def sched(d: Path, handover: str) -> Path:
        return write_schedule(d / "s.toml", schedule_dict(
            tiny_model, tiny_data, schedule={"phases": phases, "optimizer_state": "keep"},
            deepspeed={"zero_stage": 0}, launch={"handover": handover}))

    (tmp_path / "off").mkdir()
    assert cli("orchestrator", "run", str(sched(tmp_path / "off", "off"))).returncode == 0
    on = sched(tmp_path, "on")
    r = cli("orchestrator", "run", str(on), env={**os.environ, **faults_env(
        kill_at={"point": "handover.copying", "phase": 1})})
    assert r.returncode == 1 and "phase 1 " in r.stderr, r.stderr
    r = cli("orchestrator", "run", str(on))
    assert r.returncode == 0, r.stderr
    assert bitwise_equal(composed(tiny_model, tmp_path / "run"), composed(tiny_model, tmp_path / "off" / "run"))
    last = read_manifest(Checkpoints(tmp_path / "run").newest_whole()[0])
    assert {layer_of(n) for n, v in last.extra["state_from"].items() if v == "phase 0 step 3"} == {0}
    records = json.loads((tmp_path / "run" / "phases" / "phase-0002" / "records.json").read_text())
    assert records["handover"] == "device", records


def test_keep_killed_mid_phase_resumes_bitwise(keep, tmp_path, tiny_model):
    """A SIGKILL in step 13 (phase 2, its three layers at steps 6, 8 and 2 by the checkpoint at 12):
    the rerun resumes there, each layer at its own step, and ends bitwise as the uninterrupted run."""
    sched, whole = keep
    sched = Path(shutil.copy(sched, tmp_path / "s.toml"))
    r = cli("orchestrator", "run", str(sched), env={**os.environ, **faults_env(
        kill_at={"point": "data.micro_batch", "step": 13, "rank": 0})})
    assert r.returncode == 1, r.stderr
    mid = read_manifest(Checkpoints(tmp_path / "run").newest_whole()[0])
    assert (mid.global_step, mid.phase, mid.phase_complete) == (12, 2, False)
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    assert bitwise_equal(composed(tiny_model, tmp_path / "run"), composed(tiny_model, whole))
    last = read_manifest(Checkpoints(tmp_path / "run").newest_whole()[0])
    assert set(last.extra["state_from"].values()) == {"phase 2 step 12"}


def test_keep_on_two_processes_of_zero_2_matches_reference(tmp_path, tiny_model, tiny_data, keep_reference):
    """Phases 0 and 2 on two processes, phase 1 on one: a layer's state kept by two ranks is
    restored into one (layer 3), and the other way (layer 1), from full tensors."""
    sched = keep_schedule(tmp_path / "s.toml", tiny_model, tiny_data, nprocs=(2, 1, 2))
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    ends = {m.global_step: (m.world_size, m.zero_stage) for m in map(read_manifest, Checkpoints(tmp_path / "run").all())}
    assert ends == {10: (1, 2), 15: (2, 2)}
    assert max_abs_diff(keep_reference, composed(tiny_model, tmp_path / "run")) <= TOL


# schedule.layer_weights = "grad_norm" (IST's importance, measured online): phase i draws by the
# gradient norms the phases 0 .. i - LAG measured at their last steps.
LAG = 2
BY_NORM = {"strategy": "lisa", "total_steps": 30, "layer_weights": "grad_norm", "importance_lag": LAG,
           "optimizer_state": "reset"}


def by_norm(seed: int, n: int = 4, k: int = 1):
    """The documented rule, written from docs/schedule.md: each layer weighs its latest norm among
    phases 0 .. i - LAG, one not measured yet the highest measured, all alike before any; k draws
    without replacement, each in proportion among those left, from random.Random(
    "relayer-importance-<seed>-<i>")."""
    def choose(i: int, norms: list[dict[int, float]]) -> list[int]:
        latest: dict[int, float] = {}
        for measured in norms[:max(0, i - LAG + 1)]:
            latest.update(measured)
        top = max(latest.values(), default=0.0)
        weights = {layer: (latest.get(layer, top) if top > 0 else 1.0) for layer in range(n)}
        rng, left, chosen = random.Random(f"relayer-importance-{seed}-{i}"), list(range(n)), []
        for _ in range(k):
            x, acc = rng.random() * sum(weights[y] for y in left), 0.0
            for y in left:
                acc += weights[y]
                if x < acc:
                    break
            chosen.append(y)
            left.remove(y)
        return sorted(chosen)
    return choose


def journaled_norms(run: Path, by: str = "layers") -> list[dict]:
    """Each phase's norms, the last the journal has of it, by layer (or by module unit: ``by`` "units")."""
    events = [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]
    last = {e["phase"]: dict(zip(e[by], e["norms"])) for e in events if e["event"] == "grad_norms"}
    return [last[i] for i in sorted(last)]


@pytest.fixture(scope="module")
def grad_norm_run(tmp_path_factory, tiny_model, tiny_data) -> tuple[Path, Path]:
    """(schedule, run): by gradient norms on one process, relayer's own AdamW (ZeRO 0)."""
    d = tmp_path_factory.mktemp("grad_norm")
    sched = strategy_schedule(d / "s.toml", tiny_model, tiny_data, BY_NORM, deepspeed={"zero_stage": 0})
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    return sched, d / "run"


@pytest.mark.parametrize("nproc", [1, 2])
def test_grad_norm_draws_as_the_reference_measures(grad_norm_run, tmp_path, tiny_model, tiny_data, nproc):
    """Each phase's measured norms are the reference's at that phase's last step (the full gradient:
    at ZeRO 2 on two processes gathered from the partitions), the layers drawn by them are the
    reference's, and so are the weights. The first LAG phases are drawn by no norm: plan shows them,
    the later ones as drawn as the run goes."""
    if nproc == 1:
        sched, run = grad_norm_run
    else:
        sched = strategy_schedule(tmp_path / "s.toml", tiny_model, tiny_data, BY_NORM,
                                  deepspeed={"zero_stage": 2}, launch={"nproc": 2})
        r = cli("orchestrator", "run", str(sched))
        assert r.returncode == 0, r.stderr
        run = tmp_path / "run"
    norms: list[dict[int, float]] = []
    ref = reference_run(tiny_model, tiny_data, [(5, None)] * 6, phase_warmup=WARMUP, norms=norms, choose=by_norm(0))
    got = journaled_norms(run)
    assert len(got) == 6 and [sorted(m) for m in got] == [sorted(m) for m in norms]
    assert all(g[layer] == pytest.approx(want[layer], rel=1e-4) for g, want in zip(got, norms) for layer in want)
    chosen = [layers for _, layers in trained(run)]
    assert chosen == [sorted(m) for m in norms]
    assert max_abs_diff(ref, composed(tiny_model, run)) <= TOL
    plan = [p for p in plan_phases(load_schedule(sched))]
    assert [p.drawn_later for p in plan] == [False] * LAG + [True] * (6 - LAG)
    assert [list(p.layers) for p in plan[:LAG]] == chosen[:LAG]
    assert len(set(map(tuple, chosen))) > 1  # not one layer over and over


def test_grad_norm_killed_mid_phase_resumes_bitwise_and_draws_the_same(grad_norm_run, tmp_path, tiny_model):
    """A SIGKILL in step 22 (phase 4): the rerun draws phase 4 and 5 by the norms the journal and
    the phase folders hold, and ends bitwise as the uninterrupted run, every phase the same layers."""
    sched, whole = grad_norm_run
    sched = Path(shutil.copy(sched, tmp_path / "s.toml"))
    killed_then_rerun(sched, 22)
    run = tmp_path / "run"
    assert trained(run) == trained(whole)
    assert journaled_norms(run) == journaled_norms(whole)
    report = cli("orchestrator", "report", "--json", str(run))  # each phase's norms, as drawn by
    rows = json.loads(report.stdout)["phases"]
    assert [{int(k): v for k, v in r["grad_norms"].items()} for r in rows] == journaled_norms(whole)
    assert bitwise_equal(composed(tiny_model, run), composed(tiny_model, whole))
