"""One phase inside one process group: prepare, switch (go, read the delta, build, restore), train,
save. Each stage lives in a module of its own (``launch.prepare``, ``launch.switch``,
``launch.train``, ``launch.save``, ``launch.handover``) and returns what it made into the phase's
record (``launch.record``). See ``launch.worker``."""

from __future__ import annotations

import gc
from pathlib import Path

from torch import nn

from launch import handover, importance, prepare, procs, resident, save, switch, train
from launch.profiling import switch_profile
from launch.contract.spec import PhaseSpec
from launch.record import Phase
from launch.staging import cap_memory
from launch.threads import FreeCores, set_threads

PREEMPTED = 75  # EX_TEMPFAIL: a checkpoint was written, run again to go on


def run_phase(spec: PhaseSpec, rank: int, world: int, stop: dict,
              prebuilt: dict[str, nn.Module] | None = None) -> int:
    # The process group is not destroyed: the process exits right after (launch.worker), which
    # frees it and all device memory; an orderly NCCL teardown would only delay the next phase.
    phase = Phase(spec, rank, world, prebuilt)
    try:
        phase.made = prepare.prepare(phase)
        # What preparing made lives as long as the phase: collections scan only what comes after,
        # and none pauses the switch (back on after the first step, ``train._first_step_done``).
        gc.freeze()
        gc.disable()
        phase.timeline.add(gc_collections_before_switch=procs.gc_collections())
        restore = Path(spec.restore) if spec.restore else None
        go, delta = switch.await_go(phase) if spec.prewarm else (switch.Go(restore), None)
        if phase.waits_in_a_share:  # its predecessor is gone
            phase.timeline.add(memory_fraction=cap_memory(phase.device, spec.memory_cap))
        cores = FreeCores()
        with switch_profile(Path(spec.phase_dir) / f"switch-profile-rank{rank}.txt"):
            phase.built = switch.assemble(phase, go, delta)
            switch.restore(phase)
            handover.await_leaving(phase)
        set_threads(phase, cores)
        done = train.train(phase, stop)
        if done:  # the next phase maps what this one trained (launch.resident)
            resident.write_back(phase)
            importance.write(phase)  # before the successor can start: it may be drawn by it
        snap, write = handover.offer(phase) if done else (None, True)
        if write:  # else its successor took its state and carries it on to its own checkpoint
            save.save(phase, phase_complete=done, snap=snap)
        if phase.wandb is not None:
            phase.wandb.finish()
    except BaseException:
        phase.discard()
        raise
    phase.write_records()
    return 0 if done else PREEMPTED

