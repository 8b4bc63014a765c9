"""What this machine offers a phase's processes, told without torch (the orchestrator never imports
it): whether the phases will see a GPU, and the memory of one, for ``orchestrator plan``.

The worker trains on CUDA where DeepSpeed picks it (``deepspeed.accelerator``): ``DS_ACCELERATOR``
when set, else CUDA where torch sees a device. The orchestrator reads the same variable, then
the devices NVML lists (``nvidia-ml-py``, the ``gpu`` extra, with their memory), else the NVIDIA
driver's list of GPUs in /proc.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from launch.contract import devmem

DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True)
class Machine:
    gpus: int
    memory: int | None
    """Bytes of the smallest GPU, where NVML tells; None: not known."""
    told_by: str
    """How it is known, in words for plan's line (``DS_ACCELERATOR=cpu``, ``NVML``, ...)."""


def this_machine(environ: Mapping[str, str] = os.environ) -> Machine:
    accelerator = environ.get("DS_ACCELERATOR")
    if accelerator is not None and accelerator != "cuda":
        return Machine(0, None, f"DS_ACCELERATOR={accelerator}")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return Machine(0, None, f"CUDA_VISIBLE_DEVICES={visible!r}")
    nvml = devmem.snapshot()
    if nvml is not None:
        sizes = [d["total"] for d in nvml["devices"]]
        return Machine(len(sizes), min(sizes, default=None), "NVML")
    count = len(list(DRIVER_GPUS.iterdir())) if DRIVER_GPUS.is_dir() else 0
    return Machine(count, None, str(DRIVER_GPUS) if count else "no NVIDIA driver")
