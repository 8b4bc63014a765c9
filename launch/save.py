"""Saving a phase's checkpoint: full tensors gathered on every rank (collectives), rank 0 writes
them, into files it made ahead (``prepare_files``) where they fit, and commits the manifest."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from launch.contract import faults
from launch.contract.spec import lr_at
from launch.record import Phase, Prepared
from launch.scaler import scaler_fields
from launch.engine import to_host
from launch.groups import BODY_DECAY, BODY_NO_DECAY, HEAD_DECAY, HEAD_NO_DECAY
from shard_tools.errors import CheckpointError
from shard_tools.later import Later
from shard_tools.manifest import layer_of
from shard_tools.state import PhaseState, RunState, StateFiles, save_state


def snapshot(ph: Phase, on_device: bool = True) -> PhaseState:
    """The phase-end state, full tensors on every rank (collectives): what a finished phase offers
    its successor (``launch.handover``) and, once answered, writes from its own memory. On the
    device, or (``on_device`` false: the host path, whose offer is host memory) each tensor copied
    to the host as it is gathered, so that the device holds one gathered tensor at a time: with the
    optimizer's state offloaded and the holder's copy of the model under a budget of 24 GiB, a 7B
    phase's allocator has about 6 GiB, and its whole state gathered on the device (4.7 GB) ran out
    of it (H100, benchmarks/results/2026-12-07-issue42-h100)."""
    built, backend = ph.built, ph.backend
    ph.timeline.add(carried_wait_seconds=ph.made.host.flush(ph.made.carried, ph.device, ph.made.staging))
    backend.relink(built.engine)
    head = backend.get_state(built.head, on_device=on_device)
    if ph.spec.optimizer_state != "keep":
        return _state(ph, True, head, {**ph.made.carried, **backend.get_masters(built.body, on_device=on_device)})
    # "keep": its layers' Adam state too, parked in its end checkpoint (which it always writes), on the
    # host from here: its device memory goes once it has offered.
    body = backend.get_state(built.body, on_device=on_device)
    masters = body.pop("master")
    kept = {k: {n: to_host(t, t.shape, None, ph.made.staging) for n, t in by_name.items()} for k, by_name in body.items()}
    kept["step"] = body_steps(ph, {})
    return _state(ph, True, head, {**ph.made.carried, **masters}, kept=kept)


def save(ph: Phase, phase_complete: bool, snap: PhaseState | None = None) -> Path | None:
    """Gathers full tensors on every rank (collectives); rank 0 copies them into its prepared
    files (so on a GPU the copy from the device is the write) and commits the checkpoint. With
    ``snap`` (handed over): rank 0 writes it and no collective is left; the other ranks have
    nothing to do. A phase end is made durable by the orchestrator (``orchestrator.commit``): an
    fsync of GBs here stalled the orchestrator's own small ones behind it on the H200's host."""
    t0 = time.time()
    writer = ph.rank == 0
    prepared = ph.files.result()
    faults0, cache0 = _page_faults(), _dirty_page_cache() if writer else {}
    if snap is not None:
        state = _to_host(ph, snap, prepared) if writer else None
    else:
        state = _gather(ph, phase_complete, prepared)
    t_gathered = time.time()
    # Why a gather was slow: pages that had to be faulted in again (cleaned by writeback since
    # they were prepared), and how much of the page cache was dirty or under writeback.
    gather_faults = _page_faults() - faults0
    if not writer:
        if snap is None:
            torch.distributed.barrier()
        return None
    await_predecessor(ph)
    ph.files = Later.now(None)  # used up by the write, whatever comes of it
    path, timing = save_state(ph.run_dir, state, ph.made.origin, durable=not phase_complete, prepared=prepared,
                              on_file_written=lambda name: faults.point("checkpoint.file_written", name=name))
    ph.timeline.append("checkpoints", {
        "step": ph.step, "gather_seconds": t_gathered - t0, "write_seconds": time.time() - t_gathered,
        "prepared": prepared is not None, **{f"{k}_seconds": v for k, v in timing.items()},
        "gather_page_faults": gather_faults, **cache0})
    if snap is None:
        torch.distributed.barrier()
    ph.timeline.mark("t_saved")
    return path


def await_predecessor(ph: Phase) -> None:
    """Until the checkpoint of the predecessor whose offer this phase answered is committed: one
    taken over commits nothing before it (its checkpoints compose the predecessor's layers from
    there), one not taken reads it. Should the predecessor die first, the orchestrator stops this
    process."""
    source = ph.built.source
    if source.awaiting is not None:
        ph.checkpoints.wait_committed(source.awaiting)
        source.awaiting = None


def _to_host(ph: Phase, snap: PhaseState, prepared: StateFiles | None) -> PhaseState:
    """A snapshot on the device, copied into the prepared files (else into host memory)."""
    staging = ph.made.staging
    head_views, layer_views = (prepared.head, prepared.masters) if prepared is not None else ({}, {})
    snap.head = {k: {n: to_host(t, t.shape, head_views.get(k, {}).get(n), staging)
                     for n, t in by_name.items()} for k, by_name in snap.head.items()}
    snap.masters = {n: to_host(t, t.shape, layer_views.get(n), staging) for n, t in snap.masters.items()}
    if snap.kept:  # on the host already (``snapshot``)
        views = prepared.kept if prepared is not None else {}
        snap.kept = {k: {n: t if (out := views.get(k, {}).get(n)) is None else out.copy_(t) for n, t in by_name.items()}
                     for k, by_name in snap.kept.items()}
    return snap


def _gather(ph: Phase, phase_complete: bool, prepared: StateFiles | None) -> PhaseState | None:
    """The phase's state in full on rank 0 (None on the others, which only take part)."""
    built, backend, writer = ph.built, ph.backend, ph.rank == 0
    head_into, masters_into = (prepared.head, prepared.masters) if prepared is not None else ({}, {})
    kept_into = prepared.kept if prepared is not None else {}
    gather = {"keep": writer, "staging": ph.made.staging}
    ph.made.host.settle()  # the carried layers on the host
    backend.relink(built.engine)
    head = backend.get_state(built.head, into=head_into, **gather)
    keeps = ph.spec.optimizer_state == "keep"
    if phase_complete and not keeps:
        masters, body = backend.get_masters(built.body, into=masters_into, **gather), None
    else:
        body = backend.get_state(built.body, into={**kept_into, "master": masters_into}, **gather)
        masters = body.pop("master", {})
        if keeps and writer:
            body["step"] = body_steps(ph, kept_into.get("step", {}))
    carried = {n: to_host(t, t.shape, None, ph.made.staging) for n, t in ph.made.carried.items()} \
        if writer else {}
    kept, body = (body, None) if phase_complete and keeps else (None, body)
    state = _state(ph, phase_complete, head, {**carried, **masters}, body, kept)  # collectives: every rank
    return state if writer else None


def body_steps(ph: Phase, into: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each body parameter's Adam step (its param group's), one int64 each, into ``into``'s where given."""
    steps = ph.backend.group_steps(ph.built.engine)
    out = {}
    for name, group in ph.built.group_of.items():
        t = into.get(name, torch.empty(1, dtype=torch.int64))
        t.fill_(steps.get(group, 0))
        out[name] = t
    return out


def _state(ph: Phase, phase_complete: bool, head: dict, masters: dict, body: dict | None = None,
           kept: dict | None = None) -> PhaseState:
    spec = ph.spec
    head_step, body_step = _steps(ph)
    carried = sorted({carried_layer(ph, n) for n in ph.made.carried})
    return PhaseState(step=ph.step, phase=spec.phase, layers=list(spec.layers), phase_complete=phase_complete,
                      head_step=head_step, body_step=body_step, head=head, masters=masters, run=run_state(ph),
                      body=body, kept=kept, carried=carried,
                      lr=lr_at(max(ph.step - 1, 0), spec.optimizer, spec.phase_start_step),
                      state_from=ph.timeline.get("state_from") or dict.fromkeys((*ph.made.head_names,
                                                                                  *ph.made.body_names), "fresh"))


def _steps(ph: Phase) -> tuple[int, int]:
    """The head's and the body's optimizer steps (the most of any of its param groups: under "keep"
    the body's groups count from their layers' earlier visits)."""
    steps = ph.backend.group_steps(ph.built.engine)
    of = {role: [steps.get(i, 0) for i, r in enumerate(ph.built.roles) if r == role] for role in set(ph.built.roles)}
    head_step = max((s for r in (HEAD_DECAY, HEAD_NO_DECAY) for s in of.get(r, [])), default=0)
    body_step = max((s for r in (BODY_DECAY, BODY_NO_DECAY) for s in of.get(r, [])), default=0)
    return head_step, body_step


def carried_layer(ph: Phase, name: str) -> int:
    """The layer a carried master belongs to (``Prepared.carried``)."""
    return layer_of(Path(ph.spec.phase_dir), name, ph.made.origin.layers_attr + ".")


def run_state(ph: Phase) -> RunState:
    """Every rank's RNG states (gathered), the data position and the loss scaler."""
    rng: dict[str, torch.Tensor] = {}
    cpu_state = torch.get_rng_state()
    gathered = [torch.empty_like(cpu_state) for _ in range(ph.world)]
    if ph.device.type == "cuda":
        on_dev = cpu_state.to(ph.device)
        gathered_dev = [torch.empty_like(on_dev) for _ in range(ph.world)]
        torch.distributed.all_gather(gathered_dev, on_dev)
        gathered = [g.cpu() for g in gathered_dev]
        cuda_state = torch.cuda.get_rng_state().to(ph.device)
        cuda_all = [torch.empty_like(cuda_state) for _ in range(ph.world)]
        torch.distributed.all_gather(cuda_all, cuda_state)
        rng.update({f"cuda.rank{r}": t.cpu() for r, t in enumerate(cuda_all)})
    else:
        torch.distributed.all_gather(gathered, cpu_state)
    rng.update({f"cpu.rank{r}": t for r, t in enumerate(gathered)})
    return RunState(data_position=ph.step * ph.spec.data.batch_size, rng=rng,
                    scaler=scaler_fields(ph.backend.loss_scaler(ph.built.engine)))


def prepare_files(ph: Phase, made: Prepared) -> StateFiles | None:
    """Rank 0's head and layers files of the next checkpoint, made now (``StateFiles``); None on
    the other ranks, and where they cannot be made (the checkpoint is then written without)."""
    if ph.rank != 0:
        return None
    shapes = ph.backend.full_shapes(list(made.model.named_parameters()))
    try:
        return StateFiles(ph.run_dir, {n: shapes[n] for n in made.head_names}, {n: shapes[n] for n in made.body_names},
                          list(ph.spec.layers), made.origin.layers_attr, kept=ph.spec.optimizer_state == "keep")
    except CheckpointError as e:
        print(f"relayer: {e}; the checkpoint will be written without them", file=sys.stderr, flush=True)
        return None


def _page_faults() -> int:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def _dirty_page_cache() -> dict[str, int]:
    """Linux: MB of the page cache that is dirty and under writeback; nothing elsewhere."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    kb = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in lines) if k in ("Dirty", "Writeback")}
    return {f"{k.lower()}_mb": v // 1024 for k, v in kb.items()}
