"""Does a process that exits with pinned host memory and a CUDA context slow another process's
CUDA calls on the same GPU? (#42: a successor builds its engine while its predecessor exits, and
calls that take milliseconds alone, ``torch.cuda.empty_cache`` among them, took 0.1-0.3 s each in
the switch's profile.)

One process, B, times a loop of what an engine build does on the device (an allocation of 256 MiB,
a copy into it, its release and ``empty_cache``, a small pinned copy), while another, A, pins
``--pinned`` GiB of host memory, holds ``--device`` GiB on the GPU and exits: B's loop before A's
exit, during its teardown (from A's last line to A reaped) and after. Trials: A exits holding its
pinned memory, A frees it first (to see which part of its exit is the slow one), A exits holding it
again, and A with nothing pinned.

    python benchmarks/teardown_probe.py --pinned 7 --device 3 --out teardown.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

HOLDER = r"""
import sys, time, torch
pinned_gib, device_gib, free_first = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
torch.cuda.init()
x = torch.empty(int(device_gib * 2**30), dtype=torch.uint8, device="cuda")
p = torch.empty(int(pinned_gib * 2**30), dtype=torch.uint8, pin_memory=True)
p[::4096] = 1
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
if free_first:
    del p
    torch.cuda.synchronize()
print(f"exiting {time.monotonic() - t0:.3f}", flush=True)
"""


def loop_once(torch) -> float:
    t0 = time.perf_counter()
    a = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    a.fill_(1)
    h = torch.empty(16 * 2**20, dtype=torch.uint8).pin_memory()
    a[: h.numel()].copy_(h, non_blocking=True)
    torch.cuda.synchronize()
    del a, h
    torch.cuda.empty_cache()
    return time.perf_counter() - t0


def trial(torch, pinned: float, device: float, free_first: bool) -> dict:
    a = subprocess.Popen([sys.executable, "-c", HOLDER, str(pinned), str(device), "1" if free_first else "0"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert a.stdout.readline().strip() == "ready"
    before = [loop_once(torch) for _ in range(20)]
    t0 = time.monotonic()
    a.stdin.write("go\n")
    a.stdin.flush()
    during = []
    while a.poll() is None:
        during.append(loop_once(torch))
    reaped = time.monotonic() - t0
    said = a.stdout.read().strip()
    after = [loop_once(torch) for _ in range(20)]
    med = lambda xs: round(statistics.median(xs), 4) if xs else None
    return {"pinned_gib": pinned, "device_gib": device, "free_first": free_first, "a_said": said,
            "a_exit_to_reaped_s": round(reaped, 3), "loops_during": len(during),
            "loop_median_s": {"before": med(before), "during": med(during), "after": med(after)},
            "loop_max_during_s": round(max(during), 4) if during else None, "loop_sum_during_s": round(sum(during), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pinned", type=float, default=7.0)
    ap.add_argument("--device", type=float, default=3.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch

    torch.cuda.init()
    for _ in range(5):
        loop_once(torch)
    rows = [trial(torch, args.pinned, args.device, ff) for ff in (False, True, False)]
    rows.append(trial(torch, 0.0, args.device, False))
    text = json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "trials": rows}, indent=1)
    print(text)
    if args.out:
        open(args.out, "w").write(text)


if __name__ == "__main__":
    main()
