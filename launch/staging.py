"""Host <-> device copies of pageable tensors at pinned speed, through a small ring of pinned buffers.

A copy between the device and pageable host memory goes through the driver's own staging, about
half as fast as from pinned memory; pinning whole tensors instead costs more than it saves: the
pages must be unpinned again, ~0.14 s per GB on an H200 host, at the process's exit at the latest,
which is on the switch's critical path (benchmarks/results/2026-11-29-nvidia-h200-v3/exit_write.md).
So tensors go through a few pinned slots: the host side of one slot is copied on all cores while
the device copies another.
"""

from __future__ import annotations

import torch

SLOTS = 4
SLOT_BYTES = 32 << 20


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

    def _slot(self) -> tuple[int, torch.Tensor]:
        i = self.turn % len(self.slots)
        self.turn += 1
        if self.done[i] is not None:
            self.done[i].synchronize()  # the device is through with this slot's last copy
        return i, self.slots[i]

    def module_to_device(self, module: torch.nn.Module) -> None:
        """Moves every parameter and buffer of ``module`` to the device (tied ones once)."""
        with torch.no_grad():
            for m in module.modules():
                for name, p in m._parameters.items():
                    if p is not None and p.device != self.device:
                        p.data = self.to_device(p.data)
                for name, b in m._buffers.items():
                    if b is not None and b.device != self.device:
                        m._buffers[name] = self.to_device(b)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of a host tensor; ready for work on the current stream."""
        host = host.contiguous()
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
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
