"""Saving a phase's checkpoint: full tensors gathered on every rank (collectives), rank 0 writes
them, into files it made ahead (``prepare_files``) where they fit, and commits the manifest."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import deepspeed
import safetensors
import torch
import transformers

from launch import faults, zero_state
from launch.contract.spec import lr_at
from launch.scaler import scaler_tensors
from launch.zero_state import BODY_DECAY, BODY_NO_DECAY, HEAD_DECAY, HEAD_NO_DECAY
from shard_tools.checkpoint import (
    BODY_OPTIM, HEAD, LAYERS, OPTIM_KEYS, STATE, PreparedFiles, flatten_optim_state, write_checkpoint,
)
from shard_tools.manifest import MANIFEST, CheckpointError, Manifest

if TYPE_CHECKING:
    from launch.phase import Phase


@dataclass
class Snapshot:
    """A finished phase's state gathered on its device, full tensors on every rank: what it offers
    its successor (``launch.handover``) and, once answered, writes from its own memory."""

    head: dict[str, dict[str, torch.Tensor]]
    """The head's fp32 masters and Adam moments, {key: {name: tensor}}."""
    layers: dict[str, torch.Tensor]
    """The fp32 masters of the phase's layers."""
    state: dict[str, torch.Tensor]
    """The state file's tensors (``state_tensors``)."""
    head_step: int
    body_step: int


def snapshot(ph: Phase) -> Snapshot:
    """The phase-end state on the device, on every rank (collectives)."""
    zero_state.relink(ph.engine)
    head = zero_state.get_state(ph.head, on_device=True)
    layers = zero_state.get_masters(ph.body, on_device=True)
    head_step, body_step = _steps(ph)
    return Snapshot(head=head, layers=layers, state=state_tensors(ph), head_step=head_step, body_step=body_step)


def save(ph: Phase, phase_complete: bool, snap: Snapshot | None = None) -> Path | None:
    """Gathers full tensors on every rank (collectives); rank 0 copies them into its prepared
    files (so on a GPU the copy from the device is the write) and commits the checkpoint. With
    ``snap`` (handed over): rank 0 writes it and no collective is left; the other ranks have
    nothing to do. A phase end is made durable by the orchestrator (``orchestrator.commit``): an
    fsync of GBs here stalled the orchestrator's own small ones behind it on the H200's host."""
    t0 = time.time()
    writer = ph.rank == 0
    if isinstance(ph.prepared, FilesLater):
        ph.prepared = ph.prepared.result()
    faults0, cache0 = _page_faults(), _dirty_page_cache() if writer else {}
    if snap is not None:
        files = _files_of(ph, snap) if writer else {}
        head_step, body_step = snap.head_step, snap.body_step
    else:
        files, head_step, body_step = _gather(ph, phase_complete, writer)
    t_gathered = time.time()
    # Why a gather was slow: pages that had to be faulted in again (cleaned by writeback since
    # they were prepared), and how much of the page cache was dirty or under writeback.
    gather_faults = _page_faults() - faults0
    if not writer:
        if snap is None:
            torch.distributed.barrier()
        return None
    prepared, ph.prepared = ph.prepared, None
    await_predecessor(ph)
    path, timing = write_checkpoint(ph.run_dir, _manifest(ph, phase_complete, head_step, body_step), files,
                                    file_metadata(ph), durable=not phase_complete, prepared=prepared,
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
    if ph.awaiting is None:
        return
    while not (ph.awaiting / MANIFEST).exists():
        time.sleep(0.005)
    ph.awaiting = None


def _files_of(ph: Phase, snap: Snapshot) -> dict:
    """The checkpoint's files from a snapshot on the device, copied into the prepared files."""
    views = ph.prepared.views if ph.prepared is not None else {}
    head_views, layer_views = views.get(HEAD, {}), views.get(LAYERS, {})
    head = {k: {n: zero_state.to_host(t, t.shape, head_views.get(f"{k}/{n}"), ph.staging) for n, t in by_name.items()}
            for k, by_name in snap.head.items()}
    layers = {n: zero_state.to_host(t, t.shape, layer_views.get(n), ph.staging) for n, t in snap.layers.items()}
    return {HEAD: flatten_optim_state(head), LAYERS: layers, STATE: snap.state}


def _gather(ph: Phase, phase_complete: bool, writer: bool) -> tuple[dict, int, int]:
    """The checkpoint's files (name -> tensors; complete on rank 0 only) and the head's and the
    body's optimizer steps."""
    views = ph.prepared.views if writer and ph.prepared is not None else {}
    gather = {"keep": writer, "staging": ph.staging}
    zero_state.relink(ph.engine)
    head = zero_state.get_state(ph.head, into=views.get(HEAD), **gather)
    into_layers = views.get(LAYERS, {})
    if phase_complete:
        layers, body = zero_state.get_masters(ph.body, into=into_layers, **gather), {}
    else:
        body = zero_state.get_state(ph.body, into={f"master/{n}": t for n, t in into_layers.items()}, **gather)
        layers = body.pop("master", {})
    state = state_tensors(ph)
    head_step, body_step = _steps(ph)
    files = {HEAD: flatten_optim_state(head), LAYERS: layers, STATE: state} if writer else {}
    if writer and not phase_complete:
        files[BODY_OPTIM] = flatten_optim_state(body)
    return files, head_step, body_step


def _steps(ph: Phase) -> tuple[int, int]:
    """The head's and the body's optimizer steps."""
    steps = zero_state.group_steps(ph.engine)
    by_role = dict(zip(ph.roles, range(len(ph.roles))))
    head_step = max(steps.get(by_role.get(r, -1), 0) for r in (HEAD_DECAY, HEAD_NO_DECAY))
    body_step = max((steps.get(by_role.get(r, -1), 0) for r in (BODY_DECAY, BODY_NO_DECAY)), default=0)
    return head_step, body_step


def _manifest(ph: Phase, phase_complete: bool, head_step: int, body_step: int) -> Manifest:
    spec = ph.spec
    return Manifest(
        global_step=ph.step, phase=spec.phase, layers=list(spec.layers), phase_complete=phase_complete,
        head_step=head_step, body_step=body_step, world_size=ph.world, zero_stage=spec.zero_stage,
        dtype=spec.model.dtype, files={}, versions=versions(), created=0.0,
        extra={"data_position": ph.step * spec.data.batch_size, "persistent": ph.persistent,
               "base_model": {"path": spec.model.path, "config": spec.model.config, "seed": spec.seed,
                              "dtype": spec.model.dtype},
               "tokenizer": spec.model.tokenizer, "layers_attr": ph.layers_attr,
               "lr": lr_at(max(ph.step - 1, 0), spec.optimizer)},
    )


def state_tensors(ph: Phase) -> dict[str, torch.Tensor]:
    """Every rank's RNG states (gathered), the data position and the loss scaler, as tensors."""
    out = {"data_position": torch.tensor([ph.step * ph.spec.data.batch_size], dtype=torch.int64),
           "global_step": torch.tensor([ph.step], dtype=torch.int64)}
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
        out.update({f"rng/cuda.rank{r}": t.cpu() for r, t in enumerate(cuda_all)})
    else:
        torch.distributed.all_gather(gathered, cpu_state)
    out.update({f"rng/cpu.rank{r}": t for r, t in enumerate(gathered)})
    out.update(scaler_tensors(getattr(ph.engine.optimizer, "loss_scaler", None)))
    return out


def file_metadata(ph: Phase) -> dict[str, dict[str, str]]:
    return {LAYERS: {"layers": ",".join(map(str, ph.spec.layers)), "layers_prefix": ph.layers_attr}}


class FilesLater(threading.Thread):
    """``prepare_files`` in a thread: a phase that took its predecessor's state over made none
    while it waited (they grow with the model), and makes them once it trains, for its own end."""

    def __init__(self, ph: Phase):
        super().__init__(name="prepare-files", daemon=True)
        self.ph, self.files, self.error = ph, None, None
        self.start()

    def run(self) -> None:
        try:
            self.files = prepare_files(self.ph)
        except BaseException as e:  # noqa: BLE001 - raised by result()
            self.error = e

    def result(self) -> PreparedFiles | None:
        self.join()
        if self.error is not None:
            raise self.error
        return self.files


def prepare_files(ph: Phase) -> PreparedFiles | None:
    """Rank 0's head and layers files of the next checkpoint, made now (``PreparedFiles``)."""
    if ph.rank != 0:
        return None
    named = list(ph.model.named_parameters())
    shapes = zero_state.full_shapes(named)
    layouts = {HEAD: {f"{k}/{n}": (torch.float32, shapes[n]) for n in ph.head_names for k in OPTIM_KEYS},
               LAYERS: {n: (torch.float32, shapes[n]) for n in ph.body_names}}
    try:
        return PreparedFiles(ph.run_dir, layouts, file_metadata(ph))
    except CheckpointError as e:
        print(f"relayer: {e}; the checkpoint will be written without them", file=sys.stderr, flush=True)
        return None


def versions() -> dict[str, str]:
    return {
        "relayer": relayer_version(), "torch": torch.__version__,
        "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
        "safetensors": safetensors.__version__, "python": platform.python_version(),
    }


def relayer_version() -> str:
    """The installed package's version; "source" where the packages run from a source tree that
    was not installed (PYTHONPATH), as on a machine lent for a benchmark."""
    try:
        return importlib.metadata.version("relayer")
    except importlib.metadata.PackageNotFoundError:
        return "source"


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
