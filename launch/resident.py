"""One copy of the model's weights per device for the whole run (``launch.resident``).

The weights of the layers a phase does not train are the same in every phase, so one process per
device, the holder, keeps the whole model there from the run's first phase to its end, and every
phase maps it instead of copying it: at a switch one model is on the device, not two.

- The holder (``hold``): forked by the fork server with the run (``PhaseSpec.holds``), it builds
  the model as the run's first phase would (the base model, the layers of the checkpoint it
  resumes from), puts every parameter and buffer into one block on its device, exports it
  (CUDA IPC; on a CPU a memfd, the same protocol) in its record (``Resident``, 0600) and sleeps
  until the run ends. A stop signal is the phases' business: it ignores them.
- A phase (``map_into``) maps the block while it prepares (no device memory beyond its context)
  and makes its parameters views of it. At its build it gives the ones it trains memory of its
  own (``own``): the optimizer never writes into the block. At its end, before it offers its
  state or writes its checkpoint, it writes its trained weights back (``write_back``), so the
  next phase maps the newest weights of every layer; the fp32 masters still travel by the
  handover or the checkpoint.
- Faults: the holder's end is a run fault (the orchestrator names it); a block shared by CUDA IPC
  stays valid for the phases that mapped it until they end, and goes when the last of them does
  (benchmarks/results/2026-12-06-resident-probe-h100). A phase killed in its write-back leaves
  the block half-written, and the run ends with it: a rerun builds a new holder from the checkpoint.
"""

from __future__ import annotations

import mmap
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

from launch.basemodel import base_model, model_spec
from launch.contract import faults
from launch.contract.files import PhaseDir, Resident, TensorRef
from launch.contract.spec import PhaseSpec
from launch.procs import PhaseError
from launch.record import Phase, device_of
from launch.staging import block_bytes, install, one_block
from launch.transports import cuda_storage, device_id, export_cuda, view
from shard_tools.state import layer_weights
from shard_tools.store import Checkpoints

POLL = 0.02


# -- the holder ---------------------------------------------------------------------------------
def hold(spec: PhaseSpec, rank: int, prebuilt: dict[str, nn.Module]) -> int:
    """The holder of this rank's device: the model's weights there, its record written; then it
    sleeps until it is ended with the run (the fork server's end, or the orchestrator's)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    device = device_of()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = base_model(model_spec(spec), prebuilt)
    start = spec.restore or spec.preload
    if start is not None:
        _overlay_layers(model, Checkpoints(Path(spec.run_dir)), Path(start))
    t0 = time.perf_counter()
    record = export(named_tensors(model), device)
    PhaseDir(spec.phase_dir).write_resident(rank, record)
    print(f"relayer: holding the model's weights on {device} ({record.block.get('size', '?')} bytes, "
          f"{time.perf_counter() - t0:.2f} s)", flush=True)
    del model
    while True:
        time.sleep(3600)


def _overlay_layers(model: nn.Module, checkpoints: Checkpoints, start: Path) -> None:
    """The layers trained up to ``start`` into the host model, as a phase restoring it has them."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in layer_weights(checkpoints.layer_sources(start), mapped=True).items():
            params[name].copy_(t.to(params[name].dtype))


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by each of its names (a tied one under each)."""
    return {**{n: p.data for n, p in model.named_parameters(remove_duplicate=False)},
            **dict(model.named_buffers(remove_duplicate=False))}


def export(tensors: dict[str, torch.Tensor], device: torch.device) -> Resident:
    """``tensors`` in one block on ``device`` (on a CPU, a memfd of this process), each once."""
    first: dict[int, str] = {}  # a storage's first name, and each name's
    owner = {name: first.setdefault(t.data_ptr() if t.numel() else id(t), name) for name, t in tensors.items()}
    unique = list(first.values())
    if device.type == "cuda":
        views = dict(zip(unique, one_block([tensors[n] for n in unique], device)))
    else:
        views = dict(zip(unique, _memfd_block([tensors[n] for n in unique])))
    for name in unique:
        views[name].copy_(tensors[name])
    named = {name: views[owner[name]] for name in tensors}
    if device.type == "cuda":
        blocks, refs = export_cuda(named)
        return Resident(pid=os.getpid(), device=device_id(device), transport="cuda", block=blocks[0], tensors=refs)
    size = views[unique[0]].untyped_storage().nbytes() if unique else 0
    refs = [TensorRef(name=n, block=0, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                      stride=list(t.stride()), offset=t.storage_offset()) for n, t in named.items()]
    return Resident(pid=os.getpid(), device="host", transport="memfd",
                    block={"path": f"/proc/{os.getpid()}/fd/{_MEMFD[-1]}", "size": size}, tensors=refs)


_MEMFD: list[int] = []
"""The holder's memfd (kept open as long as it lives: its path is in the record)."""


def _memfd_block(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``one_block`` in a memfd of this process, mapped shared."""
    size = max(1, block_bytes(tensors))
    fd = os.memfd_create("relayer-resident")
    os.ftruncate(fd, size)
    _MEMFD.append(fd)
    whole = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
    return one_block(tensors, whole.device, block=whole)


# -- a phase ------------------------------------------------------------------------------------
def map_into(ph: Phase, model: nn.Module) -> dict[str, torch.Tensor]:
    """Makes every parameter and buffer of ``model`` (a skeleton) a view of the holder's block,
    tied ones tied still; the views by name."""
    record = await_record(ph)
    if record.device != device_id(ph.device):
        raise PhaseError(f"the holder of rank {ph.rank} keeps the weights on device {record.device}, "
                         f"this rank is on {device_id(ph.device)}")
    storage = cuda_storage(record.block, ph.device) if record.transport == "cuda" else _memfd_storage(record.block)
    views = {r.name: view(storage, r) for r in record.tensors}
    install(model, views.__getitem__, views.__getitem__)
    ph.timeline.mark("t_resident_mapped")
    return views


def await_record(ph: Phase) -> Resident:
    """The holder's record for this rank, once written; a PhaseError where the holder ended
    without one or took longer than ``launch.rendezvous_seconds``."""
    files, t0 = PhaseDir(ph.spec.resident), time.monotonic()
    while (record := files.read_resident(ph.rank)) is None:
        if (end := files.read_exit(ph.rank)) is not None:
            why = "; ".join(files.error_reasons()) or f"exit code {end.rc}"
            raise PhaseError(f"the holder of the model's weights (launch.resident) ended before they were "
                             f"there ({why}): see {files.log}")
        if time.monotonic() - t0 > ph.spec.rendezvous_seconds:
            raise PhaseError(f"the holder of the model's weights (launch.resident) wrote no "
                             f"{files.resident_path(ph.rank)} in {ph.spec.rendezvous_seconds:g} s: see {files.log}")
        time.sleep(POLL)
    return record


def _memfd_storage(block: dict) -> torch.UntypedStorage:
    fd = os.open(block["path"], os.O_RDWR)
    try:
        mm = mmap.mmap(fd, max(1, block["size"]))
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8).untyped_storage()


def own(model: nn.Module, trainable: frozenset[str]) -> None:
    """The parameters in ``trainable`` get memory of their own, a copy of the block's: the
    optimizer steps them there, never in the block another phase maps."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in trainable:
                p.data = p.data.clone()


def write_back(ph: Phase) -> None:
    """This finished phase's trained weights (the head's and its layers') into the holder's block,
    complete before it offers its state or writes its checkpoint: its successor maps them."""
    made = ph.made
    if made is None or made.resident is None:
        return
    named = dict(ph.built.engine.module.named_parameters())
    with torch.no_grad():
        for i, name in enumerate(sorted({*made.head_names, *made.body_names})):
            if i:
                faults.point("resident.writing", phase=ph.spec.phase, rank=ph.rank)
            made.resident[name].copy_(named[name].data)
    if ph.device.type == "cuda":
        torch.cuda.synchronize(ph.device)
    ph.timeline.mark("t_written_back")
