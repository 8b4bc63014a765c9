"""Module units (MISA; issue 46): phases that train some modules of a layer equal the independent
plain-PyTorch reference (``tests.reference``, whose phases may name units): strategy misa on one
process (ZeRO-2, stopped mid-phase and resumed bitwise), explicit units on one and two ("drop-all"),
misa by the units' gradient norms on two (ZeRO-2, killed and rerun bitwise). The modules a phase
does not train keep their fp32 weights from phase to phase, also where the model trains in
bfloat16 (a layer is stored whole).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from orchestrator.plan import plan_phases
from orchestrator.validate import load_schedule
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from shard_tools.manifest import read_manifest
from shard_tools.store import Checkpoints
from tests.conftest import cli, finished_run, killed_then_rerun, schedule_dict, truncated_copy, write_schedule
from tests.launch.test_lisa_family_runs import journaled_norms
from tests.reference import bitwise_equal, composed, max_abs_diff, reference_run

TOL = 1e-5  # tests/launch/test_equivalence.py says why

pytestmark = pytest.mark.multiprocess


def misa_run(tmp_path_factory, model_dir: Path, data_path: Path, schedule: dict | None = None,
             **sections) -> tuple[Path, Path]:
    """(schedule, run) of strategy misa, 4 phases of 5 steps, a checkpoint every 3 steps, run to its
    end once (``conftest.finished_run``: read-only)."""
    raw = schedule_dict(model_dir, data_path, schedule={"phases": None, "strategy": "misa", "total_steps": 20,
                                                        "interval": 5, "module_budget": 0.2, **(schedule or {})},
                        checkpoint={"every_steps": 3, "keep_last": 100}, **sections)
    del raw["schedule"]["phases"]
    run = finished_run(tmp_path_factory, raw)
    return run.parent / "schedule.toml", run


def units(sched: Path) -> list[tuple[int, list[str]]]:
    """Each planned phase's steps and module units."""
    return [(p.steps, list(p.modules)) for p in plan_phases(load_schedule(sched))]


def trained_tensors(run: Path) -> list[set[str]]:
    """Each phase's trained body tensors, as its phase-end manifest says (``extra.state_from``)."""
    ends = sorted((m.phase, m) for m in map(read_manifest, Checkpoints(run).all()) if m.phase_complete)
    return [{n for n in m.extra["state_from"] if n.startswith("model.layers.")} for _, m in ends]


def under(unit_list: list[str]) -> tuple[str, ...]:
    return tuple(f"model.layers.{u}." for u in unit_list)


@pytest.fixture(scope="module")
def misa(tmp_path_factory, tiny_model, tiny_data) -> tuple[Path, Path]:
    """(schedule, run): strategy misa on one process, ZeRO-2."""
    return misa_run(tmp_path_factory, tiny_model, tiny_data)


def test_misa_trains_the_units_drawn_and_matches_reference(misa, tiny_model, tiny_data):
    sched, run = misa
    phases = units(sched)
    assert all(any("." in u.partition(".")[2] for u in us) for _, us in phases)  # modules, not layers
    assert len({tuple(us) for _, us in phases}) == len(phases)  # drawn anew each phase
    ref = reference_run(tiny_model, tiny_data, phases)
    weights = composed(tiny_model, run)
    base = {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).named_parameters()}
    assert max_abs_diff(ref, weights) <= TOL
    # Only the units trained: each phase's manifest lists their tensors alone, and a tensor under
    # no unit drawn (a norm, a module never drawn) is the base model's, bitwise.
    for (_, us), names in zip(phases, trained_tensors(run)):
        assert names == {n for n in weights if n.startswith(under(us))}
    drawn = under([u for _, us in phases for u in us])
    untouched = [n for n in weights if n.startswith("model.layers.") and not n.startswith(drawn)]
    assert untouched and all(torch.equal(weights[n], base[n]) for n in untouched)
    # The units are seen: the same phases training whole layers are far off.
    layers = [(s, sorted({int(u.partition(".")[0]) for u in us})) for s, us in phases]
    assert max_abs_diff(ref, reference_run(tiny_model, tiny_data, layers)) > 10 * TOL


def test_misa_stopped_mid_phase_resumes_bitwise(misa, tmp_path, tiny_model):
    """A stop at step 12 (phase 2, two steps past its switch): the resume takes the units' masters,
    their moments and the frozen modules' weights from that checkpoint and ends bitwise as the run."""
    sched, whole = misa
    run = truncated_copy(whole, tmp_path / "run", keep_upto=12)
    mid = read_manifest(Checkpoints(run).newest_whole()[0])
    assert (mid.global_step, mid.phase, mid.phase_complete) == (12, 2, False)
    r = cli("orchestrator", "run", str(shutil.copy(sched, tmp_path / "s.toml")))
    assert r.returncode == 0, r.stderr
    assert bitwise_equal(composed(tiny_model, run), composed(tiny_model, whole))


# Layer 0's MLP, then its attention's q and v (the MLP frozen, carried in its checkpoints), then
# layer 0 whole again beside layer 1's up projection.
EXPLICIT = [(4, ["0.mlp"]), (5, ["0.self_attn.q_proj", "0.self_attn.v_proj", "2.mlp.down_proj"]),
            (4, ["0.self_attn", "1.mlp.up_proj"])]


def explicit_schedule(path: Path, model_dir: Path, data_path: Path, **sections) -> Path:
    phases = [{"steps": s, "modules": us} for s, us in EXPLICIT]
    return write_schedule(path, schedule_dict(model_dir, data_path, schedule={"phases": phases, **sections.pop(
        "schedule", {})}, **sections))


@pytest.mark.parametrize("nproc,stage", [(1, 2), (2, 0)])
def test_explicit_units_with_drop_all_match_reference(tmp_path, tiny_model, tiny_data, nproc, stage):
    """On one process of ZeRO-2 and on two of relayer's own optimizer."""
    sched = explicit_schedule(tmp_path / "s.toml", tiny_model, tiny_data, schedule={"optimizer_state": "drop-all"},
                              deepspeed={"zero_stage": stage}, launch={"nproc": nproc})
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    ref = reference_run(tiny_model, tiny_data, EXPLICIT, reset_head=True)
    assert max_abs_diff(ref, composed(tiny_model, run)) <= TOL
    for (_, us), names in zip(EXPLICIT, trained_tensors(run)):
        assert names == {n for n in ref if n.startswith(under(us))}
    # Phase 1 froze layer 0's MLP: its checkpoint holds it as phase 0 left it, bitwise.
    ends = {m.phase: c for c in Checkpoints(run).all() for m in [read_manifest(c)] if m.phase_complete}
    first, second = (load_file(ends[i] / "layers.safetensors") for i in (0, 1))
    mlp = [n for n in first if n.startswith("model.layers.0.mlp.")]
    assert mlp and all(torch.equal(first[n], second[n]) for n in mlp)


def test_frozen_modules_keep_their_fp32_weights_in_bfloat16(tmp_path, tiny_model, tiny_data):
    """The model trains in bfloat16: a module trained in one phase and frozen in the next keeps its
    fp32 master in the next one's checkpoint, bitwise, not its bfloat16 copy in the model."""
    sched = explicit_schedule(tmp_path / "s.toml", tiny_model, tiny_data, model={"dtype": "bfloat16"},
                              deepspeed={"zero_stage": 0})
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    ends = {m.phase: c for c in Checkpoints(tmp_path / "run").all() for m in [read_manifest(c)] if m.phase_complete}
    first, second = (load_file(ends[i] / "layers.safetensors") for i in (0, 1))
    w = "model.layers.0.mlp.up_proj.weight"
    assert first[w].dtype == torch.float32 and torch.equal(first[w], second[w])
    assert not torch.equal(first[w], first[w].bfloat16().float())  # not what the model holds


BY_NORM = {"unit_weights": "grad_norm", "importance_lag": 2}


def misa_by_norm(model_dir: Path, budget: float, seed: int = 0, lag: int = 2):
    """The reference's choice of units by gradient norm (``reference_run``'s ``choose``), written from
    the schedule's documentation: every 2-D weight's module of a body layer is a unit; phase i orders
    them by a draw without replacement in proportion to each one's latest norm among phases 0 .. i -
    lag (unmeasured: the highest; none: all alike): each unit, in order, the key u ** (1 / weight) of
    the next uniform of the rng seeded "relayer-misa-<seed>-<i>", the units in descending key order;
    and takes each in that order that fits in what is left of the budget."""
    import random

    params = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    body = {n: p.numel() for n, p in params.items() if n.startswith("model.layers.")}
    units = sorted({n.removeprefix("model.layers.").removesuffix(".weight") for n, p in params.items()
                    if n.startswith("model.layers.") and n.endswith(".weight") and p.ndim == 2},
                   key=lambda u: (int(u.split(".")[0]), u))
    size = {u: sum(c for n, c in body.items() if n.startswith(f"model.layers.{u}.")) for u in units}
    left_of_budget = int(budget * sum(body.values()))

    def choose(i: int, norms: list[dict[str, float]]) -> list[str]:
        latest: dict[str, float] = {}
        for measured in norms[:max(0, i - lag + 1)]:
            latest.update(measured)
        top = max(latest.values(), default=0.0)
        weights = {u: (latest.get(u, top) if top > 0 else 1.0) for u in units}
        rng = random.Random(f"relayer-misa-{seed}-{i}")
        keyed = {u: rng.random() ** (1 / weights[u]) for u in units}  # Efraimidis and Spirakis: all weights > 0 here
        order = sorted(units, key=lambda u: (keyed[u], units.index(u)), reverse=True)
        left, chosen = left_of_budget, []
        for u in order:
            if size[u] <= left:
                chosen.append(u)
                left -= size[u]
        return sorted(chosen, key=lambda u: (int(u.split(".")[0]), u))
    return choose


@pytest.fixture(scope="module")
def by_norm(tmp_path_factory, tiny_model, tiny_data) -> tuple[Path, Path]:
    """(schedule, run): misa by the units' gradient norms, two processes of ZeRO-2."""
    return misa_run(tmp_path_factory, tiny_model, tiny_data, BY_NORM, deepspeed={"zero_stage": 2},
                    launch={"nproc": 2})


def test_misa_by_gradient_norm_on_two_processes_draws_and_trains_as_the_reference(by_norm, tiny_model, tiny_data):
    """Each phase's units' norms are the reference's at its last step (gathered from ZeRO-2's
    partitions), the units drawn by them are the reference's, and so are the weights."""
    sched, run = by_norm
    norms: list[dict[str, float]] = []
    ref = reference_run(tiny_model, tiny_data, [(5, None)] * 4, norms=norms, choose=misa_by_norm(tiny_model, 0.2))
    got = journaled_norms(run, by="units")
    assert [sorted(m) for m in got] == [sorted(m) for m in norms]
    assert all(g[u] == pytest.approx(want[u], rel=1e-4) for g, want in zip(got, norms) for u in want)
    for names, measured in zip(trained_tensors(run), norms):
        assert names == {n for n in ref if n.startswith(under(list(measured)))}
    assert max_abs_diff(ref, composed(tiny_model, run)) <= TOL
    plan = plan_phases(load_schedule(sched))
    assert [p.drawn_later for p in plan] == [False, False, True, True]


def test_misa_by_gradient_norm_killed_resumes_bitwise_and_draws_the_same(by_norm, tmp_path, tiny_model):
    """A SIGKILL in step 17 (phase 3, drawn by norms): the rerun draws it by the norms the journal and
    the phase folders hold, and ends bitwise as the uninterrupted run."""
    sched, whole = by_norm
    sched = Path(shutil.copy(sched, tmp_path / "s.toml"))
    killed_then_rerun(sched, 17)
    run = tmp_path / "run"
    assert trained_tensors(run) == trained_tensors(whole)
    assert journaled_norms(run, by="units") == journaled_norms(whole, by="units")
    assert bitwise_equal(composed(tiny_model, run), composed(tiny_model, whole))
