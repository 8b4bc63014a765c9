"""The host path of the handover (``HandoverPart.shm_offer`` / ``shm_take``): for a device that
cannot hold a finished phase and its successor at once (``launch.handover = "host"``, or a switch
whose overlap is above ``launch.device_memory``).

The predecessor writes its end state, the fp32 state only (the head's masters and Adam moments,
the masters of its layers and of the layers it carries), into a file in shared memory
(``PhaseDir.shm_blob_path``, 0600), lets go of its device memory (``release_device``: its engine's
tensors, so that only its CUDA context is left while the successor builds its engine), offers it
and waits for the answer; then it writes its checkpoint, if asked, from that file, and exits. The
successor prepared a host model as a phase without a handover does (no skeleton: the model's
frozen weights never move between the two; or it maps the holder's copy, ``launch.resident``, and
owns only what it trains), maps the file, puts the masters into its host model
(``copy_in``) and the layers that phases between its preload and its predecessor trained from
their committed checkpoints (``layers_between``), builds its engine and answers. The mapping is
copy-on-write: neither process copies the file to read it.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import Callable

import psutil
import torch

from launch import engine
from launch.contract import devmem, faults
from launch.contract.files import Carried, Offer, TensorRef
from launch.record import Phase
from launch.staging import Staging, one_block
from shard_tools.checkpoint import populate_writable
from shard_tools.later import Later
from shard_tools.state import PhaseState, RunState, layer_weights

ALIGN = 64


def pack_state(snap: PhaseState) -> dict[str, torch.Tensor]:
    """The fp32 state of a snapshot as an offer names it ("<key>/<name>"), no weights."""
    parts = {**snap.head, "master": {**snap.head["master"], **snap.masters}}
    return {f"{part}/{n}": t for part, by_name in parts.items() for n, t in by_name.items() if t.numel()}


def offer_bytes(ph: Phase) -> int:
    """At most the bytes of this phase's offer through host memory (``pack_state``, laid out by
    ``export``): fp32, the head's masters and moments, its layers' masters, the layers it carries."""
    numels = [ph.backend.shape(p).numel() for _, p in ph.built.head] * 3
    numels += [ph.backend.shape(p).numel() for _, p in ph.built.body] + [t.numel() for t in ph.made.carried.values()]
    return sum(_aligned(n * 4) for n in numels if n)


def _aligned(size: int) -> int:
    """``size`` bytes rounded up to the offer's alignment: where the next tensor starts (``export``)."""
    return -(-size // ALIGN) * ALIGN


def make_blob(blob: Path, size: int) -> torch.Tensor | None:
    """``blob`` (0600) of ``size`` bytes, mapped shared, its pages in memory already
    (``populate_writable``): a fresh file's pages, each faulted in as it is first written, made the
    copy into it several times slower (1.9 s a GB on the CPU machine of the tests, 0.15 s
    populated). None where it cannot be made (a full /dev/shm: ``export`` makes its own)."""
    try:
        fd = os.open(blob, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, size)
        whole = torch.frombuffer(mmap.mmap(fd, size, flags=mmap.MAP_SHARED), dtype=torch.uint8)
        populate_writable(whole)
        return whole
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def prepare(ph: Phase, blob: Path) -> Later[torch.Tensor | None]:
    """After the first step, this phase's offer file made and its pages in memory off the switch."""
    return Later(make_blob, blob, offer_bytes(ph))


def export(tensors: dict[str, torch.Tensor], blob: Path, staging: Staging | None, ready: torch.Tensor | None = None,
           **at: object) -> tuple[list[dict], list[TensorRef]]:
    """Every tensor's bytes into ``blob`` (0600: ``ready``, the file ``make_blob`` made ahead where
    it is large enough, else one made now; from a GPU through the pinned ring of ``staging``); the
    offer's blocks and tensors, as the host transport's."""
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    offsets = [sum(_aligned(n) for n in sizes[:i]) for i in range(len(sizes))]
    total = offsets[-1] + sizes[-1] if sizes else 0
    whole = ready if ready is not None and ready.numel() >= total else make_blob(blob, total) if total else None
    if total and whole is None:
        raise OSError(f"{blob}: cannot make {total} bytes in shared memory")
    blocks, refs = [], []
    for i, ((name, t), offset, size) in enumerate(zip(tensors.items(), offsets, sizes)):
        if i:
            faults.point("handover.writing", **at)
        out = whole[offset:offset + size].view(t.dtype).view(t.shape)
        if staging is not None and t.device.type == "cuda":
            staging.to_host(t.detach().contiguous(), out)
        else:
            out.copy_(t.detach())
        blocks.append({"offset": offset, "size": size})
        refs.append(TensorRef(name=name, block=i, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                              stride=list(out.stride()), offset=0))
    return blocks, refs


def map_blob(offer: Offer, blob: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each offered tensor, by its key and name, as a view of ``blob`` mapped copy-on-write."""
    with open(blob, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        whole = (torch.frombuffer(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY), dtype=torch.uint8)
                 if size else torch.empty(0, dtype=torch.uint8))
    parts: dict[str, dict[str, torch.Tensor]] = {k: {} for k in engine.KEYS}
    for r in offer.tensors:
        block = offer.blocks[r.block]
        part, _, name = r.name.partition("/")
        parts[part][name] = (whole[block["offset"]:][:block["size"]].view(getattr(torch, r.dtype))
                             .as_strided(r.shape, r.stride))
    return parts


def from_blob(snap: PhaseState, offer: Offer, blob: Path) -> PhaseState:
    """``snap`` with its tensors the offered bytes in host memory: what the predecessor writes its
    checkpoint from once its device memory is gone."""
    parts = map_blob(offer, blob)
    snap.head = {k: {n: parts[k].get(n, t) for n, t in by_name.items()} for k, by_name in snap.head.items()}
    snap.masters = {n: parts["master"].get(n, t) for n, t in snap.masters.items()}
    return snap


def release_device(ph: Phase) -> int:
    """Lets go of every tensor of the finished phase's engine (its weights, buffers, gradients and
    optimizer state: all is in host memory by now) and of the layers it carried; on CUDA the
    allocator's cache goes back to the driver. The bytes it gave back (0 off CUDA).

    The buffers too: the frozen weights lie in one block with them (``staging.module_to_device``),
    and a buffer's view keeps the whole block. So do ZeRO's links of each parameter to its partitions
    (``_hp_mapping``: a view of the trainable weights' 16-bit flat block on the device, 1.2 GiB at 7B)
    and the torch optimizer's param groups (three levels down). Before those two, at 7B on an H100
    (ZeRO 2, the optimizer on the host, the holder's copy) a released phase still held 3.8 GiB until
    it exited, its CUDA context about 1.4 of it (benchmarks/results/2026-12-07-issue42-h100-switch)."""
    cuda = ph.device.type == "cuda"
    before = torch.cuda.memory_reserved(ph.device) if cuda else 0
    engine = ph.built.engine
    for p in engine.module.parameters():
        p.grad = None
        p.data = torch.empty(0, dtype=p.data.dtype, device=p.data.device)
        if hasattr(p, "_hp_mapping"):  # ZeRO 1-2's fragments: views of the 16-bit flat block on the device, too
            p._hp_mapping = None
    for m in engine.module.modules():
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = torch.empty(0, dtype=b.dtype, device=b.device)
    for t in _tensors(engine.optimizer):
        t.data = torch.empty(0, dtype=t.data.dtype, device=t.data.device)
    ph.made.carried = {}
    if not cuda:
        return 0
    torch.cuda.synchronize(ph.device)
    torch.cuda.empty_cache()
    return before - torch.cuda.memory_reserved(ph.device)


PREDECESSOR_EXIT_SECONDS = 60.0
"""How long a successor under a device budget waits for its predecessor to exit before its first step
(``wait_gone``, ``handover.await_leaving``): the predecessor writes its checkpoint first (0.8-1.4 s at 7B)."""


def wait_gone(pid: int, timeout: float = PREDECESSOR_EXIT_SECONDS, poll: float = 0.02,
              holds: Callable[[int], bool] | None = None) -> float | None:
    """Waits until process ``pid`` has exited and no longer ``holds`` device memory (NVML lists it
    no more); the seconds it waited, None where ``timeout`` passed first.

    Under a budget the successor waits for this before its first step (``handover.await_leaving``): the
    predecessor's ``release_device`` does not give all of its memory back (at 7B on an H100 the
    device held both phases' weights at every switch, 30-34 GiB under a budget of 24,
    benchmarks/results/2026-12-06-issue42-h100-7b), its exit does, but not at once: with the wait
    for its exit alone the device still rose to 30-31 GiB for 0.3-0.5 s after it, until the driver
    had torn the exited process's context down (benchmarks/results/2026-12-06-issue41-h100-resident).
    ``holds``: NVML's list (``devmem.holders``, one session for the whole wait) unless given."""
    if holds is None:
        with devmem.holders() as listed:
            return wait_gone(pid, timeout, poll, listed)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            gone = True
        if gone and not holds(pid):
            return time.monotonic() - t0
        time.sleep(poll)
    return None


def _tensors(optimizer: object) -> list[torch.Tensor]:
    """The tensors an optimizer holds in its attributes, two levels down (DeepSpeed's flat
    partitions and bf16 groups, its state; MasterAdamW's flat buffers and its inner AdamW's)."""
    found: dict[int, torch.Tensor] = {}
    inner = getattr(optimizer, "optimizer", None)  # a ZeRO optimizer's torch optimizer
    todo = [optimizer, getattr(optimizer, "state", {}), getattr(optimizer, "inner", None), inner,
            getattr(inner, "state", {})]
    for depth in range(4):
        nxt = []
        for obj in todo:
            values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else \
                vars(obj).values() if hasattr(obj, "__dict__") and not isinstance(obj, torch.Tensor) else [obj]
            for v in values:
                if isinstance(v, torch.Tensor):
                    found[id(v)] = v
                elif isinstance(v, (list, tuple, dict)) and depth < 3:
                    nxt.append(v)
        todo = nxt
    return list(found.values())


def copy_in(ph: Phase, offered: Offer, blob: Path, keep: bool) -> PhaseState:
    """The offered fp32 state into this process: every master into the host model (the head's, this
    phase's layers', and the layers the predecessor carried, frozen here), the head's state carried
    on, and with ``keep`` the other layers' masters kept on its device (``Prepared.carried``)."""
    made = ph.made
    parts = map_blob(offered, blob)
    faults.point("handover.copying", phase=ph.spec.phase, rank=ph.rank)
    masters = parts["master"]
    made.overlay(masters)
    head = {k: {n: parts[k][n] for n in made.head_names} for k in engine.KEYS}
    layers = {n: t for n, t in masters.items() if n in made.body_names}
    others = sorted(set(masters) - set(made.body_names) - set(made.head_names)) if keep else []
    made.carried = {}
    if others:
        block = one_block([masters[n] for n in others], ph.device)
        made.carried = dict(zip(others, block))
        for n in others:
            made.carried[n].copy_(masters[n])
    c = offered.carried
    return PhaseState(
        step=c.global_step, phase=c.phase, layers=c.layers, phase_complete=True,
        head_step=c.head_step, body_step=c.body_step, head=head, masters=layers,
        run=RunState(data_position=c.global_step * ph.spec.data.batch_size, scaler=dict(c.scaler)))


def layers_between(ph: Phase, carried: Carried, offered: frozenset[str]) -> None:
    """Every layer (frozen here or not) that a phase between this one's preload and its predecessor
    trained, from those checkpoints (waited for: the last may be its predecessor's predecessor's end,
    still being written) into the host model, except the masters the predecessor offered, which are
    newer."""
    if not carried.restore:
        return
    ph.checkpoints.wait_committed(Path(carried.restore))  # its writer, two phases back, may be writing still
    sources = ph.checkpoints.layer_sources(Path(carried.restore))
    changed = {l: s for l, s in sources.items() if ph.made.preloaded.get(l) != s}
    ph.made.overlay({n: t for n, t in layer_weights(changed, mapped=True).items() if n not in offered})
    ph.made.preloaded.update(changed)
    ph.timeline.add(layers_at_go=sorted(changed))
