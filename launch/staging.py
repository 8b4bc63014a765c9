"""Host <-> device copies of pageable tensors at pinned speed, through a small ring of pinned buffers.

A copy between the device and pageable host memory goes through the driver's own staging, about
half as fast as from pinned memory; pinning whole tensors instead costs more than it saves: the
pages must be unpinned again, ~0.14 s per GB on an H200 host, at the process's exit at the latest,
which is on the switch's critical path (benchmarks/results/2026-11-29-nvidia-h200-v3/exit_write.md).
So tensors go through a few pinned slots: the host side of one slot is copied on all cores while
the device copies another.

The model's weights, which a pre-warmed phase holds long before its go, are the exception
(``register_module``): they go into one host buffer that the driver pins in place
(``cudaHostRegister``) while the phase prepares, are copied to the device by DMA alone at the go
(2.2 GB: 0.01-0.02 s against 0.14-0.33 s through the ring inside a switch), and are unpinned in
a thread once the phase trains (0.04 s; ``benchmarks/results/2026-11-30-nvidia-h200-v5/``).
"""

from __future__ import annotations

import mmap
import threading
import time

import torch

SLOTS = 4
SLOT_BYTES = 32 << 20


def cap_memory(device: torch.device, cap: int) -> float | None:
    """Caps this process's caching allocator at ``cap`` bytes of ``device`` (``PhaseSpec.memory_cap``,
    its share of ``launch.device_memory``): an allocation past it raises torch.OutOfMemoryError
    instead of taking more of the device. The fraction set; None where nothing is capped (no GPU, no budget)."""
    if device.type != "cuda" or cap <= 0:
        return None
    fraction = min(1.0, cap / torch.cuda.get_device_properties(device).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class Staging:
    def __init__(self, device: torch.device, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES):
        self.device = device
        self.slot_bytes = slot_bytes
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.done: list[torch.cuda.Event | None] = [None] * slots
        self.stream = torch.cuda.Stream(device)
        self.turn = 0
        self.registered: torch.Tensor | None = None
        """The host buffer ``register_module`` put the weights in, while the driver has it pinned."""
        self.register_seconds: dict[str, float] = {}
        """What ``register_module`` took: the copy into the buffer and the pinning."""

    def _slot(self) -> tuple[int, torch.Tensor]:
        i = self.turn % len(self.slots)
        self.turn += 1
        if self.done[i] is not None:
            self.done[i].synchronize()  # the device is through with this slot's last copy
        return i, self.slots[i]

    def register_module(self, module: torch.nn.Module) -> bool:
        """Puts every host parameter and buffer of ``module`` (tied ones once) into one host
        buffer of their own and has the driver pin it in place, for ``module_to_device``. Costs a
        copy of the weights (pages shared with the fork server become this process's own) and
        their pinning: done while the phase prepares. False where the driver refuses (the ring
        is used then)."""
        t0 = time.perf_counter()
        with torch.no_grad():
            host: list[torch.Tensor] = []
            _replace_tensors(module, lambda t: host.append(t) if t.device.type == "cpu" else None)
            buf = _host_buffer(sum(_aligned(t) for t in host))
            offset = 0

            def move(t: torch.Tensor) -> torch.Tensor | None:
                nonlocal offset
                if t.device.type != "cpu":
                    return None
                view = buf[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
                view.copy_(t)
                offset += _aligned(t)
                return view

            _replace_tensors(module, move)  # the same order as above
        t1 = time.perf_counter()
        torch.cuda.set_device(self.device)  # per thread: pinned for this device's context, not device 0's
        rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.nbytes, 0))
        self.register_seconds = {"copy": t1 - t0, "pin": time.perf_counter() - t1}
        if rc != 0:
            return False
        self.registered = buf
        return True

    def unregister_later(self) -> None:
        """Unpins the registered buffer in a thread and frees it (a running step is slowed by a few
        ms; at the exit it would cost about as much, on the switch's critical path)."""
        buf, self.registered = self.registered, None
        if buf is None:
            return
        torch.cuda.current_stream(self.device).synchronize()  # no copy from it is still in flight

        def unpin() -> None:
            torch.cuda.set_device(self.device)
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

        threading.Thread(target=unpin, name="unpin", daemon=True).start()

    def _registered(self, t: torch.Tensor) -> bool:
        buf = self.registered
        return buf is not None and buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + buf.nbytes

    def module_to_device(self, module: torch.nn.Module, apart: frozenset[str] = frozenset()) -> None:
        """Moves every parameter and buffer of ``module`` to the device (tied ones once): the
        parameters named in ``apart`` (the trainable ones, which the optimizer puts in flat
        buffers of its own) each to memory of its own, the rest into one block of device memory:
        one allocation instead of hundreds, and one CUDA IPC handle where the phase offers them to
        its successor (``launch.handover``)."""
        own = {p.data.data_ptr() for n, p in module.named_parameters() if n in apart}
        host: list[torch.Tensor] = []
        _replace_tensors(module, lambda t: host.append(t) if t.device != self.device and t.data_ptr() not in own else None)
        views = iter(one_block(host, self.device))
        with torch.no_grad():
            def move(t: torch.Tensor) -> torch.Tensor | None:
                if t.device == self.device:
                    return None
                return self.to_device(t) if t.data_ptr() in own else self.to_device(t, next(views))

            _replace_tensors(module, move)  # the same order as above

    def to_device(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A device copy of a host tensor (into ``out`` where given); ready for work on the current stream."""
        if self._registered(host):  # pinned: the device copies it by itself
            if out is None:
                return host.to(self.device, non_blocking=True)
            return out.copy_(host, non_blocking=True)
        return self._through_ring(host, out)

    def _through_ring(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        host = host.contiguous()
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device) if out is None else out
        src, dst = _bytes(host), _bytes(out)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # ``out`` is allocated there
        for offset in range(0, src.numel(), self.slot_bytes):
            n = min(self.slot_bytes, src.numel() - offset)
            i, slot = self._slot()
            slot[:n].copy_(src[offset:offset + n])
            with torch.cuda.stream(self.stream):
                dst[offset:offset + n].copy_(slot[:n], non_blocking=True)
                self.done[i] = torch.cuda.Event()
                self.done[i].record(self.stream)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        out.record_stream(self.stream)
        return out

    def to_host(self, dev: torch.Tensor, out: torch.Tensor) -> None:
        """Copies a device tensor into a host tensor (pageable: a mapped file's pages, say)."""
        src, dst = _bytes(dev.contiguous()), _bytes(out)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # ``dev`` is computed there
        pending: list[tuple[int, int, int]] = []
        for offset in range(0, src.numel(), self.slot_bytes):
            n = min(self.slot_bytes, src.numel() - offset)
            i, slot = self._slot()
            with torch.cuda.stream(self.stream):
                slot[:n].copy_(src[offset:offset + n], non_blocking=True)
                self.done[i] = torch.cuda.Event()
                self.done[i].record(self.stream)
            pending.append((i, offset, n))
            if len(pending) == len(self.slots) - 1:
                self._land(pending.pop(0), dst)
        for job in pending:
            self._land(job, dst)

    def _land(self, job: tuple[int, int, int], dst: torch.Tensor) -> None:
        i, offset, n = job
        self.done[i].synchronize()
        dst[offset:offset + n].copy_(self.slots[i][:n])


BLOCK_ALIGN = 256


def one_block(tensors: list[torch.Tensor], device: torch.device, block: torch.Tensor | None = None
              ) -> list[torch.Tensor]:
    """Empty tensors shaped as ``tensors``, views into one allocation on ``device`` (each at a
    multiple of 256 bytes), in their order; into ``block`` (bytes, large enough) where given."""
    block = torch.empty(block_bytes(tensors), dtype=torch.uint8, device=device) if block is None else block
    out, at = [], 0
    for t in tensors:
        out.append(block[at:at + t.nbytes].view(t.dtype).view(t.shape) if t.numel() else torch.empty(
            t.shape, dtype=t.dtype, device=device))
        at += _in_block(t)
    return out


def block_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes ``one_block`` lays ``tensors`` out in."""
    return sum(map(_in_block, tensors))


def _in_block(t: torch.Tensor) -> int:
    return -(-t.nbytes // BLOCK_ALIGN) * BLOCK_ALIGN


def install(model: torch.nn.Module, params, buffers) -> None:
    """New parameters and buffers in place of ``model``'s (a skeleton's, on the meta device):
    ``params(name)`` and ``buffers(name)``, each asked for under its first name; a parameter or
    buffer that two modules share stays shared."""
    new_p = {id(p): torch.nn.Parameter(params(n), requires_grad=p.requires_grad) for n, p in model.named_parameters()}
    new_b = {id(b): buffers(n) for n, b in model.named_buffers()}
    for module in model.modules():
        for leaf, p in module._parameters.items():
            if p is not None:
                module._parameters[leaf] = new_p[id(p)]
        for leaf, b in module._buffers.items():
            if b is not None:
                module._buffers[leaf] = new_b[id(b)]


def _host_buffer(size: int) -> torch.Tensor:
    """``size`` bytes of host memory, in transparent huge pages where the kernel gives them: one
    fault per 2 MB instead of 512, and fewer pages to pin. (Copying into a fresh 2.2 GB buffer is
    most of registering it: 0.2 s on a quiet H200 host, pinning 0.05-0.1 s.)"""
    mm = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    return torch.frombuffer(mm, dtype=torch.uint8)  # holds ``mm`` until the tensor goes


def _aligned(t: torch.Tensor) -> int:
    return -(-t.nbytes // 64) * 64


def _replace_tensors(module: torch.nn.Module, new) -> None:
    """Replaces each parameter's data and each buffer by ``new(tensor)`` where that is not None;
    a tied parameter (the same object in two modules) is seen once."""
    seen: set[int] = set()
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                if (t := new(p.data)) is not None:
                    p.data = t
        for name, b in m._buffers.items():
            if b is not None and (t := new(b)) is not None:
                m._buffers[name] = t
