"""Host memory pinned ahead for DeepSpeed's offloaded optimizer (``offload_optimizer`` with
``pin_memory``, relayer's default there): the engine's pinned host buffers drawn from one block
that a pre-warmed phase pinned while it waited, instead of pinned at its go.

At ZeRO 1 and 2 with the optimizer on the host, DeepSpeed pins, as the engine is built, per param
group the fp32 partition of the masters, a 16-bit copy of it, the fp32 gradient partition, and
one buffer of the largest parameter's gradient (``stage_1_and_2.py``; with gradient accumulation
also a 16-bit buffer per parameter): at 7B under a budget of 24 GiB on an H100, 13 pinnings took
4.2 s of a switch's 8.4 s (benchmarks/results/2026-12-06-issue42-h100-7b, the switch's profile).
Pinning is the slow part (the driver locks every page); copying into memory pinned already is a
memcpy. So a phase that waits pre-warmed pins one block of about those bytes (``Arena``,
``ZeroBackend.host_buffers``) beside its predecessor's training, and its engine build takes each
buffer out of it (``serving``: DeepSpeed's accelerator's ``pin_memory``, replaced for the build);
where the block runs out, a buffer is pinned as before. On a CPU nothing is pinned: the block is
plain host memory, the same path.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

ALIGN = 4096
"""Each buffer starts at a multiple of this many bytes of the block (a page)."""


class Arena:
    """One block of host memory, pinned on a GPU, handed out front to back."""

    def __init__(self, nbytes: int, pin: bool):
        self.block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.used = 0
        self.served = 0
        self.missed = 0
        """Buffers taken from the block, and those it had no room for (pinned as before)."""

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The next ``shape`` of ``dtype`` in the block; None where it has no room left."""
        start = -(-self.used // ALIGN) * ALIGN
        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        if start + size > self.block.numel():
            self.missed += 1
            return None
        self.used, self.served = start + size, self.served + 1
        return self.block[start:start + size].view(dtype).view(shape)

    def summary(self) -> dict[str, int]:
        return {"bytes": self.block.numel(), "used": self.used, "served": self.served, "missed": self.missed}


@contextlib.contextmanager
def serving(arena: Arena | None) -> Iterator[None]:
    """Within the block, DeepSpeed's pinned host buffers (its accelerator's ``pin_memory``: a pinned
    copy of a tensor, or with ``make_copy=False`` a pinned tensor of its shape) come from ``arena``
    (nothing changes where it is None). On a CPU DeepSpeed pins nothing and hands the tensor itself
    back; from the arena it gets a copy in the block, as on a GPU."""
    if arena is None:
        yield
        return
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    before = accel.pin_memory

    def pin_memory(tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        shape = tuple(tensor.shape) if match_shape else (tensor.numel(),)
        out = arena.take(tensor.dtype, shape)
        if out is None:
            return before(tensor, make_copy=make_copy, match_shape=match_shape)
        return out.copy_(tensor.reshape(shape)) if make_copy else out

    accel.pin_memory = pin_memory
    try:
        yield
    finally:  # the instance's own attribute goes: its class's method again
        del accel.pin_memory
