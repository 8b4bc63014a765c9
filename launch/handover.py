"""The device handover (``HandoverPart``): a finished phase gives its state to its pre-warmed
successor where it lies, on the device, instead of through its checkpoint.

The predecessor (``offer``) gathers its end state on its device (``save.snapshot``), makes it
mappable, writes one ``Offer`` per rank and waits for the answer; then it writes its checkpoint
from its own memory and exits while the successor trains. The successor (``take``) maps each
offered block, copies it into memory of its own (never an alias: the predecessor's memory goes
with its process), lets the mappings go (``torch.cuda.ipc_collect``) and answers. Nothing is
pickled: the offer is JSON, CUDA IPC's handles in it base64.

Transports: ``cuda`` (CUDA IPC, both processes on the same GPU, matched by UUID) and ``host``
(the bytes in a 0600 file in the predecessor's phase directory: the same choreography without a
GPU, for testing it on a CPU; ``launch.handover = "on"``). The recipe was verified on one H200
(torch 2.11) by ``benchmarks/handover.py``, whose measured floor is in
benchmarks/results/2026-12-01-ipc-handover-h200/.
"""

from __future__ import annotations

import base64
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from launch import faults, zero_state
from launch.contract.files import Answer, Offer, PhaseDir, TensorRef
from launch.save import Snapshot, snapshot
from shard_tools.checkpoint import layer_weights
from shard_tools.manifest import (
    CheckpointError, checkpoints_dir, layer_sources, list_checkpoints, read_manifest, step_dir_name, step_of,
)

if TYPE_CHECKING:
    from launch.phase import Phase

ALIGN = 64
ANSWER_POLL = 0.002
_IPC_FIELDS = ("device", "handle", "size", "offset", "rc_handle", "rc_offset", "event", "event_sync")


@dataclass(frozen=True)
class Carried:
    """What the successor carries on from where its state came from: a checkpoint's manifest and
    state file, or an offer."""

    head_step: int
    body_step: int
    phase: int
    phase_complete: bool
    scaler: dict[str, torch.Tensor] | None
    """The loss scaler's tensors; None: read them from the checkpoint's state file."""


# -- the transports ---------------------------------------------------------------------------
def transport_of(ph: Phase) -> str | None:
    if ph.device.type == "cuda":
        return "cuda"
    return "host" if ph.spec.handover.host else None


def device_id(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    return "host"


def _ref(name: str, t: torch.Tensor, block: int, offset: int) -> TensorRef:
    return TensorRef(name=name, block=block, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                     stride=list(t.stride()), offset=offset)


def _export_cuda(tensors: dict[str, torch.Tensor]) -> tuple[list[dict], list[TensorRef]]:
    """One IPC handle per storage (a flat buffer's views share one), each tensor a view into it."""
    torch.cuda.synchronize()
    blocks: list[dict] = []
    refs: list[TensorRef] = []
    index: dict[int, int] = {}
    for name, t in tensors.items():
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in index:
            fields = storage._share_cuda_()
            index[key] = len(blocks)
            blocks.append({k: base64.b64encode(v).decode() if isinstance(v, bytes) else v
                           for k, v in zip(_IPC_FIELDS, fields)})
        refs.append(_ref(name, t, index[key], t.storage_offset()))
    return blocks, refs


def _export_host(tensors: dict[str, torch.Tensor], blob: Path) -> tuple[list[dict], list[TensorRef]]:
    """Every tensor's bytes, contiguous, into ``blob`` (0600)."""
    blocks: list[dict] = []
    refs: list[TensorRef] = []
    offset = 0
    with os.fdopen(os.open(blob, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        for name, t in tensors.items():
            data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            f.seek(offset)
            f.write(memoryview(data))
            blocks.append({"offset": offset, "size": data.nbytes})
            refs.append(_ref(name, t.contiguous(), len(blocks) - 1, 0))
            offset += -(-data.nbytes // ALIGN) * ALIGN
    return blocks, refs


def _map(offer: Offer, blob: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Each offered tensor, as a view of the mapped block (cuda) or of this process's copy of the
    file (host). A cuda view must not outlive the copy made of it."""
    if offer.transport == "host":
        data = bytearray(blob.read_bytes())
        whole = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return {r.name: whole[offer.blocks[r.block]["offset"]:][:offer.blocks[r.block]["size"]]
                .view(getattr(torch, r.dtype)).as_strided(r.shape, r.stride) for r in offer.tensors}

    def storage(b: dict) -> torch.UntypedStorage:
        f = {k: base64.b64decode(v) if isinstance(v, str) else v for k, v in b.items()}
        return torch.UntypedStorage._new_shared_cuda(device.index, f["handle"], f["size"], f["offset"],
                                                     f["rc_handle"], f["rc_offset"], f["event"], f["event_sync"])

    storages = [storage(b) for b in offer.blocks]
    return {r.name: torch.empty(0, dtype=getattr(torch, r.dtype), device=device).set_(
        storages[r.block], r.offset, r.shape, r.stride) for r in offer.tensors}


# -- the predecessor ----------------------------------------------------------------------------
def offer(ph: Phase) -> Snapshot | None:
    """Offers this finished phase's state to its successor and waits for the answer; the snapshot
    to write the checkpoint from, or None where this phase does not hand over."""
    transport = transport_of(ph)
    if not ph.spec.handover.offer or transport is None:
        return None
    snap = snapshot(ph)  # collectives: every rank
    model = ph.engine.module
    tensors = {f"module/{n}": p.data for n, p in model.named_parameters()}
    tensors |= {f"buffer/{n}": b for n, b in model.named_buffers()}
    tensors |= {f"{k}/{n}": t for k, by_name in snap.head.items() for n, t in by_name.items()}
    tensors |= {f"master/{n}": t for n, t in snap.layers.items()}
    tensors = {n: t for n, t in tensors.items() if t.numel()}
    files = PhaseDir(ph.spec.phase_dir)
    files.handover.mkdir(mode=0o700, exist_ok=True)
    blocks, refs = _export_cuda(tensors) if transport == "cuda" else _export_host(tensors, files.blob_path(ph.rank))
    spec = ph.spec
    carried = {"head_step": snap.head_step, "body_step": snap.body_step, "phase": spec.phase,
               "global_step": ph.step, "layers": list(spec.layers), "restore": ph.restore_path,
               "end": str(checkpoints_dir(ph.run_dir) / step_dir_name(ph.step)),
               "scaler": {k: v.tolist() for k, v in snap.state.items() if k.startswith("loss_scaler/")}}
    files.write_offer(ph.rank, Offer(pid=os.getpid(), device=device_id(ph.device), transport=transport,
                                     blocks=blocks, tensors=refs, carried=carried))
    ph.timeline.mark("t_offered")
    faults.point("handover.offered", rank=ph.rank)
    while (answer := files.read_answer(ph.rank)) is None:
        time.sleep(ANSWER_POLL)
    ph.timeline.mark("t_answered")
    ph.timeline.add(handover_taken=answer.taken, handover_answer=answer.reason or answer.by)
    files.blob_path(ph.rank).unlink(missing_ok=True)
    return snap


# -- the successor ------------------------------------------------------------------------------
def refusal(ph: Phase) -> str | None:
    """Why this pre-warmed phase will not take its predecessor's state over (decided while it
    prepares: it then keeps a host copy of the model, as without a handover); None: it will."""
    h = ph.spec.handover
    if not h.take:
        return "not planned"
    if transport_of(ph) is None:
        return "no GPU (launch.handover = \"on\" hands over through the host)"
    if ph.spec.zero_stage == 3:
        return "ZeRO-3"
    if ph.device.type == "cuda" and h.peak_bytes > torch.cuda.mem_get_info(ph.device)[1]:
        return f"the overlap's planned peak, {h.peak_bytes} bytes, is more than the device's memory"
    return None


def preload_layers(ph: Phase) -> None:
    """The fp32 masters of this phase's layers trained before its preload checkpoint, put on its
    device now (the host keeps no copy); a layer its predecessor trains comes with the offer."""
    _put_layers(ph, {l: s for l, s in ph.preloaded.items() if l in ph.spec.layers})


class LayerRefresh:
    """Called while a phase that takes over waits for its go: its layers that phases since its
    preload have trained, from the newest phase-end checkpoint this run has committed meanwhile, go
    on its device then, so that the go reads only what comes after (``_layers_trained_between``).
    Without it, a layer that LISA samples again within ``prewarm_depth`` phases was read from disk
    at the go. Looks every ``every`` seconds; reads only when a new checkpoint is there."""

    def __init__(self, ph: Phase, every: float = 0.2):
        self.ph, self.every, self.at, self.seen = ph, every, 0.0, None

    def __call__(self) -> None:
        ph, now = self.ph, time.monotonic()
        if now - self.at < self.every:
            return
        self.at = now
        ckpts = [c for c in list_checkpoints(ph.run_dir) if (step_of(c) or 0) <= ph.spec.start_step]
        if not ckpts or ckpts[-1] == self.seen:
            return
        try:
            upto = next((c for c in reversed(ckpts) if self._this_runs_phase_end(c)), None)
            sources = layer_sources(ph.run_dir, upto) if upto is not None else {}
            changed = _own_since(ph, sources)
            _put_layers(ph, changed)
        except (OSError, CheckpointError):
            return  # written over or removed meanwhile: again at the next look, or at the go
        self.seen = ckpts[-1]
        ph.preloaded.update(changed)
        if changed:
            ph.timeline.add(layers_refreshed=sorted({*ph.timeline.get("layers_refreshed", []), *changed}))

    def _this_runs_phase_end(self, ckpt: Path) -> bool:
        """A phase's end, written since this process started: not one an earlier attempt left."""
        m = read_manifest(ckpt)
        return m.phase_complete and m.created >= self.ph.timeline.get("t_process_start")


def _own_since(ph: Phase, sources: dict[int, Path]) -> dict[int, Path]:
    """This phase's layers whose newest source in ``sources`` is not the one on its device."""
    return {l: s for l, s in sources.items() if l in ph.spec.layers and ph.preloaded.get(l) != s}


def _put_layers(ph: Phase, sources: dict[int, Path], offered: frozenset[str] = frozenset()) -> None:
    """The fp32 masters of this phase's layers in ``sources``, on its device, except ``offered`` ones."""
    for name, t in layer_weights(sources, mapped=True).items():
        if name in ph.body_names and name not in offered:
            ph.trained[name] = t.to(ph.device, copy=True)


def take(ph: Phase, source: Path) -> bool:
    """Copies the predecessor's offered state (rank for rank) into this process and answers;
    False where it could not (then it answered "not taken": the checkpoint follows)."""
    files = PhaseDir(source)
    reason = ph.refusal
    offered = files.read_offer(ph.rank)
    if reason is None and offered is None:
        reason = f"no offer in {files.offer_path(ph.rank)}"
    if reason is None and offered.transport != transport_of(ph):
        reason = f"offered through {offered.transport}"
    if reason is None and offered.device != device_id(ph.device):
        reason = f"offered on device {offered.device}, this rank is on {device_id(ph.device)}"
    if reason is None:
        try:
            _copy_in(ph, offered, files.blob_path(ph.rank))
        except (RuntimeError, OSError, KeyError) as e:  # torch.OutOfMemoryError is a RuntimeError
            reason = f"{type(e).__name__}: {e}"
    files.write_answer(ph.rank, Answer(taken=reason is None, by="successor", reason=reason or ""))
    ph.timeline.mark("t_taken")
    ph.timeline.add(handover="device" if reason is None else "checkpoint", handover_reason=reason)
    return reason is None


def _copy_in(ph: Phase, offered: Offer, blob: Path) -> None:
    """Own copies of the offered weights (into the model), the head's state and the layers' fp32
    masters; then the mappings go."""
    mapped = _map(offered, blob, ph.device)
    faults.point("handover.copying", rank=ph.rank)
    with torch.no_grad():
        # New parameters in place of the skeleton's (on the meta device), tied ones tied still.
        new = {id(p): torch.nn.Parameter(mapped[f"module/{n}"].clone(), requires_grad=p.requires_grad)
               for n, p in ph.model.named_parameters()}
        for module in ph.model.modules():
            for leaf, p in module._parameters.items():
                if p is not None and id(p) in new:
                    module._parameters[leaf] = new[id(p)]
        for name, _ in list(ph.model.named_buffers()):
            owner, _, leaf = name.rpartition(".")
            module = ph.model.get_submodule(owner)
            module._buffers[leaf] = mapped[f"buffer/{name}"].clone()
        state = {k: {n: mapped[f"{k}/{n}"].clone() for n in ph.head_names} for k in zero_state.KEYS}
        layers = {n: mapped[f"master/{n}"].clone() for n in ph.body_names if f"master/{n}" in mapped}
    del mapped
    if ph.device.type == "cuda":
        torch.cuda.synchronize(ph.device)
        torch.cuda.ipc_collect()
    carried = offered.carried
    ph.trained.update(state["master"])
    ph.trained.update(layers)
    _layers_trained_between(ph, carried, frozenset(layers))
    ph.head_state = state
    ph.carried = Carried(head_step=carried["head_step"], body_step=carried["body_step"], phase=carried["phase"],
                         phase_complete=True,
                         scaler={k: torch.tensor(v, dtype=torch.float64) for k, v in carried["scaler"].items()})


def _layers_trained_between(ph: Phase, carried: dict, offered: frozenset[str]) -> None:
    """This phase's layers that a phase between its preload and its predecessor trained (only with
    ``prewarm_depth`` > 1): their fp32 masters from those checkpoints, all committed by now."""
    if not carried.get("restore"):
        return
    now = layer_sources(ph.run_dir, Path(carried["restore"]))
    changed = _own_since(ph, now)
    _put_layers(ph, changed, offered)
    ph.timeline.add(layers_at_go=sorted(changed))
