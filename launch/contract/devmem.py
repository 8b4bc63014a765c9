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
    try:
        import pynvml
    except ImportError:
        yield None
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        yield None
        return
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


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
    with session() as pynvml:
        yield _holds(pynvml)


def listing() -> Callable[[int], bool]:
    """``holders``' question for the rest of the process, NVML initialised once and left so (the
    process exits soon after its last question): nvmlInit took about 0.5 s on an H100's host, and a
    successor under a budget starts it while it builds its engine (``launch.handover``)."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except ImportError:
        return _holds(None)
    except pynvml.NVMLError:
        return _holds(None)
    return _holds(pynvml)


def _holds(pynvml) -> Callable[[int], bool]:
    def holds(pid: int) -> bool:
        found = None if pynvml is None else _snapshot(pynvml, None)
        return found is not None and any(p["pid"] == pid for d in found["devices"] for p in d["processes"])

    return holds
