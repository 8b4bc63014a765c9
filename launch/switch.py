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
from launch.handover import Carried
from launch.prepare import Background, build_engine, host_model, memory_now, overlay
from launch.save import await_predecessor
from launch.scaler import restore_scaler
from launch.zero_state import HEAD_DECAY, HEAD_NO_DECAY
from shard_tools.checkpoint import BODY_OPTIM, HEAD, STATE, layer_weights, load_tensors, optim_state, populate_pages
from shard_tools.errors import CheckpointError
from shard_tools.manifest import MANIFEST, Manifest, checkpoints_dir, layer_sources, step_dir_name

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
    expected = checkpoints_dir(ph.run_dir) / step_dir_name(ph.spec.start_step)

    refresh = handover.LayerRefresh(ph) if ph.refusal is None else None

    def idle() -> None:
        if refresh is not None:  # it takes its predecessor's state over: no host model to read into
            refresh()
        elif ph.delta is None and (expected / MANIFEST).exists():
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
        manifest = Manifest.from_json((restore / MANIFEST).read_text(), restore)
        if early and manifest.created < ph.timeline.get("t_process_start"):
            return  # an older checkpoint at that step (damaged, being replaced): not the predecessor's
        sources = layer_sources(ph.run_dir, restore)
        overlay(ph, layer_weights({l: s for l, s in sources.items() if ph.preloaded.get(l) != s}, mapped=True))
        t_layers = time.time()
        # The head file's pages, as its writer left them: the masters now, since they go into
        # the model before the engine is built; the moments while it is built (``restore``
        # waits for them), so that the go need not wait for them.
        ph.head_state = optim_state(restore, HEAD, mapped=True, populate=False)
        populate_pages(list(ph.head_state["master"].values()))
        overlay(ph, ph.head_state["master"])
    except (OSError, CheckpointError):
        if not early:
            raise
        return  # read again at the go, which names only a checkpoint the orchestrator checked
    ph.populating = Background(populate_pages, [t for k in zero_state.MOMENTS for t in ph.head_state[k].values()])
    ph.preloaded, ph.delta = sources, Delta(restore, manifest)
    ph.carried = Carried(head_step=manifest.head_step, body_step=manifest.body_step, phase=manifest.phase,
                         phase_complete=manifest.phase_complete, scaler=None)
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
        if ph.delta is not None and (ph.delta.path != restore or _manifest_now(restore) != ph.delta.manifest):
            raise RuntimeError(f"the go names {restore}, but {ph.delta.path} was read before it")
        if ph.delta is None:
            read_delta(ph, restore)
    ph.timeline.mark("t_delta_loaded")
    build_engine(ph)


def _manifest_now(ckpt: Path) -> Manifest:
    return Manifest.from_json((ckpt / MANIFEST).read_text(), ckpt)


def restore(ph: Phase) -> None:
    """Head optimizer state carries on; body state too only when resuming inside its phase."""
    m = ph.carried
    if m is None:
        return
    ckpt = Path(ph.restore_path)
    same_phase = not m.phase_complete and m.phase == ph.spec.phase
    body_step = m.body_step if same_phase else 0
    steps = [m.head_step if role in (HEAD_DECAY, HEAD_NO_DECAY) else body_step for role in ph.roles]
    zero_state.materialise(ph.engine, steps)
    if ph.populating is not None:
        ph.populating.join()
        ph.populating = None
        ph.timeline.mark("t_head_populated")
    zero_state.set_state(ph.head, ph.head_state, with_moments=True, staging=ph.staging)
    ph.timeline.mark("t_head_set")
    body_masters = {n: ph.trained[n] for n, _ in ph.body if n in ph.trained}
    if same_phase:
        body = optim_state(ckpt, BODY_OPTIM)
        body["master"] = body_masters
        zero_state.set_state(ph.body, body, with_moments=True)
    else:
        fresh = [(n, p) for n, p in ph.body if n in body_masters]
        zero_state.set_state(fresh, {"master": body_masters}, with_moments=False, staging=ph.staging)
    zero_state.refresh_lp(ph.engine)
    # The loss scale carries across phases like the head's state does.
    restore_scaler(getattr(ph.engine.optimizer, "loss_scaler", None),
                   m.scaler if m.scaler is not None else load_tensors(ckpt / STATE))
    if same_phase:
        _restore_rng(ph, ckpt)
    ph.head_state = None  # on the device now; the mapping of the head file can go
    ph.trained = {}
    ph.timeline.mark("t_restored")


def _restore_rng(ph: Phase, ckpt: Path) -> None:
    saved = load_tensors(ckpt / STATE, "rng/")
    key = f"cpu.rank{ph.rank}"
    if key in saved:
        torch.set_rng_state(saved[key])
    if torch.cuda.is_available() and f"cuda.rank{ph.rank}" in saved:
        torch.cuda.set_rng_state(saved[f"cuda.rank{ph.rank}"])
