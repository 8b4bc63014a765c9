"""The device budget: how much of one GPU relayer's processes may hold together
(``launch.device_memory``, or ``orchestrator plan --device-memory`` for the same question asked
of another card), and what the plan does to keep it.

What one device holds, by the formulas and constants of ``orchestrator.estimate``:

    while phase i trains   held + on_device(i) + waiting(i) x PROCESS_BYTES
                           (held: the holder's copy of the model and its context, where the phases
                           map it, ``launch.resident``; on_device(i) then counts only what i trains)
                           (waiting(i): the phases pre-warmed beside it, up to launch.prewarm_depth)
    at its end             the same + what it gathers to save or offer (ZeRO >= 1: the head's fp32
                           masters and moments, its layers' masters; at ZeRO 0 the optimizer's own)
    a device handover      overlap_peak: the finished phase let go, the offer, the successor with its
                           copy of it, the phases waiting (PROCESS_BYTES each, their share)

A switch goes, in this order, the first way that fits: on the device (the overlap fits the
budget); else, where the rules of ``orchestrator.handover`` let a handover happen at all, through
host memory (``HandoverPart.shm_offer``/``shm_take``, launch/hostpath.py: the predecessor writes
its fp32 end state to a file in shared memory and lets go of its device memory before the
successor builds: the device then holds the end's peak, never two phases); else through the
checkpoint (the same peak). Not counted: the predecessor's CUDA context (about 0.5 GB) while it
writes its checkpoint beside the successor. Where a phase alone, or its
end, is above the budget, no way fits: the schedule is refused (exit 2), naming the keys that
would make it fit (``what_would_fit``).

Each process's caching allocator is capped (``PhaseSpec.memory_cap``, the worker's
``torch.cuda.set_per_process_memory_fraction``) at the budget less the holder's part and the fixed
part of itself and of every phase waiting beside it (the holder's block, mapped by CUDA IPC, is
outside a phase's allocator): a phase whose estimate is short fails with an out-of-memory error
inside its share instead of taking more of the device. Not capped by it: the CUDA contexts
themselves (counted as ``PROCESS_BYTES``). A phase pre-warmed beside a training one is counted at
``PROCESS_BYTES``, so until its go its allocator is capped at that less its context
(``PhaseSpec.waiting_cap``): its warm-up (a one-layer model and its optimizer, which runs while the
current phase trains) is skipped where it does not fit there. Uncapped, the warm-ups of the two
phases waiting at 1.1B took the device to 25.4 GiB under a budget of 24 GiB on the H100
(benchmarks/results/2026-12-06-issue42-h100).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from orchestrator.errors import ScheduleError
from orchestrator.estimate import (
    CONTEXT_BYTES, PROCESS_BYTES, RESERVE, EstimateError, PlanEstimate, estimate_plan, offered_bytes, on_device,
    trained_head,
)
from orchestrator.libfacts import offloads_optimizer
from orchestrator.schedule import LoadedSchedule, Phase
from shard_tools.sizes import format_bytes, parse_size

KEY = "launch.device_memory"


@dataclass(frozen=True)
class Budget:
    size: int
    """Bytes of one device relayer's processes may hold together."""
    name: str
    """Where it was stated: ``launch.device_memory`` or ``--device-memory``."""


def budget_of(loaded: LoadedSchedule, option: int | None = None) -> Budget | None:
    """The budget plan keeps: its --device-memory (``option``), else the schedule's key; None: none stated."""
    if option is not None:
        return Budget(option, "--device-memory")
    text = loaded.schedule.launch.device_memory
    size = parse_size(text) if text is not None else None
    return Budget(size, KEY) if size is not None else None


def waiting_during(loaded: LoadedSchedule, phases: list[Phase], index: int) -> int:
    """How many pre-warmed phases wait on the device while phase ``index`` trains."""
    launch = loaded.schedule.launch
    if not launch.prewarm or launch.nnodes > 1 or launch.launcher == "slurm":
        return 0
    return min(launch.prewarm_depth, len(phases) - index - 1)


def phase_peak(loaded: LoadedSchedule, phases: list[Phase], estimate: PlanEstimate, index: int) -> int:
    """Bytes on one device while phase ``index`` trains and ends: the holder's (``estimate.resident``),
    its own, what it gathers at its end (ZeRO >= 1), and the fixed part of each phase waiting beside it."""
    gathered = 0  # at ZeRO 0 the optimizer's own memory; offloaded, on the host (assumed: not measured on a GPU)
    if loaded.schedule.deepspeed.zero_stage > 0 and not offloads_optimizer(loaded.deepspeed_config):
        gathered = offered_bytes(estimate.count, trained_head(loaded, estimate.count), len(phases[index].layers))
    waiting = waiting_during(loaded, phases, index)
    return estimate.resident + on_device(estimate.phases[index]) + gathered + waiting * PROCESS_BYTES


def memory_cap(loaded: LoadedSchedule, phases: list[Phase], index: int, held: int = 0, size: int | None = None) -> int:
    """What phase ``index``'s caching allocator may reserve on its device (``PhaseSpec.memory_cap``):
    the budget (``size``, else the schedule's) less the holder's part (``held``: ``PlanEstimate.resident``
    where the phases map its copy) and the fixed part of itself and of each phase waiting beside it;
    0: no budget."""
    if size is None:
        budget = budget_of(loaded)
        if budget is None:
            return 0
        size = budget.size
    return max(1, size - held - (1 + waiting_during(loaded, phases, index)) * PROCESS_BYTES)


def waiting_cap(loaded: LoadedSchedule) -> int:
    """What a phase's caching allocator may reserve while it waits pre-warmed (``PhaseSpec.waiting_cap``):
    its fixed part as the budget counts it, less its context; 0: no budget."""
    return 0 if budget_of(loaded) is None else PROCESS_BYTES - CONTEXT_BYTES


def check_budget(loaded: LoadedSchedule, phases: list[Phase], option: int | None = None) -> None:
    """Raises ScheduleError (exit 2) where a phase cannot keep the budget whichever way its switches
    go, naming what would fit; a model the estimate cannot size is not checked (its processes are
    still capped)."""
    budget = budget_of(loaded, option)
    if budget is None:
        return
    try:
        estimate = estimate_plan(loaded, phases)
    except EstimateError:
        return
    peaks = [phase_peak(loaded, phases, estimate, i) for i in range(len(phases))]
    worst = max(range(len(phases)), key=peaks.__getitem__)
    if peaks[worst] <= budget.size:
        return
    raise ScheduleError(f"{loaded.source}: {budget.name}: phase {worst} needs {format_bytes(peaks[worst])} of one "
                        f"device ({_parts(loaded, phases, estimate, worst)}), more than {format_bytes(budget.size)}; "
                        f"{what_would_fit(loaded, budget.size)}")


def _parts(loaded: LoadedSchedule, phases: list[Phase], estimate: PlanEstimate, index: int) -> str:
    waiting = waiting_during(loaded, phases, index)
    m = estimate.phases[index]
    held = f"the holder's copy of the model {format_bytes(estimate.resident)} (launch.resident) + " \
        if estimate.resident else ""
    return (f"{held}its weights {format_bytes(m.weights)} + the rest of its estimate {format_bytes(m.total - m.weights)} "
            f"x {RESERVE} for the allocator + {format_bytes(PROCESS_BYTES)} a process"
            + (f", {waiting} phase{'s' * (waiting > 1)} waiting pre-warmed" if waiting else ""))


OFFLOAD = "deepspeed.config.zero_optimization.offload_optimizer"


def _remedies(loaded: LoadedSchedule) -> list[dict]:
    """What may make a phase smaller, in the order a user would try them; each schedule keys and
    their values: the optimizer's state on the host needs ZeRO 1 or 2 (orchestrator.libfacts)."""
    stage = loaded.schedule.deepspeed.zero_stage
    offload = {**({"deepspeed.zero_stage": 2} if stage not in (1, 2) else {}), OFFLOAD: {"device": "cpu"}}
    return [{"model.gradient_checkpointing": True}, {"data.micro_batch_size": 1}, offload, {"launch.prewarm_depth": 1}]


def what_would_fit(loaded: LoadedSchedule, size: int) -> str:
    """The fewest of ``_remedies`` (those not set already) under which every phase fits ``size``,
    the optimizer's state on the host (a step on the host's cores: the slowest) only where nothing
    else does; in words; or what is left above it with all of them."""
    from itertools import combinations

    todo = [r for r in _remedies(loaded) if any(_current(loaded, k) != v for k, v in r.items())]
    combos = [c for n in range(1, len(todo) + 1) for c in combinations(todo, n)]
    for combo in sorted(combos, key=lambda c: (any(OFFLOAD in r for r in c), len(c))):
        peak = _worst_peak(_changed(loaded, combo))
        if peak <= size:
            return f"would fit ({format_bytes(peak)}): {_words(combo)}"
    peak = _worst_peak(_changed(loaded, todo))
    tried = f" even with {_words(todo)}" if todo else ""
    return f"nothing relayer offers fits: {format_bytes(peak)}{tried} (a smaller data.seq_len, or a larger device)"


def _words(combo) -> str:
    def toml(v) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {toml(x)}" for k, x in v.items()) + " }"
        return json.dumps(v)

    return " and ".join(f"{k} = {toml(v)}" for r in combo for k, v in r.items())


def _current(loaded: LoadedSchedule, key: str):
    if key == OFFLOAD:
        return loaded.deepspeed_config.get("zero_optimization", {}).get("offload_optimizer")
    section, _, name = key.partition(".")
    return getattr(getattr(loaded.schedule, section), name)


def _changed(loaded: LoadedSchedule, combo) -> LoadedSchedule:
    s, ds = loaded.schedule, loaded.deepspeed_config
    for remedy in combo:
        for key, value in remedy.items():
            if key == OFFLOAD:
                ds = {**ds, "zero_optimization": {**ds.get("zero_optimization", {}), "offload_optimizer": value}}
                continue
            section, _, name = key.partition(".")
            s = s.model_copy(update={section: getattr(s, section).model_copy(update={name: value})})
    return loaded.model_copy(update={"schedule": s, "deepspeed_config": ds})


def _worst_peak(loaded: LoadedSchedule) -> int:
    from orchestrator.plan import plan_phases

    phases = plan_phases(loaded)
    estimate = estimate_plan(loaded, phases)
    return max(phase_peak(loaded, phases, estimate, i) for i in range(len(phases)))


def budget_line(loaded: LoadedSchedule, phases: list[Phase], estimate: PlanEstimate, budget: Budget) -> str:
    """plan's line on the budget: the run's planned peak on one device outside a device handover
    (which is shown with its switch) and each phase's allocator cap."""
    peaks = [phase_peak(loaded, phases, estimate, i) for i in range(len(phases))]
    worst = max(range(len(phases)), key=peaks.__getitem__)
    caps = {memory_cap(loaded, phases, i, estimate.resident, budget.size) for i in range(len(phases))}
    return (f"device budget {format_bytes(budget.size)} ({budget.name}): a phase holds at most "
            f"{format_bytes(peaks[worst])} of one device (phase {worst}: {_parts(loaded, phases, estimate, worst)}); "
            f"each process's allocator capped at {format_bytes(min(caps))}"
            + (f" to {format_bytes(max(caps))}" if len(caps) > 1 else ""))
