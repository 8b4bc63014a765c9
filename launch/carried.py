"""The carried layers on the host (``Prepared.carried``, ``Prepared.host``).

Under the cadence (``checkpoint.every_seconds``) a phase whose end writes no checkpoint hands the
fp32 masters of the layers trained since the last one on to its successor, which carries them to
the next checkpoint. They wait in host memory shared between the phase processes (Linux memfd
segments), not on the device, where they grew every phase's peak (13 GB over 13 phases at 7B):

- the successor maps the segments its predecessor holds (``HostCarry.adopt``, through
  ``/proc/PID/fd/FD``: no copy; the predecessor lives until it has the answer);
- the layers the predecessor trained come in its offer on the device; the successor copies them
  into its own device memory before its answer, as every offered tensor, and after the answer into
  a segment of its own once its first step is done (``HostCarry.hold_later``, in a thread, through
  the pinned ring: off the switch, where it cost 0.05-0.08 s at 1.1B on an H100), and lets the
  device copy go;
- its offer names every segment it holds (``HostCarry.refs``), its checkpoint reads them there.

A segment's memory goes when the last process that maps it has exited or let it go: a kill
leaves nothing behind. The host holds at most one copy of each layer's masters (the segments are
shared): 4 bytes a parameter of the layers, 27 GB at 7B with every layer carried.
"""

from __future__ import annotations

import math
import mmap
import os
import time
from dataclasses import dataclass, field

import torch

from shard_tools.later import Later

ALIGN = 256


@dataclass
class Segment:
    fd: int
    buf: torch.Tensor
    """The mapping, as bytes."""


def _map(fd: int, size: int) -> Segment:
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return Segment(fd, torch.frombuffer(mm, dtype=torch.uint8))  # holds ``mm`` until the tensor goes


def _view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return buf[offset:offset + nbytes].view(dtype).view(shape)


@dataclass
class HostCarry:
    """The segments this process maps, and the copy of newly carried layers into one, under way."""

    segments: list[Segment] = field(default_factory=list)
    fresh: dict[str, torch.Tensor] = field(default_factory=dict)
    """This process's device copies of layers its predecessor trained, until ``hold_later`` has them."""
    copying: Later[None] | None = None
    ahead: dict[str, torch.Tensor] = field(default_factory=dict)
    """Carried layers the successor trains, on the device ahead of the offer (``upload_ahead``)."""
    uploading: Later[None] | None = None

    def adopt(self, refs: list[dict]) -> dict[str, torch.Tensor]:
        """Host views of the layers ``refs`` name: another process's segments (alive), mapped here."""
        opened: dict[tuple[int, int], Segment] = {}
        out = {}
        for r in refs:
            key = (r["pid"], r["fd"])
            if key not in opened:
                fd = os.open(f"/proc/{r['pid']}/fd/{r['fd']}", os.O_RDWR | os.O_CLOEXEC)
                opened[key] = _map(fd, os.fstat(fd).st_size)
                self.segments.append(opened[key])
            out[r["name"]] = _view(opened[key].buf, r["offset"], getattr(torch, r["dtype"]), r["shape"])
        return out

    def hold(self, tensors: dict[str, torch.Tensor], staging=None) -> dict[str, torch.Tensor]:
        """Host copies of ``tensors`` (on the device or the host) in a new segment of this process's,
        by name; a device tensor through ``staging``'s pinned ring where given."""
        sizes = [-(-t.nbytes // ALIGN) * ALIGN for t in tensors.values()]
        if not tensors:
            return {}
        fd = os.memfd_create("relayer-carried", os.MFD_CLOEXEC)
        os.ftruncate(fd, sum(sizes))
        seg = _map(fd, sum(sizes))
        self.segments.append(seg)
        out, at = {}, 0
        for (name, t), size in zip(tensors.items(), sizes):
            view = _view(seg.buf, at, t.dtype, list(t.shape))
            if staging is not None and t.device.type == "cuda":
                staging.to_host(t, view)
            else:
                view.copy_(t)
            out[name], at = view, at + size
        return out

    def _segment_of(self, t: torch.Tensor) -> Segment | None:
        ptr = t.data_ptr()
        if t.device.type != "cpu":
            return None
        return next((s for s in self.segments if s.buf.data_ptr() <= ptr < s.buf.data_ptr() + s.buf.numel()), None)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in one of this process's segments (a carried layer taken over the host
        path, ``launch.hostpath``, does not: it is offered with the rest)."""
        return self._segment_of(t) is not None

    def refs(self, tensors: dict[str, torch.Tensor]) -> list[dict]:
        """Where each of ``tensors`` (views into this process's segments) lies, for an offer (JSON)."""
        out = []
        for name, t in tensors.items():
            ptr, seg = t.data_ptr(), self._segment_of(t)
            out.append({"name": name, "pid": os.getpid(), "fd": seg.fd, "offset": ptr - seg.buf.data_ptr(),
                        "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)})
        return out

    def release(self) -> None:
        """Lets every segment go (their memory goes once no view and no other process holds it)."""
        self.settle()
        for seg in self.segments:
            os.close(seg.fd)
        self.segments, self.fresh, self.ahead = [], {}, {}

    def settle(self) -> float:
        """Waits for the copies under way (raising what they raised); the seconds waited."""
        t0 = time.perf_counter()
        for name in ("uploading", "copying"):
            work = getattr(self, name)
            if work is not None:
                setattr(self, name, None)
                work.result()
        return time.perf_counter() - t0

    def upload_ahead(self, carried: dict[str, torch.Tensor], names: set[str], device: torch.device) -> None:
        """The carried layers ``names`` (those the successor trains) on the device, in a thread: the
        offer then holds them there, and the successor's switch reads none from the host (at 1.1B on
        an H100 a layer read from the host there took ~0.05 s). Started before ``hold_later``:
        those still on the device stay."""
        picked = {n: t for n, t in carried.items() if n in names}

        def work() -> None:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            up = {n: t if t.device == device else t.to(device) for n, t in picked.items()}
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            self.ahead = up

        self.uploading = Later(work)

    def flush(self, carried: dict[str, torch.Tensor], device: torch.device, staging=None) -> float:
        """Every carried layer on the host now (``hold_later`` not started yet: a phase that ends
        without a step); the seconds waited."""
        if self.fresh and self.copying is None:
            self.hold_later(carried, device, staging)
        return self.settle()

    def hold_later(self, carried: dict[str, torch.Tensor], device: torch.device, staging=None) -> None:
        """``fresh`` into a new segment, in a thread: each then in ``carried`` in place of its device
        copy, which goes."""
        fresh = self.fresh
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies made on this thread's stream are done

        def work() -> None:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # per thread
            held = self.hold(fresh, staging)
            carried.update(held)
            fresh.clear()

        self.copying = Later(work)
