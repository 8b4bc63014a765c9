"""What a 7B LISA step with the optimizer's state on the host (ZeRO-2 + offload_optimizer) pays
outside the GPU's kernels, piece by piece (issue #42):

    python benchmarks/host_step.py                 # CUDA: ~1 min, ~25 GB of host memory
    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/host_step.py --numel 5e6   # the CPU parts, small

- torch's AdamW over the phase's fp32 partition on the host (0.67 B elements at 7B: the head and two
  layers), as DeepSpeed steps it with ``zero_force_ds_cpu_optimizer = false``: the default
  (for-each on the host: one op at a time) against ``fused=True``, at several thread counts;
- the gradients' copies between device and host that ZeRO-2's offload makes every micro-batch
  (bf16, 1.34 GB at 7B), into pageable and into pinned host memory, and what pinning costs.

Prints one JSON object (and writes it to --out where given).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SEVEN_B_TRAINED = 2 * 32000 * 4096 + 4096 + 2 * 202_383_360
"""The 7B LISA phase's trainable elements: embeddings, lm_head, final norm, two layers."""


def timed(fn, repeat: int) -> float:
    fn()  # the first pays the allocations and the state's creation
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeat


def adamw_seconds(numel: int, threads: list[int], repeat: int) -> dict:
    out = {}
    for fused in (None, True):
        p = torch.nn.Parameter(torch.zeros(numel))
        p.grad = torch.full((numel,), 1e-3)
        opt = torch.optim.AdamW([p], lr=1e-4, fused=fused)
        for n in threads:
            torch.set_num_threads(n)
            out[f"{'fused' if fused else 'default'}_threads{n}"] = timed(opt.step, repeat)
        del p, opt
    return out


def copy_seconds(numel: int, repeat: int) -> dict:
    grad = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
    out = {}
    t = time.perf_counter()
    pinned = torch.empty(numel, dtype=torch.bfloat16).pin_memory()
    out["pin_seconds"] = time.perf_counter() - t
    for name, host in (("pageable", torch.empty(numel, dtype=torch.bfloat16)), ("pinned", pinned)):
        out[f"d2h_{name}"] = timed(lambda: host.copy_(grad, non_blocking=True), repeat)
        out[f"h2d_{name}"] = timed(lambda: grad.copy_(host, non_blocking=True), repeat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=float, default=SEVEN_B_TRAINED)
    ap.add_argument("--threads", default="16,8,4")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    numel = int(args.numel)
    result = {"numel": numel, "torch": torch.__version__, "threads_at_start": torch.get_num_threads(),
              "adamw": adamw_seconds(numel, [int(n) for n in args.threads.split(",")], args.repeat)}
    if torch.cuda.is_available():
        result["copies"] = copy_seconds(numel, args.repeat)
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
