"""Whether a run's phases map one copy of the model per device for the whole run, kept by a holder
process (``launch.resident``; the holder and the mapping: ``launch.resident``), decided from the
schedule and whether the phases will see a GPU.

The holder is forked by the run's fork server, so it needs one (``launch.prewarm``, the local
launcher, one node); one holder per rank, so every phase runs as many processes; every process
holds the whole model (not ZeRO-3). Under ``launch.device_memory`` the budget counts the holder once
per device and each phase's share without the model (``orchestrator.budget``), which needs a model
the estimate can size. Without a GPU the phases' copies are the fork server's pages, shared
already: "auto" holds nothing there; "on" holds the weights in a memfd, the same protocol, for
testing it on a CPU.
"""

from __future__ import annotations

from pathlib import Path

from launch.contract.files import RunDir
from orchestrator.errors import ScheduleError
from orchestrator.schedule import LoadedSchedule, Phase


def resident_reason(loaded: LoadedSchedule, phases: list[Phase], gpus: int, sized: bool = True) -> str | None:
    """Why every phase keeps a copy of its own of the model; None: they map the holder's.
    ``sized``: the estimate knows the model's size (``orchestrator.estimate``)."""
    s = loaded.schedule
    launch = s.launch
    if launch.resident == "off":
        return 'launch.resident = "off"'
    if not launch.prewarm or launch.launcher != "local" or launch.nnodes > 1:
        return "the holder is forked by the fork server: launch.prewarm = true, the local launcher, one node"
    if s.deepspeed.zero_stage == 3:
        return "deepspeed.zero_stage = 3: no process holds the whole model"
    if len({ph.nproc for ph in phases}) > 1:
        return "the phases run different numbers of processes: one holder per rank"
    if launch.device_memory is not None and not sized:
        return "launch.device_memory with a model the estimate cannot size: the budget could not count the holder"
    if gpus == 0 and launch.resident == "auto":
        return 'no GPU: the phases share the fork server\'s pages (launch.resident = "on" holds them in host memory)'
    return None


def resident_dir(loaded: LoadedSchedule, phases: list[Phase], gpus: int, sized: bool = True) -> Path | None:
    """The holder's folder where the phases map its weights, None where they do not; a
    ScheduleError (exit 2) where ``launch.resident = "on"`` and the run cannot."""
    reason = resident_reason(loaded, phases, gpus, sized)
    if reason is not None and loaded.schedule.launch.resident == "on":
        raise ScheduleError(f'{loaded.source}: launch.resident = "on", but {reason}')
    return RunDir(loaded.output_dir).resident.path if reason is None else None
