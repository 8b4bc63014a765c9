"""The switch to a phase: a pre-warmed process waits for its go (``await_go``), reads what its
predecessor changed into the host model (``read_delta``, early where it can), builds the engine
(``assemble``, ``build_engine``) and puts the carried optimizer state in (``restore``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from launch import handover, pinned, preload, procs, resident
from launch.prepare import host_model, memory_now
from launch.record import Assembled, Phase, Prepared, Source
from launch.scaler import restore_scaler
from launch.engine import MOMENTS
from launch.groups import HEAD_DECAY, HEAD_NO_DECAY, param_groups
from shard_tools.checkpoint import populate_pages
from shard_tools.errors import CheckpointError
from shard_tools.later import Later
from shard_tools.manifest import Manifest
from shard_tools.state import PhaseState, kept_state, layer_weights, load_state


@dataclass(frozen=True)
class Go:
    """What the go names (or the spec, without a pre-warm): the checkpoint to restore, and the
    predecessor's phase directory where it offers its state (None: it does not)."""

    restore: Path | None
    offer_from: Path | None = None
    defer: bool = False
    """Where it takes the state over, the predecessor need not write its checkpoint: this phase
    carries what it trained on (``checkpoint.every_seconds``)."""


@dataclass(frozen=True)
class Delta:
    """What ``read_delta`` put into the host model: the checkpoint, its manifest as read then, the
    state it carries on, and the mapping of the head's moments going on meanwhile."""

    path: Path
    manifest: Manifest
    carried: PhaseState
    populating: Later[None]


def await_go(ph: Phase) -> tuple[Go, Delta | None]:
    """A pre-warmed process waits here until its predecessor's processes are gone. Once the
    predecessor's checkpoint is committed (while its processes still exit), what it changed
    is read (the head file mapped) into host memory already (the early ``Delta``): reading
    touches no device."""
    made, expected = ph.made, ph.checkpoints.at(ph.spec.start_step)
    refresh = preload.LayerRefresh(ph) if made.taking else None
    delta: Delta | None = None

    def idle() -> None:
        nonlocal delta
        if refresh is not None:  # it takes its predecessor's state over: no host model to read into
            refresh()
        elif delta is None and ph.checkpoints.committed(expected):
            _foreground(ph)  # this process is next: on the critical path from here
            delta = read_delta(ph, expected, early=True)

    ph.timeline.mark("t_waiting")
    go = procs.wait_for_go(Path(ph.spec.go_fifo), idle)
    ph.timeline.mark("t_go")
    _foreground(ph)
    paths = [Path(go[k]) if go[k] else None for k in ("restore", "handover")]
    return Go(*paths, defer=go["defer"] is True), delta


def _foreground(ph: Phase) -> None:
    if ph.timeline.get("background"):
        ph.timeline.add(background=not procs.background(False))


def read_delta(ph: Phase, restore: Path, early: bool = False) -> Delta | None:
    """Puts into the host model what changed since the weights it holds: the layers trained
    since, and the head; the state it carries on, for ``restore``. Early (before the go), None
    where it cannot be read yet: the go names only a checkpoint the orchestrator checked."""
    made, t0 = ph.made, time.time()
    try:
        if early and ph.checkpoints.manifest(restore).created < ph.timeline.get("t_process_start"):
            return None  # an older checkpoint at that step (damaged, being replaced): not the predecessor's
        sources = ph.checkpoints.layer_sources(restore)
        made.overlay(layer_weights({l: s for l, s in sources.items() if made.preloaded.get(l) != s}, mapped=True))
        t_layers = time.time()
        # The head file's pages, as its writer left them: the masters now, since they go into
        # the model before the engine is built; the moments while it is built (``restore``
        # waits for them), so that the go need not wait for them.
        carried, manifest = load_state(restore, mapped=True)
        populate_pages(list(carried.head["master"].values()))
        made.overlay(carried.head["master"])
    except (OSError, CheckpointError):
        if not early:
            raise
        return None
    made.preloaded = sources
    if early:
        ph.timeline.add(t_early_read_start=t0, t_early_read_end=time.time(), t_early_read_layers=t_layers)
    moments = [t for k in MOMENTS for t in carried.head[k].values()]
    return Delta(restore, manifest, carried, Later(populate_pages, moments))


def assemble(ph: Phase, go: Go, delta: Delta | None) -> Assembled:
    """Takes the predecessor's state over on the device (``launch.handover``), or reads what it
    changed (its layers and the head) unless read already; builds the engine."""
    made = ph.made
    ph.stage("building the engine")
    ph.timeline.add(memory_start=memory_now())
    if go.offer_from is not None:
        taken, base, before = handover.take(ph, go.offer_from, go.restore, go.defer)
        if taken is not None:  # its checkpoints wait for the predecessor's (or, where it writes none, for its base)
            ph.timeline.mark("t_delta_loaded")
            return build_engine(ph, made, Source(base, taken, taken=True, awaiting=base, before=before))
        ph.checkpoints.wait_committed(go.restore)  # it answered "not taken": the checkpoint is read once committed
    if made.skeleton:  # prepared to take over, but the go names a checkpoint only
        host_model(ph, made)
    if go.restore is not None:
        if delta is not None and (delta.path != go.restore or ph.checkpoints.manifest(go.restore) != delta.manifest):
            raise RuntimeError(f"the go names {go.restore}, but {delta.path} was read before it")
        delta = delta or read_delta(ph, go.restore)
    ph.timeline.mark("t_delta_loaded")
    source = Source(go.restore, delta.carried, populating=delta.populating) if delta else Source(go.restore, None)
    return build_engine(ph, made, source)


def build_engine(ph: Phase, made: Prepared, source: Source) -> Assembled:
    """Freezes all but the head and this phase's layers and builds the DeepSpeed engine on the host
    model, which holds the predecessor's weights by now."""
    spec, model, backend = ph.spec, made.model, ph.backend
    made.hold_parts()
    trainable = frozenset(made.head_names) | frozenset(made.body_names)
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ds_config = backend.config(spec, ph.world, numel)
    if made.resident is not None:
        resident.own(model, trainable)
    elif made.moving is not None:
        made.moving.result()
    else:
        backend.place(model, ph.device, made.staging, trainable)
    ph.timeline.mark("t_on_device")
    starts = body_starts(ph, source)
    groups, roles, group_starts = param_groups(model, set(made.head_names), set(made.body_names), spec.optimizer,
                                               starts)
    index = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    group_of = {n: index[id(p)] for n, p in model.named_parameters() if n in made.body_names}
    body_from = next((i for i, r in enumerate(roles) if r not in (HEAD_DECAY, HEAD_NO_DECAY)), None)
    with pinned.serving(made.arena):
        engine = backend.initialize(model, backend.optimizer(groups, spec, ph.device, ph.world, body_from=body_from),
                                    ds_config)
    if made.arena is not None:
        ph.timeline.add(pinned_ahead=made.arena.summary())
    named = dict(engine.module.named_parameters())
    ph.timeline.add(memory_engine=memory_now())
    ph.timeline.mark("t_engine_built")
    return Assembled(engine=engine, head=[(n, named[n]) for n in made.head_names],
                     body=[(n, named[n]) for n in made.body_names], roles=roles, starts=group_starts,
                     group_of=group_of, gas=ds_config["gradient_accumulation_steps"], source=source)


def body_starts(ph: Phase, source: Source) -> dict[str, int]:
    """The Adam step each body parameter starts the phase from (none given: 0). Resuming inside
    its phase, the checkpoint's: each one's own where it says (optimizer_state "keep"), else the
    body's. A new phase under "keep": the step of its layer's last visit, whose kept state
    (``Source.kept``) is read here, from the checkpoint that holds the layer's newest weights."""
    m, spec = source.carried, ph.spec
    if m is not None and not m.phase_complete and m.phase == spec.phase:
        steps = (m.body or {}).get("step") or {}
        return {n: int(steps[n].item()) if n in steps else m.body_step for n in ph.made.body_names}
    if spec.optimizer_state != "keep" or source.restore is None:
        return {}
    sources = _kept_sources(ph, source) if source.taken else ph.checkpoints.layer_sources(source.restore)
    mine = {l: sources[l] for l in spec.layers if l in sources}
    source.kept = kept_state(mine, mapped=True)  # copied into the optimizer by ``restore``
    source.kept_from = {}
    for layer, src in mine.items():
        m_src = ph.checkpoints.manifest(src)
        prefix = f"{ph.made.origin.layers_attr}.{layer}."
        source.kept_from.update({n: f"phase {m_src.phase} step {m_src.global_step}"
                                 for n in source.kept["step"] if n.startswith(prefix)})
    return {n: int(t.item()) for n, t in source.kept["step"].items()}


def _kept_sources(ph: Phase, source: Source) -> dict[int, Path]:
    """Taken over under "keep": where each layer's newest state lies. Where this phase trains a layer
    its predecessor trained, the predecessor's end checkpoint (``source.restore``, which it writes as
    this phase builds: waited for); else the checkpoint the predecessor built on (``source.before``),
    which holds the same for every other layer."""
    if set(ph.spec.layers) & set(source.carried.layers) or source.before is None:
        path = source.restore
    else:
        path = source.before
    ph.checkpoints.wait_committed(path)
    return ph.checkpoints.layer_sources(path)


def restore(ph: Phase) -> None:
    """Head optimizer state carries on (its moments new where ``optimizer_state`` is "drop-all");
    body state too when resuming inside its phase, and under "keep" a layer's kept state of its last
    visit (``Source.kept``); the rest of the body starts new."""
    made, built, backend = ph.made, ph.built, ph.backend
    m = built.source.carried
    if m is None:
        return
    same_phase = not m.phase_complete and m.phase == ph.spec.phase
    head_carries = same_phase or ph.spec.optimizer_state != "drop-all"
    head_step = m.head_step if head_carries else 0
    steps = [head_step if role in (HEAD_DECAY, HEAD_NO_DECAY) else start
             for role, start in zip(built.roles, built.starts)]
    ph.timeline.add(state_from=state_from(built, m, same_phase, head_carries))
    backend.materialise(built.engine, steps)
    if built.source.populating is not None:
        built.source.populating.result()
        built.source.populating = None
        ph.timeline.mark("t_head_populated")
    backend.set_state(built.head, m.head if head_carries else {"master": m.head["master"]},
                      with_moments=head_carries, staging=made.staging)
    ph.timeline.mark("t_head_set")
    _restore_body(ph, m, same_phase)
    backend.refresh_lp(built.engine)
    # The loss scale carries across phases like the head's state does.
    restore_scaler(backend.loss_scaler(built.engine), m.run.scaler)
    if same_phase:
        _restore_rng(ph, m.run.rng)
    built.source.carried = built.source.kept = None  # on the device now; the mapping of the head file can go
    made.trained = {}
    if built.source.taken:  # and those of a device offer, copied from straight into the engine's state
        handover.let_go_of_offer(ph)
    ph.timeline.mark("t_restored")


def _restore_body(ph: Phase, m: PhaseState, same_phase: bool) -> None:
    """The body's masters trained before, and its moments: the phase's own (resuming inside it),
    a layer's kept ones (``Source.kept``), or none (new)."""
    made, built, backend = ph.made, ph.built, ph.backend
    body_masters = {n: made.trained[n] for n, _ in built.body if n in made.trained}
    if same_phase:
        backend.set_state(built.body, {**m.body, "master": body_masters}, with_moments=True)
        return
    kept = built.source.kept or {"step": {}}
    with_kept = [(n, p) for n, p in built.body if n in body_masters and n in kept["step"]]
    backend.set_state(with_kept, {**kept, "master": body_masters}, with_moments=True, staging=made.staging)
    fresh = [(n, p) for n, p in built.body if n in body_masters and n not in kept["step"]]
    backend.set_state(fresh, {"master": body_masters}, with_moments=False, staging=made.staging)


def state_from(built: Assembled, m: PhaseState, body_carries: bool, head_carries: bool) -> dict[str, str]:
    """Per trained tensor, what its optimizer state starts this phase from: "fresh", or the state
    of the checkpoint (or handover) ``m`` at its step ("phase P step S"), or under "keep" that of
    the checkpoint a layer's state was kept in; the phase's records and checkpoints say it
    (``shard-tools inspect``)."""
    kept = f"phase {m.phase} step {m.step}"
    return {**{n: kept if head_carries else "fresh" for n, _ in built.head},
            **{n: kept if body_carries else built.source.kept_from.get(n, "fresh") for n, _ in built.body}}


def _restore_rng(ph: Phase, saved: dict[str, torch.Tensor]) -> None:
    key = f"cpu.rank{ph.rank}"
    if key in saved:
        torch.set_rng_state(saved[key])
    if torch.cuda.is_available() and f"cuda.rank{ph.rank}" in saved:
        torch.cuda.set_rng_state(saved[f"cuda.rank{ph.rank}"])
