"""The switch to a phase: a pre-warmed process waits for its go (``await_go``), reads what its
predecessor changed into the host model (``read_delta``, early where it can), builds the engine
(``assemble``) and puts the carried optimizer state in (``restore``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from launch import handover, procs, zero_state
from launch.prepare import Background, build_engine, host_model, memory_now, overlay
from launch.save import await_predecessor
from launch.scaler import restore_scaler
from launch.zero_state import HEAD_DECAY, HEAD_NO_DECAY
from shard_tools.checkpoint import populate_pages
from shard_tools.errors import CheckpointError
from shard_tools.manifest import Manifest
from shard_tools.state import layer_weights, load_state

if TYPE_CHECKING:
    from launch.phase import Phase


@dataclass(frozen=True)
class Delta:
    """The checkpoint whose changes the host model holds, and its manifest as read then."""

    path: Path
    manifest: Manifest


def await_go(ph: Phase) -> None:
    """A pre-warmed process waits here until its predecessor's processes are gone. Once the
    predecessor's checkpoint is committed (while its processes still exit), what it changed
    is read (the head file mapped) into host memory already: reading touches no device."""
    expected = ph.checkpoints.at(ph.spec.start_step)

    refresh = handover.LayerRefresh(ph) if ph.refusal is None else None

    def idle() -> None:
        if refresh is not None:  # it takes its predecessor's state over: no host model to read into
            refresh()
        elif ph.delta is None and ph.checkpoints.committed(expected):
            _foreground(ph)  # this process is next: on the critical path from here
            read_delta(ph, expected, early=True)

    ph.timeline.mark("t_waiting")
    go = procs.wait_for_go(Path(ph.spec.go_fifo), idle)
    ph.timeline.mark("t_go")
    _foreground(ph)
    ph.restore_path = go["restore"]
    ph.handover_from = go["handover"]


def _foreground(ph: Phase) -> None:
    if ph.timeline.get("background"):
        ph.timeline.add(background=not procs.background(False))


def read_delta(ph: Phase, restore: Path, early: bool = False) -> None:
    """Puts into the host model what changed since the weights it holds: the layers trained
    since, and the head; keeps the head's optimizer state for ``restore``."""
    t0 = time.time()
    try:
        if early and ph.checkpoints.manifest(restore).created < ph.timeline.get("t_process_start"):
            return  # an older checkpoint at that step (damaged, being replaced): not the predecessor's
        sources = ph.checkpoints.layer_sources(restore)
        overlay(ph, layer_weights({l: s for l, s in sources.items() if ph.preloaded.get(l) != s}, mapped=True))
        t_layers = time.time()
        # The head file's pages, as its writer left them: the masters now, since they go into
        # the model before the engine is built; the moments while it is built (``restore``
        # waits for them), so that the go need not wait for them.
        carried, manifest = load_state(restore, mapped=True)
        populate_pages(list(carried.head["master"].values()))
        overlay(ph, carried.head["master"])
    except (OSError, CheckpointError):
        if not early:
            raise
        return  # read again at the go, which names only a checkpoint the orchestrator checked
    ph.populating = Background(populate_pages, [t for k in zero_state.MOMENTS for t in carried.head[k].values()])
    ph.preloaded, ph.delta, ph.carried = sources, Delta(restore, manifest), carried
    if early:
        ph.timeline.add(t_early_read_start=t0, t_early_read_end=time.time(), t_early_read_layers=t_layers)


def assemble(ph: Phase) -> None:
    """Takes the predecessor's state over on the device (``launch.handover``), or reads what it
    changed (its layers and the head) unless read already; builds the engine."""
    ph.stage("building the engine")
    ph.timeline.add(memory_start=memory_now())
    restore = Path(ph.restore_path) if ph.restore_path else None
    if ph.handover_from is not None:
        ph.awaiting = restore  # this phase's checkpoints wait for the predecessor's
        if handover.take(ph, Path(ph.handover_from)):
            ph.timeline.mark("t_delta_loaded")
            build_engine(ph)
            return
        await_predecessor(ph)  # it answered "not taken": the checkpoint is read once committed
    if ph.refusal is None:  # prepared to take over, but the go names a checkpoint only
        host_model(ph)
    if restore is not None:
        if ph.delta is not None and (ph.delta.path != restore or ph.checkpoints.manifest(restore) != ph.delta.manifest):
            raise RuntimeError(f"the go names {restore}, but {ph.delta.path} was read before it")
        if ph.delta is None:
            read_delta(ph, restore)
    ph.timeline.mark("t_delta_loaded")
    build_engine(ph)


def restore(ph: Phase) -> None:
    """Head optimizer state carries on; body state too only when resuming inside its phase."""
    m = ph.carried
    if m is None:
        return
    same_phase = not m.phase_complete and m.phase == ph.spec.phase
    body_step = m.body_step if same_phase else 0
    steps = [m.head_step if role in (HEAD_DECAY, HEAD_NO_DECAY) else body_step for role in ph.roles]
    zero_state.materialise(ph.engine, steps)
    if ph.populating is not None:
        ph.populating.join()
        ph.populating = None
        ph.timeline.mark("t_head_populated")
    zero_state.set_state(ph.head, m.head, with_moments=True, staging=ph.staging)
    ph.timeline.mark("t_head_set")
    body_masters = {n: ph.trained[n] for n, _ in ph.body if n in ph.trained}
    if same_phase:
        zero_state.set_state(ph.body, {**m.body, "master": body_masters}, with_moments=True)
    else:
        fresh = [(n, p) for n, p in ph.body if n in body_masters]
        zero_state.set_state(fresh, {"master": body_masters}, with_moments=False, staging=ph.staging)
    zero_state.refresh_lp(ph.engine)
    # The loss scale carries across phases like the head's state does.
    restore_scaler(getattr(ph.engine.optimizer, "loss_scaler", None), m.run.scaler)
    if same_phase:
        _restore_rng(ph, m.run.rng)
    ph.carried = None  # on the device now; the mapping of the head file can go
    ph.trained = {}
    ph.timeline.mark("t_restored")


def _restore_rng(ph: Phase, saved: dict[str, torch.Tensor]) -> None:
    key = f"cpu.rank{ph.rank}"
    if key in saved:
        torch.set_rng_state(saved[key])
    if torch.cuda.is_available() and f"cuda.rank{ph.rank}" in saved:
        torch.cuda.set_rng_state(saved[f"cuda.rank{ph.rank}"])
