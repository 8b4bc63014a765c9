"""Which phase switches hand the state over on the device, decided from the schedule alone.

At the switch from phase i to i + 1 a device handover lets the finished phase offer its state where
it lies and its pre-warmed successor copy it, so the successor trains while the predecessor writes
its checkpoint (``launch.contract.spec.HandoverPart``). It needs both phases alive at once on the same
devices, rank for rank; where the schedule rules that out, the switch goes through the checkpoint
as it always did. The rules, in the order ``boundary_reason`` names them:

- ``launch.handover = "off"``;
- ``launch.prewarm = false``: no successor is alive to take anything;
- a launcher other than "local": only the fork server starts both phases on this node, and more
  than one node needs another launcher (schedule.py), so this also rules out ``launch.nnodes > 1``
  (where, as under srun, every switch starts its phase cold: ``orchestrator.nodes.cold_switch``);
- different process counts: rank N hands to rank N;
- ZeRO stage 3: no process holds the whole head;
- module units (``Phase.modules``): the phase holds the fp32 weights of its layers' other modules
  on the host (``launch.record.Prepared.parts``), which only its checkpoint carries on.

The worker decides the rest at run time, from what it sees: no GPU (unless ``"on"``, which hands
over through a file), another GPU than its predecessor's, a device with less memory than the
overlap's planned peak (``orchestrator.estimate.overlap_peak``).
"""

from __future__ import annotations

from dataclasses import dataclass

from launch.contract.spec import HandoverPart
from orchestrator.budget import budget_of
from orchestrator.estimate import PlanEstimate
from orchestrator.nodes import cold_switch
from orchestrator.schedule import LoadedSchedule, Phase
from shard_tools.sizes import format_bytes


def boundary_reason(loaded: LoadedSchedule, phases: list[Phase], index: int) -> str | None:
    """Why the switch from phase ``index`` to the next goes through the checkpoint; None where it
    hands over on the device."""
    s, before, after = loaded.schedule, phases[index], phases[index + 1]
    launch = s.launch
    if launch.handover == "off":
        return 'launch.handover = "off"'
    if not launch.prewarm:
        return "launch.prewarm = false: no successor is alive to take the state"
    if launch.launcher != "local":
        return cold_switch(launch) or f'launch.launcher = "{launch.launcher}": only "local" starts both phases on this node'
    if before.nproc != after.nproc:
        return f"phase {before.index} runs {before.nproc} processes, phase {after.index} {after.nproc}"
    if s.deepspeed.zero_stage == 3:
        return "deepspeed.zero_stage = 3: no process holds the whole head"
    if before.modules or after.modules:
        return "module units: a handover carries whole layers' fp32 masters, a checkpoint each layer whole"
    return None


def handover_part(loaded: LoadedSchedule, phases: list[Phase], index: int,
                  estimate: PlanEstimate | None) -> HandoverPart:
    """Phase ``index``'s part of the handovers at its two switches: it offers at its end where the
    next switch hands over, and takes at its start where the previous one does. ``peak_bytes`` is
    the overlap's planned peak at the switch it takes at (0 where it takes nothing or ``estimate``
    is None: the model could not be sized)."""
    offer = index + 1 < len(phases) and boundary_reason(loaded, phases, index) is None
    take = index > 0 and boundary_reason(loaded, phases, index - 1) is None
    shm_offer = offer and through_host(loaded, index, estimate)
    shm_take = take and through_host(loaded, index - 1, estimate)
    peak = estimate.overlaps[index - 1] if take and not shm_take and estimate is not None else 0
    return HandoverPart(offer=offer, take=take, host=loaded.schedule.launch.handover == "on", peak_bytes=peak,
                        next_layers=list(phases[index + 1].layers) if offer else [],
                        shm_offer=shm_offer, shm_take=shm_take)


def through_host(loaded: LoadedSchedule, index: int, estimate: PlanEstimate | None, budget: int | None = None) -> bool:
    """Whether the switch after phase ``index``, where it hands over at all, goes through host
    memory: ``launch.handover = "host"``, or its overlap is above the budget (``budget``, else
    ``launch.device_memory``, where stated and the model sized)."""
    if loaded.schedule.launch.handover == "host":
        return True
    if budget is None:
        stated = budget_of(loaded)
        budget = stated.size if stated is not None else None
    return budget is not None and estimate is not None and estimate.overlaps[index] > budget


@dataclass(frozen=True)
class Switch:
    """One switch as ``orchestrator plan`` shows it."""

    after: int
    """The index of the phase that ends."""
    reason: str | None
    """Why it goes through the checkpoint or host memory; None: it hands over on the device."""
    peak: int | None
    """The overlap's planned peak on one device; None where the model could not be sized."""
    host: bool = False
    """It hands over through host memory (``reason`` says why)."""


def plan_switches(loaded: LoadedSchedule, phases: list[Phase], estimate: PlanEstimate | None,
                  device_memory: int | None = None, no_gpu: bool = False,
                  memory_name: str = "--device-memory") -> list[Switch]:
    """Every switch of the run; with ``device_memory`` (a budget: plan's --device-memory or
    launch.device_memory; or this machine's GPU: ``memory_name`` "this GPU's"), one whose overlap
    would not fit goes through host memory (a budget) or the checkpoint (the worker's own check
    against its device). With ``no_gpu`` (the phases will see none), one goes through the
    checkpoint, as the worker will, unless ``launch.handover`` is "on" (through a file) or "host"."""
    out = []
    mode = loaded.schedule.launch.handover
    for i in range(len(phases) - 1):
        peak = estimate.overlaps[i] if estimate is not None else None
        reason, via = boundary_reason(loaded, phases, i), False
        over = reason is None and None not in (peak, device_memory) and peak > device_memory
        said = f"overlap peak {format_bytes(peak)} per device, more than {memory_name} {format_bytes(device_memory)}" \
            if over else None
        if reason is None and (mode == "host" or (over and memory_name != "this GPU's")):
            reason, via = said or 'launch.handover = "host"', True
        elif reason is None and no_gpu and mode != "on":
            reason = 'no GPU: a handover needs both phases on one GPU (launch.handover = "on" tests it through a file)'
        elif over:
            reason = said
        out.append(Switch(after=i, reason=reason, peak=peak, host=via))
    return out
