"""The LISA family's choices the orchestrator makes (issue 46): weighted and windowed lisa
(OwLore), BAdam's block order, the warm-up after each switch, the optimizer-state policy; each a
deterministic function of the schedule and the seed, checked as the phase table and the spec say.
Their runs against the plain-PyTorch reference are tests/launch/test_lisa_family_runs.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from launch.contract.files import GradNorms, RunDir
from launch.contract.spec import lr_at
from orchestrator import phasespec
from orchestrator.changes import changed_lr
from orchestrator.errors import ScheduleError
from orchestrator.groups import Work
from orchestrator.importance import Importance
from orchestrator.plan import plan_phases
from orchestrator.schedule import cadence_seconds
from orchestrator.space import carries
from orchestrator.units import layer_units
from orchestrator.validate import validate_schedule
from tests.orchestrator.test_cli_plan import invoke
from tests.conftest import write_schedule
from tests.orchestrator.test_schedule import LAYERS, layers, plan, strategy_raw


def test_badam_walks_each_block_once_a_pass_in_an_order_reshuffled_every_pass(tmp_path, tiny_data):
    raw = strategy_raw(tiny_data, "badam", total_steps=20 * 16, interval=20, layers_per_phase=3)
    chosen = layers(plan(raw, tmp_path))
    blocks = [(0, 1, 2), (3, 4, 5), (6, 7)]  # consecutive layers; the last block shorter
    passes = [chosen[i:i + 3] for i in range(0, 15, 3)]
    assert all(sorted(p) == blocks for p in passes)
    assert len({tuple(p) for p in passes}) > 1  # reshuffled, not one order repeated
    assert chosen[15] in blocks
    assert chosen == layers(plan(raw, tmp_path))  # same seed, same walk
    other = layers(plan(strategy_raw(tiny_data, "badam", seed=1, total_steps=20 * 16, interval=20,
                                     layers_per_phase=3), tmp_path))
    assert other != chosen


def test_badam_and_windowed_weighted_lisa_are_pinned(tmp_path, tiny_data):
    """A resume replans in a new process, maybe after an upgrade: the tables must not move."""
    assert layers(plan(strategy_raw(tiny_data, "badam", layers_per_phase=2), tmp_path)) == \
        [(2, 3), (0, 1), (6, 7), (4, 5), (6, 7)]
    raw = strategy_raw(tiny_data, "lisa", layer_weights=[1, 2, 3, 4, 0, 0, 1, 1], window=2)
    assert layers(plan(raw, tmp_path)) == [(3, 6), (2, 7), (2, 3), (0, 1), (2, 3)]


def test_weighted_lisa_draws_in_proportion_and_never_a_zero_weight(tmp_path, tiny_data):
    weights = [8, 4, 2, 1, 1, 0, 0, 0]
    raw = strategy_raw(tiny_data, "lisa", layer_weights=weights, total_steps=3000, interval=1, layers_per_phase=1)
    counts = Counter(x for p in plan(raw, tmp_path) for x in p.layers)
    assert set(counts) == {0, 1, 2, 3, 4}
    assert counts[0] > 1.6 * counts[1] > 2.56 * counts[2] and counts[2] > 1.6 * counts[3]
    assert abs(counts[0] / 3000 - 0.5) < 0.04
    raw = strategy_raw(tiny_data, "lisa", layer_weights=weights, total_steps=400, interval=1, layers_per_phase=3)
    assert all(len(set(p.layers)) == 3 and max(p.layers) <= 4 for p in plan(raw, tmp_path))


def test_a_window_draws_no_layer_twice(tmp_path, tiny_data):
    raw = strategy_raw(tiny_data, "lisa", window=4, total_steps=24 * 10, interval=10, layers_per_phase=2)
    chosen = layers(plan(raw, tmp_path))
    for w in range(0, 24, 4):
        assert sorted(x for p in chosen[w:w + 4] for x in p) == list(range(LAYERS))
    assert len({tuple(chosen[w:w + 4]) for w in range(0, 24, 4)}) > 1


def test_uniform_weights_and_no_window_are_plain_lisa(tmp_path, tiny_data):
    """Runs planned before these keys resume with the same layers."""
    assert layers(plan(strategy_raw(tiny_data, "lisa", layer_weights="uniform"), tmp_path)) == \
        layers(plan(strategy_raw(tiny_data, "lisa"), tmp_path))


@pytest.mark.parametrize("keys,message", [
    ({"layer_weights": [1, 1]}, "schedule.layer_weights: expected a weight per body layer, 8, got 2"),
    ({"layer_weights": [1, 0, 0, 0, 0, 0, 0, 0]},
     "schedule.layer_weights: expected at most 1 layers drawn per phase (the layers of weight > 0), "
     "got layers_per_phase = 2"),
    ({"window": 5}, "schedule.window: expected at most 8 layers drawn per window (the layers of weight > 0), "
     "got window x layers_per_phase = 5 x 2"),
])
def test_weights_and_windows_the_model_cannot_meet_are_refused(tmp_path, tiny_data, keys, message):
    with pytest.raises(ScheduleError) as e:
        plan(strategy_raw(tiny_data, "lisa", **keys), tmp_path)
    assert e.value.exit_code == 2 and str(e.value) == f"{tmp_path / 'schedule.toml'}: {message}"


@pytest.mark.parametrize("strategy,keys,message", [
    ("badam", {"layer_weights": [1] * 8},
     "schedule.layer_weights: takes schedule.strategy = \"lisa\", got strategy 'badam'"),
    (None, {"window": 2}, 'schedule.window: takes schedule.strategy = "lisa", got strategy none (explicit phases)'),
    ("lisa", {"layer_weights": [1, -1] + [1] * 6}, "schedule.layer_weights[1]: expected a non-negative number, got -1"),
    ("lisa", {"layer_weights": "owlore"},
     'schedule.layer_weights: expected a list of weights, "uniform" or "grad_norm", got \'owlore\''),
    ("lisa", {"importance_lag": 2}, 'schedule.importance_lag: takes schedule.layer_weights (or unit_weights) = "grad_norm", got none'),
    ("lisa", {"layer_weights": "grad_norm", "importance_lag": 0}, "schedule.importance_lag"),
    ("lisa", {"optimizer_state": "keep-some"}, "schedule.optimizer_state: expected 'reset', 'drop-all' or 'keep'"),
])
def test_keys_in_the_wrong_place_name_the_key(tmp_path, tiny_data, strategy, keys, message):
    raw = strategy_raw(tiny_data, strategy or "lisa", **keys)
    if strategy is None:
        raw["schedule"] = {"phases": [{"steps": 5, "layers": [0]}], **keys}
    with pytest.raises(ScheduleError) as e:
        validate_schedule(raw, tmp_path / "schedule.toml")
    assert e.value.exit_code == 2 and message in str(e.value)


def warmup(**keys) -> SimpleNamespace:
    base = dict(lr=1.0, lr_kind="constant", warmup_steps=0, total_steps=100, warmup_from="zero", phase_warmup_steps=3)
    return SimpleNamespace(**(base | keys))


def test_the_warm_up_after_a_switch_restarts_in_every_phase():
    assert [lr_at(s, warmup(), 10) for s in range(10, 15)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert [lr_at(s, warmup(), 0) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # On top of the run's own schedule (here its warm-up), and never before its phase's start.
    assert lr_at(1, warmup(warmup_steps=4), 0) == pytest.approx(0.25 * 0.5)
    assert lr_at(9, warmup(), 10) == 1.0 and lr_at(12, warmup(phase_warmup_steps=0), 10) == 1.0


def test_the_spec_carries_the_policy_and_the_warm_up(tmp_path, tiny_data):
    raw = strategy_raw(tiny_data, "badam", optimizer_state="drop-all")
    raw["lr_schedule"] = {"phase_warmup_steps": 2}
    loaded = validate_schedule(raw, tmp_path / "schedule.toml")
    phases = plan_phases(loaded)
    spec = phasespec.phase_spec(loaded, phases, Work(phases[1], 20, None), tmp_path / "pd", None)
    assert (spec.optimizer_state, spec.optimizer.phase_warmup_steps, spec.phase_start_step) == ("drop-all", 2, 20)


def test_a_new_warm_up_after_switches_changes_the_lr_of_steps_taken(tmp_path, tiny_data):
    raw = strategy_raw(tiny_data, "lisa")
    old = validate_schedule(raw, tmp_path / "schedule.toml")
    new = validate_schedule({**raw, "lr_schedule": {"phase_warmup_steps": 2}}, tmp_path / "schedule.toml")
    assert changed_lr(old, plan_phases(old), new, plan_phases(new), done_step=20) == (
        "lr of step 0, already taken, would change: 0.001 -> 0.000333333 (lr 0.001, constant, warmup_steps 0 "
        "from zero, total_steps 100 -> lr 0.001, constant, warmup_steps 0 from zero, total_steps 100, "
        "phase_warmup_steps 2)")
    late = validate_schedule({**raw, "lr_schedule": {"phase_warmup_steps": 2}}, tmp_path / "schedule.toml")
    assert changed_lr(old, plan_phases(old), late, plan_phases(late), done_step=0) is None


def test_plan_shows_the_choice_the_policy_and_the_largest_phase(tmp_path, tiny_model, tiny_data):
    from tests.conftest import schedule_dict, write_schedule

    sched = schedule_dict(tiny_model, tiny_data, lr_schedule={"phase_warmup_steps": 2}, schedule={
        "phases": None, "strategy": "lisa", "total_steps": 20, "interval": 10, "layers_per_phase": 1,
        "layer_weights": [0, 1, 0, 1], "window": 2, "optimizer_state": "drop-all"})
    del sched["schedule"]["phases"]
    r = invoke("plan", str(write_schedule(tmp_path / "schedule.toml", sched)))
    assert r.exit_code == 0, r.output
    assert ("layers: strategy lisa weighted 0/1/0/1, no layer twice within 2 phases; optimizer state (drop-all): "
            "the body's and the head's new each phase; lr warm-up of 2 steps after each switch") in r.stdout
    assert "largest phase: 0 (layers " in r.output and " per process" in r.output


@pytest.mark.parametrize("name", ["lisa", "badam", "owlore", "lmflow-keep", "ist", "misa", "misa-gn"])
def test_the_family_examples_plan_as_their_comments_say(tmp_path, tiny_model, tiny_data, name):
    """examples/family/*.toml on the tiny model (make demo makes ../tiny/model; here the fixture's):
    plan accepts each, and its phases are what its comment promises."""
    import tomllib

    from tests.conftest import ROOT, schedule_dict, write_schedule

    raw = tomllib.loads((ROOT / "examples" / "family" / f"{name}.toml").read_text())
    raw["model"]["path"] = str(tiny_model)
    raw["data"] = {**raw["data"], **schedule_dict(tiny_model, tiny_data)["data"]}  # the fixture has no tokenizer
    raw["run"]["output_dir"] = str(tmp_path / "run")
    r = invoke("plan", str(write_schedule(tmp_path / f"{name}.toml", raw)))
    assert r.exit_code == 0, r.output
    drawn = layers(plan(raw, tmp_path))
    steps = raw["schedule"]["total_steps"]
    assert len(drawn) == steps // raw["schedule"]["interval"]
    if name == "lisa":  # one layer every 5 steps, a warm-up after each switch
        assert all(len(d) == 1 for d in drawn) and "lr warm-up of 2 steps after each switch" in r.stdout
    if name == "badam":  # blocks of 2 consecutive layers, each once a pass, the head's state dropped too
        passes = [sorted(drawn[i:i + 2]) for i in range(0, len(drawn), 2)]
        assert passes == [[(0, 1), (2, 3)]] * 4
        assert "optimizer state (drop-all): the body's and the head's new each phase" in r.stdout
    if name == "lmflow-keep":  # two layers every 5 steps, some come back, their state kept in the checkpoints
        assert all(len(d) == 2 for d in drawn) and len({l for d in drawn for l in d}) < 2 * len(drawn)
        assert "optimizer state (keep): each layer's kept in the checkpoint from its last visit" in r.stdout
    if name == "ist":  # the first 2 phases drawn alike, the rest by the norms measured as it trains
        later = [p.drawn_later for p in plan(raw, tmp_path)]
        assert later == [False] * 2 + [True] * 6 and r.stdout.count("1 by gradient norm") == 6
    if name == "misa":  # module units to a quarter of the body's parameters, each phase's table row naming them
        assert "module units drawn to 0.25 of the body's parameters a phase" in r.stdout
        loaded = validate_schedule(raw, tmp_path / "misa.toml")
        sizes = {f"{i}.{m}": n for i, t in loaded.layer_tensors.items() for m, n in layer_units(t).items()}
        assert len(sizes) == 4 * 7 and sizes["0.mlp.up_proj"] == 32 * 64 and sizes["0.self_attn.k_proj"] == 32 * 16
        for p in plan(raw, tmp_path):
            assert p.modules and p.layers == tuple(sorted({int(u.split(".")[0]) for u in p.modules}))
            left = 0.25 * 37_120 - sum(sizes[u] for u in p.modules)  # the body: 4 layers of 9,280
            assert 0 <= left < min(sizes[u] for u in sizes if u not in p.modules)  # filled as far as units fit
            row = next(line for line in r.stdout.splitlines() if line.startswith(f"│ {p.index:>5} │"))
            assert all(u.partition(".")[2] in row for u in p.modules)
    if name == "misa-gn":  # the first 2 phases drawn alike, the rest by the units' norms as it trains
        later = [p.drawn_later for p in plan(raw, tmp_path)]
        assert later == [False] * 2 + [True] * 6 and r.stdout.count("units by gradient norm") == 6
    if name == "owlore":  # weight 0 never drawn; no layer twice within a window of 2 phases
        assert all(3 not in d for d in drawn)
        assert all(not set(drawn[i]) & set(drawn[i + 1]) for i in range(0, len(drawn), 2))


def test_keep_hands_over_and_every_phase_end_writes(tmp_path, tiny_model, tiny_data):
    """optimizer_state "keep" parks a layer's Adam state in its phase's end checkpoint: plan says
    what it does, every phase end writes its checkpoint whatever the cadence, and the switches hand
    over as under "reset" (the spec carries the policy, offers and takes)."""
    from tests.conftest import schedule_dict, write_schedule

    raw = schedule_dict(tiny_model, tiny_data, checkpoint={"every_seconds": 300}, schedule={
        "phases": [{"steps": 4, "layers": [0]}, {"steps": 4, "layers": [1]}, {"steps": 4, "layers": [0]}],
        "optimizer_state": "keep"})
    sched = write_schedule(tmp_path / "schedule.toml", raw)
    r = invoke("plan", str(sched), "--set", 'launch.handover="on"')
    assert r.exit_code == 0, r.output
    assert ("optimizer state (keep): each layer's kept in the checkpoint from its last visit (new on its first), "
            "as LMFlow's and axolotl's LISA callbacks; the head's carried") in r.stdout
    assert "through the checkpoint" not in r.stdout and "checkpoints: every phase end writes up to" in r.stdout
    loaded = validate_schedule({**raw, "launch": {**raw.get("launch", {}), "handover": "on"}}, sched)
    phases = plan_phases(loaded)
    specs = [phasespec.phase_spec(loaded, phases, Work(phases[i], 4 * i, None), tmp_path / "pd", None) for i in (0, 1)]
    assert [(s.optimizer_state, s.handover.offer, s.handover.take) for s in specs] == [
        ("keep", True, False), ("keep", True, True)]
    assert not carries(loaded) and cadence_seconds(loaded.schedule) == 0
    assert not (tmp_path / "run").exists()


def norms_of(run: Path, index: int, norms: dict[int, float]) -> None:
    """What phase ``index``'s rank 0 writes at its end (``launch.importance``)."""
    files = RunDir(run).phase(index)
    files.path.mkdir(parents=True, exist_ok=True)
    files.write_grad_norms(GradNorms(phase=index, step=0, layers=list(norms), norms=list(norms.values())))


def test_grad_norm_draws_each_phase_once_the_norms_it_needs_are_in_and_a_resume_draws_the_same(tmp_path, tiny_data):
    """Phase i waits for the norms of phases 0 .. i - lag (the first lag phases are the plan's); a
    layer of a large norm is drawn far more often, one measured at 0 never, one not measured yet as
    the largest. A resume (a new orchestrator) draws the same from the journal, or from the phase
    folders where the journal lacks them."""
    raw = strategy_raw(tiny_data, "lisa", layer_weights="grad_norm", importance_lag=2, total_steps=400, interval=1,
                       layers_per_phase=1)
    loaded = validate_schedule(raw, tmp_path / "schedule.toml")
    phases = plan_phases(loaded)
    assert [p.drawn_later for p in phases[:3]] == [False, False, True]
    run, journal = tmp_path / "run", []
    imp = Importance(loaded, run, lambda name, **kw: journal.append({"event": name, **kw}))
    measured = {0: 1.0, 1: 0.0, 2: 50.0}  # layers 3-7: never measured (no phase trains them after its first)

    def finish(i: int) -> None:
        layer = phases[i].layers[0]
        norms_of(run, i, {layer: measured.get(layer, 1.0)})
        imp.finished(phases[i])
        imp.draw_ready(phases)

    imp.draw_ready(phases)
    assert phases[2].drawn_later  # phase 0's norms are not in yet
    for i in range(len(phases)):
        if i + 2 < len(phases):
            assert phases[i + 1].drawn_later is False and phases[i + 2].drawn_later is True
        finish(i)
    assert not any(p.drawn_later for p in phases)
    counts = Counter(p.layers[0] for p in phases)
    assert counts[2] > 300 and counts[1] <= 3  # layer 1 only until measured at 0
    again = plan_phases(loaded)
    resumed = Importance(loaded, run, lambda name, **kw: None)
    resumed.resume(again, journal, phases[200].start_step)  # the norms of phases 0-199, journaled
    resumed.draw_ready(again)
    assert again[:202] == phases[:202] and again[202].drawn_later
    from_folders = plan_phases(loaded)  # the journal lost: the phase folders hold them
    lost = Importance(loaded, run, lambda name, **kw: None)
    lost.resume(from_folders, [], phases[200].start_step)
    lost.draw_ready(from_folders)
    assert from_folders[:202] == phases[:202]


def test_plan_shows_the_phases_drawn_by_gradient_norm(tmp_path, tiny_data):
    raw = strategy_raw(tiny_data, "lisa", layer_weights="grad_norm", importance_lag=3)
    path = write_schedule(tmp_path / "s.toml", raw)
    out = invoke("plan", str(path))
    assert out.exit_code == 0, out.output
    assert "by gradient norm (IST): phase i draws by the norms phases 0 .. i - 3 measured" in out.output
    assert out.output.count("2 by gradient norm") == 2  # phases 3 and 4 of 5


def test_misa_on_a_model_of_many_layers_is_bounded_before_it_draws(tmp_path, tiny_data):
    """A hostile size: 200 layers' 1,400 units over 10,000 phases would be 14 million keys to draw;
    refused at once, naming the key, as a strategy's table of too many layers is."""
    from tests.conftest import make_llama, schedule_dict

    model = make_llama(tmp_path / "deep", layers=200)
    raw = schedule_dict(model, tiny_data, schedule={"phases": None, "strategy": "misa", "total_steps": 10_000,
                                                    "interval": 1, "module_budget": 0.01})
    del raw["schedule"]["phases"]
    with pytest.raises(ScheduleError) as e:
        validate_schedule(raw, tmp_path / "schedule.toml")
    assert e.value.exit_code == 2 and ("schedule.interval: expected phases x the model's module units of at most "
                                       "10,000,000, got 10,000 phases x 1,400 units") in str(e.value)
