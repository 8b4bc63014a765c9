"""A taking phase's layers' fp32 masters (``Prepared.trained``): the layers it trains that phases
before its go trained, read while it waits (``preload_layers`` at its start, ``LayerRefresh`` as
checkpoints are committed) into pinned host memory, and at the go the rest (``put_layers`` now) and
to the device (``upload``), unless the masters live on the host (the optimizer offloaded), where
the restore copies them into the host partitions. A layer its predecessor trains comes with the
offer (``launch.handover``)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from launch.record import Phase, Prepared
from shard_tools.errors import CheckpointError
from shard_tools.state import layer_weights


def preload_layers(ph: Phase, made: Prepared) -> None:
    """The fp32 masters of this phase's layers trained before its preload checkpoint, in pinned host
    memory until its go (``put_layers``); a layer its predecessor trains comes with the offer."""
    put_layers(ph, made, {l: s for l, s in made.preloaded.items() if l in ph.spec.layers})


class LayerRefresh:
    """Called while a phase that takes over waits for its go: its layers that phases since its
    preload have trained, from the newest phase-end checkpoint this run has committed meanwhile, go
    on its device then, so that the go reads only what comes after (``handover._layers_trained_between``).
    Without it, a layer that LISA samples again within ``prewarm_depth`` phases was read from disk
    at the go. Looks every ``every`` seconds; reads only when a new checkpoint is there."""

    def __init__(self, ph: Phase, every: float = 0.2):
        self.ph, self.every, self.at, self.seen = ph, every, 0.0, None

    def __call__(self) -> None:
        ph, now = self.ph, time.monotonic()
        if now - self.at < self.every:
            return
        self.at = now
        ckpts = ph.checkpoints.upto(ph.spec.start_step)
        if not ckpts or ckpts[-1] == self.seen:
            return
        try:
            # A phase's end written since this process started: not one an earlier attempt left.
            upto = ph.checkpoints.newest_phase_end(ph.spec.start_step, ph.timeline.get("t_process_start"))
            sources = ph.checkpoints.layer_sources(upto) if upto is not None else {}
            changed = own_since(ph, sources)
            put_layers(ph, ph.made, changed)
        except (OSError, CheckpointError):
            return  # written over or removed meanwhile: again at the next look, or at the go
        self.seen = ckpts[-1]
        ph.made.preloaded.update(changed)
        if changed:
            ph.timeline.add(layers_refreshed=sorted({*ph.timeline.get("layers_refreshed", []), *changed}))


def own_since(ph: Phase, sources: dict[int, Path]) -> dict[int, Path]:
    """This phase's layers whose newest source in ``sources`` is not the one on its device."""
    return {l: s for l, s in sources.items() if l in ph.spec.layers and ph.made.preloaded.get(l) != s}


def put_layers(ph: Phase, made: Prepared, sources: dict[int, Path], offered: frozenset[str] = frozenset(),
               now: bool = False) -> None:
    """The fp32 masters of this phase's layers in ``sources``, except ``offered`` ones: on its
    device ``now`` (at the go; where the masters live on the host, mapped), else in pinned host
    memory until the go (``upload``): a waiting phase holds nothing large on the device."""
    for name, t in layer_weights(sources, mapped=True).items():
        if name in made.body_names and name not in offered:
            if now and ph.backend.masters_on_host(ph.spec):
                made.trained[name] = t  # the restore copies it into the host partition
            elif now or ph.device.type != "cuda":
                made.trained[name] = t.to(ph.device, copy=True)
            else:
                made.trained[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)


def upload(ph: Phase) -> None:
    """At the go: the masters ``put_layers`` kept on the host, to the device by DMA, on the stream the
    engine build then uses; not where they live on the host (at 7B under 24 GiB on an H100 they were
    the device's peak, 24.1 GiB, uploaded beside the predecessor and copied back to the host:
    benchmarks/results/2026-12-07-issue42-h100-switch)."""
    if ph.backend.masters_on_host(ph.spec):
        return
    for name, t in ph.made.trained.items():
        if t.device != ph.device:
            ph.made.trained[name] = t.to(ph.device, non_blocking=True)
