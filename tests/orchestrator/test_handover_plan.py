"""The orchestrator's side of the device handover: which switches hand over (each rule of
orchestrator/handover.py flips the decision), the overlap's planned peak (orchestrator/estimate.py),
the spec's handover part, and how ``orchestrator plan`` shows them. No torch: an inline model config.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from launch.contract.spec import HandoverPart
from orchestrator import phasespec
from orchestrator.cli import main
from orchestrator.display import switch_lines
from orchestrator.estimate import CONTEXT_BYTES, LOGIT_BYTES, PROCESS_BYTES, RESERVE, estimate_plan
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
    assert handover_part(loaded, phases, 1, None) == HandoverPart(offer=True, take=True, host=True, peak_bytes=0,
                                                                  next_layers=list(phases[2].layers))


# The tiny Llama by hand: embedding and lm_head 96 x 32 each, the final norm 32; a layer's q and o
# 32 x 32 each, k and v 32 x 16 each (2 kv heads of 8), the MLP 3 x 32 x 64, two norms of 32.
HEAD = 96 * 32 * 2 + 32
PER_LAYER = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32
ALL = HEAD + 4 * PER_LAYER
# A phase waiting pre-warmed beside a switch, outside a budget: its CUDA context, and its warm-up
# (one at a time) on a toy of one layer whose every parameter trains: the toy's whole phase
# (ZeRO-2 of one process here, fp32, micro-batches of 4: its weights, Adam's state, gradients
# with the reduce bucket and activations with the allocator's reserve).
TOY = HEAD + PER_LAYER
WARM_UP = TOY * 4 + math.ceil((TOY * 12 + TOY * 4 + 500_000 * 4 + 4 * SEQ * 32 * 17 * 4 + 4 * SEQ * 96 * LOGIT_BYTES)
                              * RESERVE)
WAITING_ONE = CONTEXT_BYTES + WARM_UP


OVERLAP = 5_806_814_784
"""The tiny schedule's overlap peak on a GPU (the holder's weights, ``launch.resident = "auto"``)."""


def one_layer_phase(resident: bool) -> tuple[int, int, int, int]:
    """A phase of one layer, one process, ZeRO-2, fp32, micro-batch 4 x SEQ tokens: its weights (all,
    or with the holder's, what it trains), Adam's state, gradients with ZeRO's bucket, activations."""
    trained = HEAD + PER_LAYER
    bucket = 500_000 * 4  # ZeRO's reduce bucket, relayer's least (launch.contract.dsconfig.bucket_size)
    activations = 4 * SEQ * 32 * 4 * 17 * 4  # micro x seq x hidden x layers x ACTIVATION_VALUES x 4 bytes
    logits = 4 * SEQ * 96 * LOGIT_BYTES
    return (trained if resident else ALL) * 4, trained * 12, trained * 4 + bucket, activations + logits


@pytest.mark.parametrize("resident, both", [("off", 5_206_975_552), ("auto", OVERLAP)])
def test_the_overlap_peak_is_the_finished_phase_let_go_the_offer_its_copy_and_the_successor(tmp_path, tiny_data,
                                                                                           resident, both):
    """The finished phase once it offered (its gradients and allocator's cache given back; under
    ZeRO its gradient partitions and bucket counted), the offer and its copy, the successor's
    whole phase (NVML: its weights, the rest with the allocator's reserve, its process's fixed part);
    with the holder's weights ("auto", a GPU), the model once more and the holder's process."""
    loaded = loaded_with(tmp_path, tiny_data, launch={"resident": resident})
    phases = plan_phases(loaded)
    estimate = estimate_plan(loaded, phases)
    weights, adam, grads, activations = one_layer_phase(resident == "auto")
    offered = HEAD * 12 + 1 * PER_LAYER * 4  # the head's masters and moments, the one layer's masters
    let_go = weights + math.ceil((adam + grads) * RESERVE) + PROCESS_BYTES
    if resident == "auto":
        # With the holder's copy (as measured on an H100): the successor's copy of the offer goes before
        # its first step, so its gradients and activations or the copy, whichever is more; a phase
        # waiting pre-warmed holds its context and the one warm-up at a time (WAITING_ONE).
        successor = weights + math.ceil((adam + max(offered, grads + activations)) * RESERVE) + PROCESS_BYTES
        waiting = WAITING_ONE
    else:  # a copy of the model per phase, the H200's constants: the copy beside the whole phase
        successor = offered + weights + math.ceil((adam + grads + activations) * RESERVE) + PROCESS_BYTES
        waiting = PROCESS_BYTES
    held = ALL * 4 + CONTEXT_BYTES if resident == "auto" else 0
    assert estimate.resident == held
    # Into phase 1, phase 2 waits pre-warmed beside them; into phase 2, nothing is left to wait.
    assert estimate.overlaps == [both + waiting, both]
    assert both == held + let_go + offered + successor  # the offer gathered (ZeRO) and the successor
    assert [handover_part(loaded, phases, i, estimate).peak_bytes for i in range(3)] == [0, both + waiting, both]
    # Under a budget a waiting phase's allocator is capped at its share (PROCESS_BYTES less its
    # context): counted at that share, its warm-up within it.
    budgeted = estimate_plan(loaded_with(tmp_path, tiny_data, launch={"resident": resident, "device_memory": "80GB"}),
                             phases)
    assert budgeted.overlaps == [both + PROCESS_BYTES, both]
    assert budgeted.resident == held  # a budget counts the holder as the run has it


@pytest.mark.parametrize("launch,waiting", [({}, [3, 3, 2, 1, 0]), ({"prewarm_depth": 1}, [1, 1, 1, 1, 0]),
                                            ({"prewarm": False}, [0] * 5)])
def test_the_phases_waiting_beside_an_overlap_follow_the_prewarm_depth(launch, waiting, tmp_path, tiny_data):
    loaded = loaded_with(tmp_path, tiny_data, launch=launch,
                         schedule={"phases": [{"steps": 4, "layers": [i % 4]} for i in range(6)]})
    phases = plan_phases(loaded)
    estimate = estimate_plan(loaded, phases)
    base = estimate.overlaps[-1]
    # Each its CUDA context, and one warm-up for them all (they warm up one at a time).
    assert [peak - base for peak in estimate.overlaps] == [n * CONTEXT_BYTES + (WARM_UP if n else 0) for n in waiting]
    budgeted = estimate_plan(loaded_with(tmp_path, tiny_data, launch={**launch, "device_memory": "80GB"},
                                         schedule={"phases": [{"steps": 4, "layers": [i % 4]} for i in range(6)]}),
                             phases)
    assert [peak - base for peak in budgeted.overlaps] == [n * PROCESS_BYTES for n in waiting]  # each at its share


def plan_7b(tmp_path: Path, tiny_data: Path, micro_batch: int, phases: int, checkpointing: bool = False, **launch):
    llama_7b = {"model_type": "llama", "max_position_embeddings": 2048, "hidden_size": 4096,
                "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 32, "vocab_size": 32000}
    raw = schedule_dict(Path("unused"), tiny_data, data={"seq_len": 512, "batch_size": 4, "micro_batch_size": micro_batch},
                        schedule={"phases": [{"steps": 20, "layers": [2 * i, 2 * i + 1]} for i in range(phases)]},
                        deepspeed={"zero_stage": 0}, launch=launch)
    raw["model"] = {"config": llama_7b, "dtype": "bfloat16", "gradient_checkpointing": checkpointing}
    loaded = load_schedule(write_schedule(tmp_path / "s.toml", raw))
    return estimate_plan(loaded, plan_phases(loaded))


def test_the_overlap_at_7b_is_what_nvml_saw_on_an_h100_within_10_percent(tmp_path, tiny_data):
    """benchmarks/results/2026-12-06-issue41-h100-resident: 7B, ZeRO 0, one copy of the model (the
    holder's), every switch handed over on the H100 (80 GB). NVML at the switches: with micro-batches
    of 2 (resident7b-defaults, 14 phases) up to 58.9 GB where a waiting phase warmed up in the switch,
    46.7 GB at the last, where none waits; with micro-batches of 1 (peer7b-zero0) 45.0 GB at the
    last. With a copy of the model per phase the overlap does not fit the card, as every switch of
    this job went through the checkpoint before the holder."""
    defaults = plan_7b(tmp_path, tiny_data, micro_batch=2, phases=14)
    assert abs(max(defaults.overlaps) / 58.9e9 - 1) <= 0.1
    assert abs(defaults.overlaps[-1] / 46.7e9 - 1) <= 0.1
    assert abs(plan_7b(tmp_path, tiny_data, micro_batch=1, phases=10).overlaps[-1] / 45.0e9 - 1) <= 0.1
    assert max(defaults.overlaps) < 80e9
    # With gradient checkpointing the successor's activations (and the warm-up's) are a layer's input
    # each and one layer recomputed: the overlap is smaller by their difference with the reserve.
    ckpt = plan_7b(tmp_path, tiny_data, micro_batch=2, phases=14, checkpointing=True)
    saved = defaults.phases[1].activations - ckpt.phases[1].activations
    assert saved > 3e9 and defaults.overlaps[-1] - ckpt.overlaps[-1] == pytest.approx(saved * RESERVE, abs=2)
    # A copy of the model per phase: the model once more in the successor (the H200's constants).
    own = plan_7b(tmp_path, tiny_data, micro_batch=2, phases=14, resident="off")
    assert max(own.overlaps) > max(defaults.overlaps) + 13e9 and own.resident == 0 < defaults.resident


def test_the_spec_carries_the_handover_and_its_planned_peak(tmp_path, tiny_data):
    loaded = loaded_with(tmp_path, tiny_data)
    phases = plan_phases(loaded)
    estimate = phasespec.plan_estimate(loaded, phases)
    specs = [phasespec.phase_spec(loaded, phases, Work(ph, ph.start_step, None), tmp_path / f"pd{ph.index}", estimate)
             for ph in phases]
    assert [(s.handover.offer, s.handover.take, s.handover.peak_bytes) for s in specs] == [
        (True, False, 0), (True, True, OVERLAP + WAITING_ONE), (False, True, OVERLAP)]


def test_a_model_the_estimate_cannot_size_still_hands_over_with_no_planned_peak(tmp_path, tiny_data):
    loaded = load_schedule(schedule_file(tmp_path, tiny_data, config={**CONFIG, "model_type": "falcon"}))
    phases = plan_phases(loaded)
    estimate = phasespec.plan_estimate(loaded, phases)
    assert estimate is None
    spec = phasespec.phase_spec(loaded, phases, Work(phases[1], 10, None), tmp_path / "pd", estimate)
    assert spec.handover == HandoverPart(offer=True, take=True, host=False, peak_bytes=0,
                                         next_layers=list(phases[2].layers))


def test_plan_switches_fall_back_where_the_overlap_exceeds_the_device(tmp_path, tiny_data):
    loaded = loaded_with(tmp_path, tiny_data)
    phases = plan_phases(loaded)
    estimate = estimate_plan(loaded, phases)
    first, second = OVERLAP + WAITING_ONE, OVERLAP
    assert plan_switches(loaded, phases, estimate, first) == [Switch(0, None, first), Switch(1, None, second)]
    # Above a budget it goes through host memory; above this GPU's memory (no budget), through the
    # checkpoint, as the worker's own check will make it.
    assert plan_switches(loaded, phases, estimate, first - 1) == [
        Switch(0, "overlap peak 6.0 GiB per device, more than --device-memory 6.0 GiB", first, host=True),
        Switch(1, None, second)]
    assert plan_switches(loaded, phases, estimate, first - 1, memory_name="this GPU's") == [
        Switch(0, "overlap peak 6.0 GiB per device, more than this GPU's 6.0 GiB", first), Switch(1, None, second)]


def test_switch_lines_group_the_switches_and_name_runs_of_phases():
    switches = [Switch(i, None, 1024) for i in range(25) if i % 2 == 0] + [Switch(25, "a reason", 1024)]
    assert switch_lines(switches) == [
        "switches after phases 0, 2, 4, 6, 8, 10, 12, 14, 16, 18 and 3 more: hand over on the device, "
        "overlap peak 1.0 KiB per device",
        "switch after phase 25: through the checkpoint: a reason"]
    assert switch_lines([Switch(0, None, None), Switch(1, None, None)], host=True) == [
        "switches after phases 0-1: hand over on the device (through a file without a GPU), overlap peak not estimated"]


def plan_sections(*args: str) -> tuple[int, dict[str, list[str]], str]:
    """plan's exit code, its switch lines under each heading ("on this machine (...)", "on a GPU ..."), stderr."""
    r = CliRunner().invoke(main, ["plan", *args])
    sections: dict[str, list[str]] = {}
    for line in r.stdout.splitlines():
        if line.startswith("on ") and line.endswith(":"):
            sections[line[:-1]] = heading = []
        elif line.startswith("  switch"):
            heading.append(line.strip())
    return r.exit_code, sections, r.stderr


def plan_lines(*args: str) -> tuple[int, list[str], str]:
    """The switch lines of a GPU (of --device-memory); this machine's where they are the same."""
    code, sections, err = plan_sections(*args)
    return code, next((lines for title, lines in reversed(sections.items())), []), err


def test_plan_says_first_how_each_switch_goes_on_this_machine(tmp_path, tiny_data, monkeypatch):
    """Seen: plan on a CPU said "hands over on the device, overlap peak 12.3 GiB" of a run that then
    (rightly) went through the checkpoint."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    path = schedule_file(tmp_path, tiny_data)
    code, sections, _ = plan_sections(str(path), "--device-memory", "80GiB")
    assert code == 0
    assert list(sections) == ["on this machine (no GPU: DS_ACCELERATOR=cpu)", "on a GPU of 80.0 GiB (--device-memory)"]
    assert sections["on this machine (no GPU: DS_ACCELERATOR=cpu)"] == [
        'switches after phases 0-1: through the checkpoint: no GPU: a handover needs both phases on one GPU '
        '(launch.handover = "on" tests it through a file)']
    assert all("hands over on the device" in line for line in sections["on a GPU of 80.0 GiB (--device-memory)"])
    code, sections, _ = plan_sections(str(path), "--set", 'launch.handover="off"')
    assert list(sections) == ["on this machine (no GPU: DS_ACCELERATOR=cpu)"]  # the same everywhere: said once
    # Seen: "overlap peak 7.3 GiB per device" for a 1.4 MiB model on a CPU: a GPU's lines only when asked.
    r = CliRunner().invoke(main, ["plan", str(path)])
    assert "overlap peak" not in r.stdout and "on a GPU: --device-memory SIZE shows how each switch goes there" \
        in r.stdout, r.stdout
    code, sections, _ = plan_sections(str(path), "--set", 'launch.handover="on"')
    assert sections["on this machine (no GPU: DS_ACCELERATOR=cpu)"][0].startswith(
        "switch after phase 0: hands over on the device (through a file without a GPU)")


def test_this_machine_is_told_without_torch(monkeypatch, tmp_path):
    from orchestrator import machine

    assert machine.this_machine({"DS_ACCELERATOR": "cpu"}) == machine.Machine(0, None, "DS_ACCELERATOR=cpu")
    assert machine.this_machine({"CUDA_VISIBLE_DEVICES": ""}).gpus == 0
    monkeypatch.setattr(machine.devmem, "snapshot", lambda: None)
    monkeypatch.setattr(machine, "DRIVER_GPUS", tmp_path / "gpus")
    assert machine.this_machine({}) == machine.Machine(0, None, "no NVIDIA driver")
    (tmp_path / "gpus" / "0000:19:00.0").mkdir(parents=True)
    assert machine.this_machine({}) == machine.Machine(1, None, str(tmp_path / "gpus"))
    monkeypatch.setattr(machine.devmem, "snapshot", lambda: {"devices": [{"total": 150 << 30}, {"total": 140 << 30}]})
    assert machine.this_machine({"DS_ACCELERATOR": "cuda"}) == machine.Machine(2, 140 << 30, "NVML")


def test_plan_names_each_switch_and_its_fallback(tmp_path, tiny_data):
    path = schedule_file(tmp_path, tiny_data, data={"batch_size": 16}, launch={"nproc": 2}, schedule={"phases": [
        {"steps": 10, "layers": [0]}, {"steps": 10, "layers": [1]}, {"steps": 10, "layers": [0]},
        {"steps": 5, "layers": [2, 3], "nproc": 4}]})
    code, lines, _ = plan_lines(str(path), "--device-memory", "80GiB")
    assert code == 0
    # Two phases wait beside the first overlap, one beside the second.
    # (Phases of 2 and 4 processes: a copy of the model per phase, no holder.)
    assert lines == ["switch after phase 0: hands over on the device, overlap peak 9.7 GiB per device",
                     "switch after phase 1: hands over on the device, overlap peak 7.3 GiB per device",
                     "switch after phase 2: through the checkpoint: phase 2 runs 2 processes, phase 3 4"]
    # A budget just below the first overlap: phase 0 alone, beside the phases waiting, still fits it.
    overlaps = estimate_plan(load_schedule(path), plan_phases(load_schedule(path))).overlaps
    code, lines, err = plan_lines(str(path), "--device-memory", str(overlaps[0] - 1))
    assert code == 0, err
    assert lines[:2] == ["switch after phase 0: through host memory: overlap peak 9.7 GiB per device, "
                         "more than --device-memory 9.7 GiB",
                         "switch after phase 1: hands over on the device, overlap peak 7.3 GiB per device"]
    code, lines, _ = plan_lines(str(path), "--set", 'launch.handover="off"')
    assert lines == ['switches after phases 0-2: through the checkpoint: launch.handover = "off"']


def test_a_bad_handover_value_exits_2_naming_the_key(tmp_path, tiny_data):
    path = schedule_file(tmp_path, tiny_data, launch={"handover": "yes"})
    code, lines, err = plan_lines(str(path))
    assert code == 2 and lines == []
    assert err == f"orchestrator: {path.resolve()}: launch.handover: expected 'auto', 'on', 'off' or 'host', got 'yes'\n"
