"""Device memory as the driver sees it, without a CUDA context: NVML (``nvidia-ml-py``, optional).

After a phase's processes are gone the orchestrator records what the device still holds, and
which processes hold it; under a device budget a successor waits until its predecessor holds none
(``launch.hostpath.wait_gone``). Without NVML (CPU machines, or the extra not installed) nothing is
recorded and nothing waited for: the next worker's own start-of-phase reading stands in.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator


@contextlib.contextmanager
def session() -> Iterator[object | None]:
    """NVML (the ``pynvml`` module) initialised for the block, shut down after; None without it."""
    listing = Listing()
    try:
        yield listing._nvml
    finally:
        listing.close()


def snapshot(pids: set[int] | None = None) -> dict | None:
    """{"devices": [{index, used, total, processes: [{pid, used}]}], "held_by_phase": bytes} or None."""
    with session() as pynvml:
        return None if pynvml is None else _snapshot(pynvml, pids)


def _snapshot(pynvml, pids: set[int] | None) -> dict | None:
    try:
        devices, held = [], 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            procs = [{"pid": p.pid, "used": p.usedGpuMemory or 0} for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
            held += sum(p["used"] for p in procs if pids and p["pid"] in pids)
            devices.append({"index": i, "used": mem.used, "total": mem.total, "processes": procs})
        return {"devices": devices, "held_by_phase": held}
    except pynvml.NVMLError:
        return None


@contextlib.contextmanager
def holders() -> Iterator[Callable[[int], bool]]:
    """For the block, whether NVML lists a process on any device (always False without NVML), in one
    NVML session however often it is asked: a process that has exited holds its device memory
    until the driver has torn its context down."""
    listing = Listing()
    try:
        yield listing
    finally:
        listing.close()


class Listing:
    """``holders``' question with NVML opened here, till ``close``: nvmlInit took 0.3-0.6 s of a
    switch on an H100's host, so a phase waiting under a budget opens it before its go."""

    def __init__(self):
        self._nvml = None
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            return
        self._nvml = pynvml

    def __call__(self, pid: int) -> bool:
        found = None if self._nvml is None else _snapshot(self._nvml, None)
        return found is not None and any(p["pid"] == pid for d in found["devices"] for p in d["processes"])

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None
