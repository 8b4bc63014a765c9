"""One AdamW step of one parameter in one pass over its memory, for ``launch.master_adamw`` on CUDA:
the gradient read as it is (bf16 from autograd, or fp32 from the optimizer's buffer) and divided by
the clip factor (read from the device: no synchronisation), the fp32 master and both moments
updated in place, and the low-precision weight the forward pass uses written from the new master.

Torch's fused AdamW does the same arithmetic (``aten/src/ATen/native/cuda/fused_adam_utils.cuh``,
ADAMW mode) but over fp32 gradients and without the low-precision copy: it needs the gradients
cast into an fp32 buffer before (6 bytes a parameter read and written) and the masters copied
into the weights after (6 more), 40 bytes a trainable parameter a step where this kernel moves 28.
With torch's fused AdamW, a 7B LISA step spent 12.7 ms of device time beyond forward and backward
on an H100, the Hugging Face Trainer's bf16 step 6.1 ms (``benchmarks/results/2026-12-05-stage0-h100``);
this kernel's own time there is not measured yet. Written in Triton, which torch's CUDA builds
bring; where it is missing or fails its check (``works``), ``MasterAdamW`` steps with torch's.
"""

from __future__ import annotations

import functools
import math
import os
import sys

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch: no Triton
    triton = None

BLOCK = 4096


def available(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``: CUDA with Triton (or Triton's interpreter, for its tests)."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:
    @triton.jit
    def _step(grad, master, exp_avg, exp_avg_sq, weight, scale, n, lr, beta1, beta2, eps, decay, step_size,
              bias2_sqrt, WRITE_WEIGHT: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n
        g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32) / tl.load(scale)
        w = tl.load(master + offsets, mask=mask, other=0.0)
        m = tl.load(exp_avg + offsets, mask=mask, other=0.0)
        v = tl.load(exp_avg_sq + offsets, mask=mask, other=0.0)
        w = w - lr * decay * w
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        w = w - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
        tl.store(master + offsets, w, mask=mask)
        tl.store(exp_avg + offsets, m, mask=mask)
        tl.store(exp_avg_sq + offsets, v, mask=mask)
        if WRITE_WEIGHT:  # bf16, rounded to nearest even as torch's .to rounds (bit by bit: any Triton)
            bits = w.to(tl.uint32, bitcast=True)
            half = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
            half = tl.where(w != w, 0x7FC0, half)  # NaN stays NaN
            tl.store(weight + offsets, half.to(tl.bfloat16, bitcast=True), mask=mask)


def adamw_step(grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               weight: torch.Tensor | None, scale: torch.Tensor, *, step: int, lr: float, betas: tuple[float, float],
               eps: float, weight_decay: float) -> None:
    """AdamW's ``step``-th update of one parameter (every tensor contiguous, of ``master``'s numel):
    ``grad / scale`` (``scale`` a one-element fp32 tensor on the device), the fp32 ``master`` and
    moments in place, and ``weight`` (bf16; None: ``master`` is the weight) = the new master, rounded."""
    n = master.numel()
    beta1, beta2 = betas
    _step[(triton.cdiv(n, BLOCK),)](
        grad, master, exp_avg, exp_avg_sq, weight if weight is not None else master, scale, n, lr, beta1, beta2, eps,
        weight_decay, lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step),
        WRITE_WEIGHT=weight is not None, BLOCK_SIZE=BLOCK)


def works(device: torch.device, weight_dtype: torch.dtype, grad_dtype: torch.dtype) -> bool:
    """Whether the kernel runs here, for these dtypes, and steps as AdamW does: one step of a
    known block, checked against the formula on the host (the first call on a machine compiles it,
    seconds; Triton caches it on disk). False, saying why on stderr, where Triton is missing, fails
    or computes otherwise: ``MasterAdamW`` then steps with torch's fused AdamW. Checked once a
    process: the warm-up's (or a cold phase's compile ahead) answers the engine build at the go,
    which then neither launches nor waits for the device."""
    return available(device) and _checked(str(indexed(device)), weight_dtype, grad_dtype)


def indexed(device: torch.device) -> torch.device:
    """``device`` with its index: "cuda" alone is the current device (``torch.cuda.set_device``
    refuses a CUDA device without one)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@functools.cache
def _checked(device_name: str, weight_dtype: torch.dtype, grad_dtype: torch.dtype) -> bool:
    device = torch.device(device_name)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # per thread
        n = BLOCK + 3  # two blocks, the second masked
        master, exp_avg, exp_avg_sq = (torch.full((n,), v, device=device) for v in (1.0, 0.0, 0.0))
        weight = None if weight_dtype == torch.float32 else torch.zeros(n, dtype=weight_dtype, device=device)
        adamw_step(torch.full((n,), 2.0, dtype=grad_dtype, device=device), master, exp_avg, exp_avg_sq, weight,
                   torch.full((), 2.0, device=device), step=1, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.5)
        # grad 2 / scale 2 = 1; decay: 1 - 0.1 * 0.5 = 0.95; m = 0.1, v = 0.001; the update is lr * 1 / (1 + eps).
        want = 0.95 - 0.1 / (1.0 + 1e-8)
        ok = bool(torch.allclose(master, torch.full_like(master, want), rtol=1e-6, atol=0)) and (
            weight is None or torch.equal(weight, master.to(weight_dtype)))
        if not ok:
            print(f"relayer: the AdamW kernel stepped otherwise than AdamW on {device}; torch's AdamW steps instead",
                  file=sys.stderr, flush=True)
        return ok
    except Exception as e:  # noqa: BLE001 - any failure of Triton here: the optimizer steps without it
        print(f"relayer: the AdamW kernel does not run on {device} ({type(e).__name__}: {e}); torch's AdamW steps "
              "instead", file=sys.stderr, flush=True)
        return False


def compile_ahead(device: torch.device, weight_dtype: torch.dtype, grad_dtype: torch.dtype) -> None:
    """Compiles and checks the kernel for these dtypes now (``works``), so that the engine build
    does not. Called in a thread by a phase started cold; a pre-warmed one's warm-up builds a
    ``MasterAdamW``, which checks it."""
    works(device, weight_dtype, grad_dtype)
