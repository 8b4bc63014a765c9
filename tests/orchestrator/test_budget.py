"""The device budget (``launch.device_memory``, ``plan --device-memory``; orchestrator/budget.py):
the peak a phase holds on one device, the switches that leave the device where their overlap
would not keep it, the refusal that names what would fit, and each process's allocator cap. No
torch but for the cap's own test: inline model configs."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import budget, phasespec
from orchestrator.cli import main
from orchestrator.errors import ScheduleError
from orchestrator.estimate import CONTEXT_BYTES, PROCESS_BYTES, estimate_plan, on_device
from orchestrator.groups import Work
from orchestrator.plan import plan_phases
from orchestrator.validate import load_schedule
from tests.conftest import schedule_dict, write_schedule
from tests.orchestrator.test_handover_plan import ALL, CONFIG

LLAMA_7B = {"model_type": "llama", "max_position_embeddings": 2048, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}


def schedule_7b(tmp_path: Path, data: Path, *, launch: dict | None = None, **model) -> Path:
    """LISA at 7B: two layers a phase, batch 4 x 512 in micro-batches of 4, bf16, ZeRO 0."""
    raw = schedule_dict(Path("unused"), data, data={"seq_len": 512, "batch_size": 4, "micro_batch_size": 4},
                        deepspeed={"zero_stage": 0}, launch=launch or {},
                        schedule={"phases": [{"steps": 20, "layers": [2 * i, 2 * i + 1]} for i in range(6)]})
    raw["model"] = {"config": LLAMA_7B, "dtype": "bfloat16", **model}
    return write_schedule(tmp_path / "s7b.toml", raw)


def tiny(tmp_path: Path, data: Path, **launch) -> Path:
    raw = schedule_dict(Path("unused"), data, launch=launch)
    raw["model"] = {"config": CONFIG, "dtype": "float32"}
    return write_schedule(tmp_path / "s.toml", raw)


def test_a_phase_peak_is_its_own_beside_the_phases_waiting(tmp_path, tiny_data):
    loaded = load_schedule(tiny(tmp_path, tiny_data))
    phases = plan_phases(loaded)
    estimate = estimate_plan(loaded, phases)
    # Three phases, depth 3: two wait beside the first, one beside the second, none beside the last;
    # ZeRO-2 gathers what it saves (the head's masters and moments, its layer's masters) beside it.
    gathered = 96 * 32 * 2 * 12 + 32 * 12 + (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32) * 4
    # On a GPU the holder's copy of the model (launch.resident) is there once beside them.
    assert estimate.resident == ALL * 4 + CONTEXT_BYTES
    assert [budget.phase_peak(loaded, phases, estimate, i) for i in range(3)] == [
        estimate.resident + on_device(estimate.phases[i]) + gathered + w * PROCESS_BYTES for i, w in enumerate((2, 1, 0))]


def test_a_bad_device_memory_exits_2_naming_the_key(tmp_path, tiny_data):
    path = tiny(tmp_path, tiny_data, device_memory="lots")
    r = CliRunner().invoke(main, ["plan", str(path)])
    assert r.exit_code == 2
    assert r.stderr == (f"orchestrator: {path.resolve()}: launch.device_memory: expected a size such as 24GiB, "
                        f"24GB or 24e9 (bytes), got 'lots'\n")


def test_7b_at_40gib_names_the_keys_that_would_fit(tmp_path, tiny_data):
    path = schedule_7b(tmp_path, tiny_data, launch={"device_memory": "40GiB"})
    with pytest.raises(ScheduleError) as e:  # run refuses it as plan does: in loading, nothing written
        load_schedule(path)
    message = str(e.value)
    assert message.startswith(f"{path.resolve()}: launch.device_memory: phase 0 needs 47.7 GiB of one device "
                              "(the holder's copy of the model 13.1 GiB (launch.resident) + its weights 1.2 GiB + ")
    assert message.endswith("more than 40.0 GiB; would fit (38.0 GiB): model.gradient_checkpointing = true")
    assert e.value.exit_code == 2
    loaded = load_schedule(schedule_7b(tmp_path, tiny_data, launch={"device_memory": "40GiB"},
                                       gradient_checkpointing=True))
    assert loaded.schedule.launch.device_memory == "40GiB"


def test_plan_device_memory_stands_in_for_the_key(tmp_path, tiny_data):
    path = schedule_7b(tmp_path, tiny_data, launch={"device_memory": "40GiB"})
    r = CliRunner().invoke(main, ["plan", str(path), "--device-memory", "80GiB"])
    assert r.exit_code == 0, r.output
    assert "device budget 80.0 GiB (--device-memory): a phase holds at most 47.7 GiB of one device (phase 0: " in r.stdout
    r = CliRunner().invoke(main, ["plan", str(path), "--device-memory", "16GiB"])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.startswith(f"orchestrator: {path.resolve()}: --device-memory: phase 0 needs 47.7 GiB")
    assert "nothing relayer offers fits: " in r.stderr  # the bf16 weights alone are 12.6 GiB


def test_a_switch_whose_overlap_is_above_the_budget_goes_through_host_memory(tmp_path, tiny_data):
    # Under a budget (any: the phases waiting are counted at their share, PROCESS_BYTES each).
    loaded = load_schedule(tiny(tmp_path, tiny_data, device_memory="80GB"))
    phases = plan_phases(loaded)
    estimate = estimate_plan(loaded, phases)
    # Just below the first overlap: the first switch goes through host memory, the second hands over
    # on the device.
    size = estimate.overlaps[0] - 1
    loaded = load_schedule(tiny(tmp_path, tiny_data, device_memory=str(size)))
    specs = [phasespec.phase_spec(loaded, phases, Work(ph, ph.start_step, None), tmp_path / f"pd{ph.index}", estimate)
             for ph in phases]
    assert [(s.handover.offer, s.handover.take, s.handover.shm_offer, s.handover.shm_take) for s in specs] == [
        (True, False, True, False), (True, True, False, True), (False, True, False, False)]
    assert [s.handover.peak_bytes for s in specs] == [0, 0, estimate.overlaps[1]]
    # Each process's allocator: the budget less its own fixed part and the phases waiting beside it;
    # where the phases map the holder's copy of the model (launch.resident), less that too.
    assert [s.memory_cap for s in specs] == [size - k * PROCESS_BYTES for k in (3, 2, 1)]
    mapping = [phasespec.phase_spec(loaded, phases, Work(ph, ph.start_step, None), tmp_path / f"pd{ph.index}",
                                    estimate, resident=tmp_path / "resident") for ph in phases]
    assert [s.memory_cap for s in mapping] == [size - estimate.resident - k * PROCESS_BYTES for k in (3, 2, 1)]
    assert estimate.resident > 0 and all(s.resident == str(tmp_path / "resident") for s in mapping)
    # Until its go, a pre-warmed phase (its warm-up too) holds what the budget counts a waiting one at.
    assert [s.waiting_cap for s in specs] == [PROCESS_BYTES - CONTEXT_BYTES] * 3
    assert 0 < PROCESS_BYTES - CONTEXT_BYTES < PROCESS_BYTES
    unbudgeted = phasespec.phase_spec(load_schedule(tiny(tmp_path, tiny_data)), phases, Work(phases[0], 0, None),
                                      tmp_path / "pd", estimate)
    assert unbudgeted.memory_cap == 0 and unbudgeted.waiting_cap == 0


def test_the_worker_caps_its_allocator_at_its_share(monkeypatch):
    import torch

    from launch.staging import cap_memory

    assert cap_memory(torch.device("cpu"), 1 << 30) is None
    set_to = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 80 << 30}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: set_to.append((f, d)))
    cuda = torch.device("cuda", 0)
    assert cap_memory(cuda, 0) is None and set_to == []
    assert cap_memory(cuda, 20 << 30) == 0.25 and set_to == [(0.25, cuda)]
    assert cap_memory(cuda, 100 << 30) == 1.0


def test_handover_host_sends_every_switch_through_host_memory(tmp_path, tiny_data, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # host memory needs no GPU
    path = tiny(tmp_path, tiny_data, handover="host")
    r = CliRunner().invoke(main, ["plan", str(path)])
    assert r.exit_code == 0, r.output
    assert 'switches after phases 0-1: through host memory: launch.handover = "host"' in r.stdout
    loaded = load_schedule(path)
    phases = plan_phases(loaded)
    parts = [phasespec.phase_spec(loaded, phases, Work(ph, ph.start_step, None), tmp_path / f"pd{ph.index}",
                                  None).handover for ph in phases]
    assert [(p.shm_offer, p.shm_take) for p in parts] == [(True, False), (True, True), (False, True)]


def test_7b_fits_24gib_with_its_optimizer_state_on_the_host(tmp_path, tiny_data):
    """The 7B LISA job (batch 4 x 512) at 24 GiB: the plan names gradient checkpointing, ZeRO 2 with
    the optimizer's state on the host and one phase pre-warmed; with them it passes, its phases'
    estimates hold no optimizer state and gather nothing at their end, the holder's copy of the
    model (launch.resident) beside them. Each phase's own copy instead of the holder's (the run of
    benchmarks/results/2026-12-06-issue42-h100-7b, 21.25 GiB by NVML outside its switches) is 1.8
    GiB less between switches (the trained weights are in the holder's block too, and its context),
    but two models at each switch."""
    path = schedule_7b(tmp_path, tiny_data, launch={"device_memory": "24GiB"})
    with pytest.raises(ScheduleError) as e:
        load_schedule(path)
    assert str(e.value).endswith(
        "would fit (23.1 GiB): model.gradient_checkpointing = true and deepspeed.zero_stage = 2 and "
        'deepspeed.config.zero_optimization.offload_optimizer = { device = "cpu" } and launch.prewarm_depth = 1')
    loaded = load_schedule(path, overrides=[
        "model.gradient_checkpointing=true", "deepspeed.zero_stage=2", "launch.prewarm_depth=1",
        'deepspeed.config={zero_optimization = {offload_optimizer = {device = "cpu"}}}'])
    phases = plan_phases(loaded)
    estimate = estimate_plan(loaded, phases)
    assert {m.optimizer for m in estimate.phases} == {0}
    assert budget.phase_peak(loaded, phases, estimate, 0) == estimate.resident + on_device(estimate.phases[0]) + \
        PROCESS_BYTES
    assert estimate.resident == estimate.count.total * 2 + CONTEXT_BYTES


def test_the_planned_peak_at_7b_under_24gib_is_what_an_h100_held(tmp_path, tiny_data):
    """benchmarks/results/2026-12-06-issue42-h100-7b: the 7B LISA job at 24 GiB with gradient
    checkpointing, micro-batches of 4, ZeRO 2 with the optimizer on the host and one phase
    pre-warmed held 16.07-16.46 GB allocated per phase (torch's peak) and 22.82 GB of the device
    by NVML outside its switches (at phase 0's end), each phase with its own copy of the model (the
    holder was off under a budget then). The gradients on the device: ZeRO's reduce bucket (5e8
    bf16 elements) and the largest parameter (the embedding) staged for the host."""
    launch = {"device_memory": "24GiB", "prewarm_depth": 1, "resident": "off"}
    loaded = load_schedule(schedule_7b(tmp_path, tiny_data, launch=launch,
                                       gradient_checkpointing=True), overrides=[
        "deepspeed.zero_stage=2", 'deepspeed.config={zero_optimization = {offload_optimizer = {device = "cpu"}}}'])
    phases = plan_phases(loaded)
    estimate = estimate_plan(loaded, phases)
    phase = estimate.phases[0]
    assert phase.gradients == 500_000_000 * 2 + 32000 * 4096 * (2 + 4)
    assert abs(phase.total - 16.46e9) <= 0.05 * 16.46e9
    nvml = 22_819_569_664
    assert abs(budget.phase_peak(loaded, phases, estimate, 0) - nvml) <= 0.05 * nvml
