"""The orchestrator's side of the device handover: which switches hand over (each rule of
orchestrator/handover.py flips the decision), the overlap's planned peak (orchestrator/estimate.py),
the spec's handover part, and how ``orchestrator plan`` shows them. No torch: an inline model config.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from launch.contract import HandoverPart
from orchestrator import phasespec
from orchestrator.cli import main
from orchestrator.display import switch_lines
from orchestrator.estimate import estimate_plan
from orchestrator.groups import Work
from orchestrator.handover import Switch, boundary_reason, handover_part, plan_switches
from orchestrator.plan import plan_phases
from orchestrator.validate import load_schedule
from tests.conftest import SEQ, schedule_dict, write_schedule

# The tiny Llama of tests/conftest.py, inline.
CONFIG = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def schedule_file(tmp_path: Path, data_path: Path, *, config: dict = CONFIG, **sections) -> Path:
    raw = schedule_dict(Path("unused"), data_path, **sections)
    raw["model"] = {"config": config, "dtype": "float32"}
    return write_schedule(tmp_path / "s.toml", raw)


def loaded_with(tmp_path: Path, data_path: Path, **sections):
    return load_schedule(schedule_file(tmp_path, data_path, **sections))


def test_by_default_every_switch_hands_over(tmp_path, tiny_data):
    loaded = loaded_with(tmp_path, tiny_data)
    phases = plan_phases(loaded)
    assert [boundary_reason(loaded, phases, i) for i in range(2)] == [None, None]
    parts = [handover_part(loaded, phases, i, None) for i in range(3)]
    # The first phase takes from nobody, the last offers to nobody.
    assert [(p.offer, p.take, p.host) for p in parts] == [(True, False, False), (True, True, False),
                                                           (False, True, False)]


# (id, schedule sections, the reason of both switches)
RULES = [
    ("off", {"launch": {"handover": "off"}}, 'launch.handover = "off"'),
    ("no-prewarm", {"launch": {"prewarm": False}}, "launch.prewarm = false: no successor is alive to take the state"),
    ("launcher", {"launch": {"launcher": "torchrun"}},
     'launch.launcher = "torchrun": only "local" starts both phases on this node'),
    ("zero-3", {"deepspeed": {"zero_stage": 3}}, "deepspeed.zero_stage = 3: no process holds the whole head"),
]


@pytest.mark.parametrize("sections,reason", [pytest.param(s, r, id=i) for i, s, r in RULES])
def test_each_rule_sends_every_switch_through_the_checkpoint(sections, reason, tmp_path, tiny_data):
    loaded = loaded_with(tmp_path, tiny_data, **sections)
    phases = plan_phases(loaded)
    assert [boundary_reason(loaded, phases, i) for i in range(2)] == [reason, reason]
    assert [(p.offer, p.take) for p in (handover_part(loaded, phases, i, None) for i in range(3))] == [(False, False)] * 3


def test_a_different_process_count_rules_out_only_its_own_switch(tmp_path, tiny_data):
    loaded = loaded_with(tmp_path, tiny_data, data={"batch_size": 16}, schedule={"phases": [
        {"steps": 10, "layers": [0], "nproc": 2}, {"steps": 10, "layers": [1], "nproc": 2},
        {"steps": 10, "layers": [0], "nproc": 4}]})
    phases = plan_phases(loaded)
    assert [boundary_reason(loaded, phases, i) for i in range(2)] == [None, "phase 1 runs 2 processes, phase 2 4"]
    assert [(p.offer, p.take) for p in (handover_part(loaded, phases, i, None) for i in range(3))] == [
        (True, False), (False, True), (False, False)]


def test_on_hands_over_through_a_file_without_a_gpu(tmp_path, tiny_data):
    loaded = loaded_with(tmp_path, tiny_data, launch={"handover": "on"})
    phases = plan_phases(loaded)
    assert handover_part(loaded, phases, 1, None) == HandoverPart(offer=True, take=True, host=True, peak_bytes=0)


# The tiny Llama by hand: embedding and lm_head 96 x 32 each, the final norm 32; a layer's q and o
# 32 x 32 each, k and v 32 x 16 each (2 kv heads of 8), the MLP 3 x 32 x 64, two norms of 32.
HEAD = 96 * 32 * 2 + 32
PER_LAYER = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32
ALL = HEAD + 4 * PER_LAYER


def one_layer_phase_bytes() -> int:
    """A phase of one layer, one process, ZeRO-2, fp32, micro-batch 4 x SEQ tokens."""
    trained = HEAD + PER_LAYER
    weights, adam, grads = ALL * 4, trained * 12, trained * 4
    activations = 4 * SEQ * 32 * 4 * 17 * 4  # micro x seq x hidden x layers x ACTIVATION_VALUES x 4 bytes
    return weights + adam + grads + activations


def test_the_overlap_peak_is_both_phases_the_offer_and_its_copy(tmp_path, tiny_data):
    loaded = loaded_with(tmp_path, tiny_data)
    phases = plan_phases(loaded)
    estimate = estimate_plan(loaded, phases)
    offered = HEAD * 12 + 1 * PER_LAYER * 4  # the head's masters and moments, the one layer's masters
    peak = one_layer_phase_bytes() * 2 + offered * 2
    assert peak == 2_177_536
    assert estimate.overlaps == [peak, peak]
    assert [handover_part(loaded, phases, i, estimate).peak_bytes for i in range(3)] == [0, peak, peak]


def test_the_offer_grows_with_the_layers_of_the_phase_that_ends(tmp_path, tiny_data):
    loaded = loaded_with(tmp_path, tiny_data, schedule={"phases": [
        {"steps": 10, "layers": [0, 1, 2]}, {"steps": 10, "layers": [3]}]})
    phases = plan_phases(loaded)
    estimate = estimate_plan(loaded, phases)
    before, after = estimate.phases
    assert estimate.overlaps == [before.total + after.total + 2 * (HEAD * 12 + 3 * PER_LAYER * 4)]


def test_the_spec_carries_the_handover_and_the_estimate_is_made_once(tmp_path, tiny_data, monkeypatch):
    loaded = loaded_with(tmp_path, tiny_data)
    phases = plan_phases(loaded)
    calls = []
    real = phasespec.estimate_plan
    monkeypatch.setattr(phasespec, "estimate_plan", lambda *a: calls.append(a) or real(*a))
    specs = [phasespec.phase_spec(loaded, phases, Work(ph, ph.start_step, None), tmp_path / f"pd{ph.index}")
             for ph in phases]
    assert [(s.handover.offer, s.handover.take, s.handover.peak_bytes) for s in specs] == [
        (True, False, 0), (True, True, 2_177_536), (False, True, 2_177_536)]
    assert len(calls) == 1


def test_a_model_the_estimate_cannot_size_still_hands_over_with_no_planned_peak(tmp_path, tiny_data):
    loaded = load_schedule(schedule_file(tmp_path, tiny_data, config={**CONFIG, "model_type": "falcon"}))
    phases = plan_phases(loaded)
    spec = phasespec.phase_spec(loaded, phases, Work(phases[1], 10, None), tmp_path / "pd")
    assert spec.handover == HandoverPart(offer=True, take=True, host=False, peak_bytes=0)


def test_plan_switches_fall_back_where_the_overlap_exceeds_the_device(tmp_path, tiny_data):
    loaded = loaded_with(tmp_path, tiny_data)
    phases = plan_phases(loaded)
    estimate = estimate_plan(loaded, phases)
    assert plan_switches(loaded, phases, estimate, 2_177_536) == [Switch(0, None, 2_177_536), Switch(1, None, 2_177_536)]
    assert plan_switches(loaded, phases, estimate, 2_177_535)[0].reason == (
        "overlap peak 2.1 MiB per device, more than --device-memory 2.1 MiB")


def test_switch_lines_group_the_switches_and_name_runs_of_phases():
    switches = [Switch(i, None, 1024) for i in range(25) if i % 2 == 0] + [Switch(25, "a reason", 1024)]
    assert switch_lines(switches) == [
        "switches after phases 0, 2, 4, 6, 8, 10, 12, 14, 16, 18 and 3 more: hand over on the device, "
        "overlap peak 1.0 KiB per device",
        "switch after phase 25: through the checkpoint: a reason"]
    assert switch_lines([Switch(0, None, None), Switch(1, None, None)], host=True) == [
        "switches after phases 0-1: hand over on the device (through a file without a GPU), overlap peak not estimated"]


def plan_lines(*args: str) -> tuple[int, list[str], str]:
    r = CliRunner().invoke(main, ["plan", *args])
    return r.exit_code, [line for line in r.stdout.splitlines() if line.startswith("switch")], r.stderr


def test_plan_names_each_switch_and_its_fallback(tmp_path, tiny_data):
    path = schedule_file(tmp_path, tiny_data, data={"batch_size": 16}, launch={"nproc": 2}, schedule={"phases": [
        {"steps": 10, "layers": [0]}, {"steps": 10, "layers": [1]}, {"steps": 10, "layers": [0]},
        {"steps": 5, "layers": [2, 3], "nproc": 4}]})
    code, lines, _ = plan_lines(str(path))
    assert code == 0
    assert lines == ["switches after phases 0-1: hand over on the device, overlap peak 1.8 MiB per device",
                     "switch after phase 2: through the checkpoint: phase 2 runs 2 processes, phase 3 4"]
    code, lines, _ = plan_lines(str(path), "--device-memory", "1.5MiB")
    assert code == 0
    assert lines[0] == ("switches after phases 0-1: through the checkpoint: overlap peak 1.8 MiB per device, "
                        "more than --device-memory 1.5 MiB")
    code, lines, _ = plan_lines(str(path), "--set", 'launch.handover="off"')
    assert lines == ['switches after phases 0-2: through the checkpoint: launch.handover = "off"']


def test_a_bad_handover_value_exits_2_naming_the_key(tmp_path, tiny_data):
    path = schedule_file(tmp_path, tiny_data, launch={"handover": "yes"})
    code, lines, err = plan_lines(str(path))
    assert code == 2 and lines == []
    assert err == f"orchestrator: {path.resolve()}: launch.handover: expected 'auto', 'on' or 'off', got 'yes'\n"
