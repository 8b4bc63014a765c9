"""The device handover (``HandoverPart``): a finished phase gives its state to its pre-warmed
successor where it lies, on the device, instead of through its checkpoint.

The predecessor (``offer``) gathers its end state on its device (``save.snapshot``), makes it
mappable, writes one ``Offer`` per rank and waits for the answer; then it writes its checkpoint
from its own memory and exits while the successor trains. The successor (``take``) maps each
offered block, answers, builds its engine and copies the offered state straight into it (never an
alias: its own optimizer steps its own memory), then lets the mappings go (``torch.cuda.ipc_collect``).
Nothing is pickled: the offer is JSON, CUDA IPC's handles in it base64.

Transports: ``cuda`` (CUDA IPC, both processes on the same GPU, matched by UUID), ``host`` (the
bytes in a 0600 file in the predecessor's phase directory: the same choreography on a CPU, for
testing; ``launch.handover = "on"``) and the host path (``launch.hostpath``). Verified on an H200 by
``benchmarks/handover.py`` (benchmarks/results/2026-12-01-ipc-handover-h200/).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
import torch

from launch import engine, hostpath, preload
from launch.contract import devmem, faults
from launch.contract.cadence import end_writes
from launch.contract.files import Answer, Carried, Offer, PhaseDir
from launch.record import Phase, Prepared
from launch.save import carried_layer, snapshot
from launch.staging import install, one_block
from launch.transports import device_id, export_cuda, export_host, map_offer
from shard_tools.state import PhaseState, RunState

CARRY_SHARE = 0.9
"""Of the device's memory, what the switch's planned peak and the carried layers (twice) may take
(on an H200 at 7B the switches' peak reached 147 of 151 GB with 29 layers carried, no margin)."""
ANSWER_POLL = 0.002


# -- the transports (``launch.transports``) -----------------------------------------------------
def transport_of(ph: Phase, taking: bool = True) -> str | None:
    """How this phase takes its predecessor's state (``taking``) or offers its own."""
    h = ph.spec.handover
    if h.shm_take if taking else h.shm_offer:
        return "shm"
    if ph.device.type == "cuda":
        return "cuda"
    return "host" if h.host else None


WEIGHTS, BUFFERS = "module", "buffer"
"""An offer's tensors are "<part>/<name>": the model's weights and buffers, and the fp32 state by
its keys (``engine.KEYS``; "master" holds the head's and the layers' masters)."""


def _pack(model: torch.nn.Module, snap: PhaseState, on_host: dict[str, torch.Tensor], resident: bool
          ) -> dict[str, torch.Tensor]:
    """What the transport offers: all but the carried layers ``on_host`` (offered where they lie),
    and the model's weights only where they are not the holder's (``launch.resident``)."""
    masters = {n: t for n, t in snap.masters.items() if n not in on_host}
    parts = {**snap.head, "master": {**snap.head["master"], **masters}}
    if not resident:  # else the successor maps the holder's block, which has this phase's weights
        parts |= {WEIGHTS: {n: p.data for n, p in model.named_parameters()}, BUFFERS: dict(model.named_buffers())}
    return {f"{part}/{n}": t for part, by_name in parts.items() for n, t in by_name.items() if t.numel()}


def _unpack(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    parts: dict[str, dict[str, torch.Tensor]] = {k: {} for k in (WEIGHTS, BUFFERS, *engine.KEYS)}
    for key, t in tensors.items():
        part, _, name = key.partition("/")
        parts[part][name] = t
    return parts


# -- the predecessor ----------------------------------------------------------------------------
def offer(ph: Phase) -> tuple[PhaseState | None, bool]:
    """Offers this finished phase's state to its successor and waits for the answer; the snapshot
    to write the checkpoint from (None where this phase does not hand over), and whether to write
    it: not where the successor took the state and carries it on to its own (``Answer.write``)."""
    transport = transport_of(ph, taking=False)
    if not ph.spec.handover.offer or transport is None:
        return None, True
    snap = snapshot(ph, on_device=transport != "shm")  # collectives: every rank
    ph.timeline.mark("t_gathered")
    on_host = _ahead_into(ph, snap)
    files = PhaseDir(ph.spec.phase_dir)
    files.handover.mkdir(mode=0o700, exist_ok=True)
    blob = files.shm_blob_path(ph.rank) if transport == "shm" else files.blob_path(ph.rank)
    if transport == "shm":
        blocks, refs = _export_shm(ph, snap, blob)
    else:
        tensors = _pack(ph.built.engine.module, snap, on_host, ph.made.resident is not None)
        blocks, refs = export_cuda(tensors) if transport == "cuda" else export_host(tensors, blob)
    made = Offer(pid=os.getpid(), device="host" if transport == "shm" else device_id(ph.device), transport=transport,
                 blocks=blocks, tensors=refs, carried=_carried(ph, snap, on_host if transport != "shm" else {}))
    if transport == "shm":  # its checkpoint comes from host memory: its device memory goes before the offer,
        # so that a successor under a budget may build its engine beside what is left, its CUDA context
        snap = hostpath.from_blob(snap, made, blob)
        ph.timeline.add(device_released=hostpath.release_device(ph))
    files.write_offer(ph.rank, made)
    ph.timeline.mark("t_offered")
    faults.point("handover.offered", rank=ph.rank)
    if transport != "shm":
        ph.timeline.add(device_let_go=_let_go(ph))
    while (answer := files.read_answer(ph.rank)) is None:
        time.sleep(ANSWER_POLL)
    ph.timeline.mark("t_answered")
    ph.timeline.add(handover_taken=answer.taken, handover_answer=answer.reason or answer.by)
    blob.unlink(missing_ok=True)
    write = answer.end_written
    if not write:
        ph.timeline.add(checkpoint_written=False)
    return snap, write


def _export_shm(ph: Phase, snap: PhaseState, blob: Path) -> tuple[list[dict], list]:
    """The host path's offer into ``blob``: the file made after the first step where it was."""
    faults.point("handover.gathered", phase=ph.spec.phase, rank=ph.rank)
    ready = ph.blob.result() if ph.blob is not None else None
    blocks, refs = hostpath.export(hostpath.pack_state(snap), blob, ph.made.staging, ready, phase=ph.spec.phase,
                                   rank=ph.rank)
    ph.timeline.add(offer_file_ahead=ready is not None and ready.numel() >= blob.stat().st_size)
    return blocks, refs


def _let_go(ph: Phase) -> int:
    """Once offered, what no step needs any more goes back to the driver while the successor copies
    and builds: the gradients and the allocator's cache (the last step's activations), so that at
    a switch the device holds the successor's whole phase beside the offered state, not two phases'
    (``orchestrator.estimate.overlap_peak``). The bytes given back (0 off CUDA)."""
    ph.backend.let_go(ph.built.engine)
    if ph.device.type != "cuda":
        return 0
    before = torch.cuda.memory_reserved(ph.device)
    torch.cuda.empty_cache()
    return before - torch.cuda.memory_reserved(ph.device)


def _ahead_into(ph: Phase, snap: PhaseState) -> dict[str, torch.Tensor]:
    """The carried layers the successor trains, on the device ahead of the offer
    (``HostCarry.upload_ahead``), into the snapshot's masters; the others in host segments, offered
    where they lie (those outside one, taken over the host path, go with the offer's tensors)."""
    ahead = ph.made.host.ahead
    snap.masters.update(ahead)
    if ahead:
        ph.timeline.add(carried_ahead=sorted({carried_layer(ph, n) for n in ahead}))
    return {n: t for n, t in ph.made.carried.items() if n not in ahead and ph.made.host.holds(t)}


def _carried(ph: Phase, snap: PhaseState, on_host: dict[str, torch.Tensor]) -> Carried:
    """What the offer carries on besides its tensors; ``on_host``: the carried layers offered where
    they lie in host memory."""
    spec = ph.spec
    return Carried(phase=spec.phase, global_step=ph.step, layers=list(spec.layers), head_step=snap.head_step,
                   body_step=snap.body_step, scaler=snap.run.scaler, restore=_str(ph.built.source.restore),
                   end=str(ph.checkpoints.at(ph.step)), host_layers=ph.made.host.refs(on_host))


def carry_on(ph: Phase) -> None:
    """After this phase's first step: the carried layers its successor trains to the device ahead
    of its offer (``HostCarry.upload_ahead``), and those its predecessor trained to the host; the
    host path's file for its offer (``hostpath.prepare``)."""
    made, nxt = ph.made, set(ph.spec.handover.next_layers)
    if nxt and made.carried and ph.spec.handover.offer:
        made.host.upload_ahead(made.carried, {n for n in made.carried if carried_layer(ph, n) in nxt}, ph.device)
    if made.host.fresh:
        made.host.hold_later(made.carried, ph.device, made.staging)
    if ph.spec.handover.offer and transport_of(ph, taking=False) == "shm":
        ph.blob = hostpath.prepare(ph, PhaseDir(ph.spec.phase_dir).shm_blob_path(ph.rank))


# -- the successor ------------------------------------------------------------------------------
def refusal(ph: Phase) -> str | None:
    """Why this pre-warmed phase will not take its predecessor's state over (decided while it
    prepares: it then keeps a host copy of the model, as without a handover); None: it will."""
    h = ph.spec.handover
    if not h.take:
        return "not planned"
    if transport_of(ph) is None:
        return "no GPU (launch.handover = \"on\" hands over through the host)"
    if ph.backend.refusal is not None:
        return ph.backend.refusal
    if ph.device.type == "cuda" and not h.shm_take and h.peak_bytes > torch.cuda.mem_get_info(ph.device)[1]:
        return f"the overlap's planned peak, {h.peak_bytes} bytes, is more than the device's memory"
    return None


def take(ph: Phase, source: Path, restore: Path | None, defer: bool = False
         ) -> tuple[PhaseState | None, Path | None, Path | None]:
    """Copies the predecessor's offered state (rank for rank) into this process and answers. With
    ``defer``, where every rank took its offer and can hold them (``_can_carry``, ``_all_keep``), it
    keeps the offered fp32 masters of the layers it does not train too (``Prepared.carried``) and
    answers that the predecessor need not write ``restore``, its end checkpoint. Returns the state it
    carries on (None where it could not: it answered "not taken", the checkpoint follows) and the
    checkpoint its own wait for: ``restore``, or where the predecessor writes none, the one the
    predecessor built on; and the one the predecessor built on (None where it did not take or built on
    none). Every rank calls it (the go names the offer to all): ``_all_keep`` is collective."""
    files, carried = PhaseDir(source), None
    offered = files.read_offer(ph.rank)
    reason = _unfit(ph, offered, files)
    can_carry = defer and reason is None and _can_carry(ph, offered)
    keep = not end_writes(due=not defer, takes=reason is None, carries=can_carry)
    shm = offered is not None and offered.transport == "shm"
    if reason is None:
        try:
            carried = (hostpath.copy_in(ph, offered, files.shm_blob_path(ph.rank), keep) if shm
                       else _copy_in(ph, offered, files.blob_path(ph.rank), keep))
        except (RuntimeError, OSError, KeyError) as e:  # torch.OutOfMemoryError is a RuntimeError
            reason = f"{type(e).__name__}: {e}"
    keep = _all_keep(ph, reason is None, keep)
    files.write_answer(ph.rank, Answer(taken=reason is None, by="successor", reason=reason or "", write=not keep))
    ph.timeline.mark("t_taken")
    ph.timeline.add(handover=("host" if shm else "device") if reason is None else "checkpoint", handover_reason=reason)
    if reason is not None:
        return None, restore, None
    _after_answer(ph, offered, carried, shm)
    before = Path(offered.carried.restore) if offered.carried.restore else None
    if not keep:
        return carried, restore, before
    ph.timeline.add(predecessor_wrote=False, carried_layers=sorted({carried_layer(ph, n) for n in ph.made.carried}))
    return carried, before, before


def _after_answer(ph: Phase, offered: Offer, carried: PhaseState, shm: bool) -> None:
    """Once answered: under a budget, the predecessor whose exit the first step waits for (``await_leaving``);
    the uploads (``_copy_in``'s copies do not wait for them); the layers trained between from committed
    checkpoints, not the predecessor, which need not wait for them to free its device and write its own."""
    if shm and ph.spec.memory_cap and ph.device.type == "cuda":
        ph.leaving = offered.pid
    preload.upload(ph)
    if shm:
        hostpath.layers_between(ph, offered.carried, frozenset(r.name.partition("/")[2] for r in offered.tensors
                                                               if r.name.startswith("master/")))
    else:
        _layers_trained_between(ph, offered.carried, frozenset(carried.masters))


def await_leaving(ph: Phase) -> None:
    """Under a budget, before the first step (its peak): until the predecessor that offered through
    host memory, and let go of its device memory then (``hostpath.release_device``), has left the
    device (``hostpath.wait_gone``); built and restored meanwhile (waited for before the build: 2.0 s
    a switch at 7B under 24 GiB on an H100, benchmarks/results/2026-12-07-issue42-h100)."""
    listing, ph.listing = ph.listing, None  # opened while it waited (``launch.prepare``)
    try:
        if ph.leaving is not None:
            listing = listing or devmem.Listing()
            ph.timeline.add(predecessor_exit_wait=hostpath.wait_gone(ph.leaving, holds=listing))
            ph.timeline.mark("t_predecessor_gone")
    finally:
        if listing is not None:
            listing.close()
        ph.leaving = None


def _unfit(ph: Phase, offered: Offer | None, files: PhaseDir) -> str | None:
    """Why this rank cannot take ``offered`` over; None: it can."""
    if ph.made.refusal is not None:
        return ph.made.refusal
    if offered is None:
        return f"no offer in {files.offer_path(ph.rank)}"
    if offered.transport != transport_of(ph):
        return f"offered through {offered.transport}"
    if offered.transport != "shm" and offered.device != device_id(ph.device):
        return f"offered on device {offered.device}, this rank is on {device_id(ph.device)}"
    return None


def _all_keep(ph: Phase, took: bool, kept: bool) -> bool:
    """Whether every rank took its offer and kept the carried masters: only then may the
    predecessor skip its checkpoint. Decided by one rank alone, a rank told "need not write" (its
    rank 0 writes the checkpoint) left a rank that did not take waiting for it for good, and the
    ranks' carried layers apart. Else what this rank kept goes, its memory with it: it answers as one
    that did not keep. Every rank reaches it, a rank that did not take too."""
    every = took and kept
    if ph.world > 1:  # one process decides alone: no collective (its first may set the communicator up: 0.5 s)
        flag = torch.tensor([float(every)], device=ph.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        every = bool(flag.item())
    if not every:
        ph.made.carried = {}
        ph.made.host.release()
    return every


def _can_carry(ph: Phase, offered: Offer) -> bool:
    """Whether the offered masters of other layers than this phase's fit on this rank's device
    beside the switch's planned peak (on the host, always), twice: the predecessor holds them too
    until it exits; within CARRY_SHARE of the device, the plan's peak being an estimate. Decided
    per rank, then by all (``_all_keep``): where one cannot, none carries, the predecessor writes
    its checkpoint, and the carried layers start over."""
    if ph.device.type != "cuda":
        return True
    own = {*ph.made.body_names, *ph.made.head_names}
    others = [r for r in offered.tensors if r.name.startswith("master/") and r.name.removeprefix("master/") not in own]
    extra = sum(math.prod(r.shape) * 4 for r in others)
    return ph.spec.handover.peak_bytes + 2 * extra <= CARRY_SHARE * torch.cuda.mem_get_info(ph.device)[1]


def _copy_in(ph: Phase, offered: Offer, blob: Path, keep: bool = False) -> PhaseState:
    """Own copies of the offered weights (into the model), with ``keep`` the other layers' masters
    (``Prepared.carried``); the head's state and this phase's layers' fp32 masters (the state carried
    on) stay views of the offer, which ``switch.restore`` copies straight into the engine's state and
    then lets go (``let_go_of_offer``): no copy between, 3.1 GB less on the device at 7B while the
    predecessor's state is still there. The predecessor's memory stays while it is mapped here, even
    once it has exited (``benchmarks/results/2026-12-06-resident-probe-h100``), and torch's CUDA IPC
    keeps it from reusing it meanwhile."""
    made = ph.made
    parts = _unpack(map_offer(offered, blob, ph.device))
    faults.point("handover.copying", phase=ph.spec.phase, rank=ph.rank)
    with torch.no_grad():
        if made.resident is None:  # else its model is the holder's block, mapped
            _own_weights(made, parts)
        head = {k: {n: parts[k][n] for n in made.head_names} for k in engine.KEYS}
        layers = _layers_in(ph, parts["master"], offered.carried.host_layers, keep)
    del parts
    if ph.device.type == "cuda":
        torch.cuda.synchronize(ph.device)
    carried = offered.carried
    made.trained.update(head["master"])
    made.trained.update(layers)
    return PhaseState(
        step=carried.global_step, phase=carried.phase, layers=carried.layers, phase_complete=True,
        head_step=carried.head_step, body_step=carried.body_step, head=head, masters=layers,
        run=RunState(data_position=carried.global_step * ph.spec.data.batch_size, scaler=dict(carried.scaler)))


def _own_weights(made: Prepared, parts: dict[str, dict[str, torch.Tensor]]) -> None:
    """New parameters in place of the skeleton's (on the meta device), tied ones tied still; the
    frozen ones in one block (one allocation, and one IPC handle when this phase offers them)."""
    named = list(made.model.named_parameters())
    trainable = {*made.head_names, *made.body_names}
    frozen = [n for n, _ in named if n not in trainable]
    copies = dict(zip(frozen, _in_one_block({n: parts[WEIGHTS][n] for n in frozen}).values()))
    install(made.model, lambda n: copies[n] if n in copies else parts[WEIGHTS][n].clone(),
            lambda n: parts[BUFFERS][n].clone())


def _layers_in(ph: Phase, offered: dict[str, torch.Tensor], host_layers: list[dict], keep: bool
               ) -> dict[str, torch.Tensor]:
    """This phase's layers' masters, own copies on its device: offered there, or among the layers
    carried on the host (``launch.carried``), whose segments it maps. With ``keep``, the other
    layers' masters become its carried ones: those on the host as they are, the offered ones
    copied here (to the host after the first step: ``HostCarry.hold_later``)."""
    made = ph.made
    on_host = made.host.adopt(host_layers)
    layers = {n: t for n, t in offered.items() if n in made.body_names}
    up = made.staging.to_device if made.staging is not None else lambda t: t.to(ph.device, copy=True)
    # Not offered on the device (``upload_ahead`` did not run): pageable, through the ring.
    layers.update({n: up(t) for n, t in on_host.items() if n in made.body_names and n not in layers})
    if not keep:
        made.carried = {}
        made.host.release()
        return layers
    others = sorted(set(offered) - set(made.body_names) - set(made.head_names))
    made.host.fresh = _in_one_block({n: offered[n] for n in others})
    made.carried = {**{n: t for n, t in on_host.items() if n not in made.body_names}, **made.host.fresh}
    return layers


def let_go_of_offer(ph: Phase) -> None:
    """Once the engine holds the state (``switch.restore``): the mappings of a device offer go."""
    if ph.device.type == "cuda":
        torch.cuda.synchronize(ph.device)
        torch.cuda.ipc_collect()


def _in_one_block(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of ``tensors``, views into one block of memory: offered on, they are one CUDA IPC
    handle to open rather than one each (hundreds: the frozen weights, every layer carried)."""
    if not tensors:
        return {}
    first = next(iter(tensors.values()))
    out = dict(zip(tensors, one_block(list(tensors.values()), first.device)))
    for name, t in tensors.items():
        out[name].copy_(t)
    return out


def _layers_trained_between(ph: Phase, carried: Carried, offered: frozenset[str]) -> None:
    """This phase's layers that a phase between its preload and its predecessor trained (only with
    ``prewarm_depth`` > 1): their fp32 masters from those checkpoints, waited for (the last may be
    its predecessor's predecessor's end, still being written)."""
    if not carried.restore:
        return
    ph.checkpoints.wait_committed(Path(carried.restore))  # its writer, two phases back, may be writing still
    now = ph.checkpoints.layer_sources(Path(carried.restore))
    changed = preload.own_since(ph, now)
    preload.put_layers(ph, ph.made, changed, offered, now=True)
    ph.timeline.add(layers_at_go=sorted(changed))


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)
