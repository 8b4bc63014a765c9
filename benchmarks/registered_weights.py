"""Can a phase's host weights be registered (pinned in place) for a fast upload, and unregistered
while it trains without slowing its steps? Measured on a GPU.

    python benchmarks/registered_weights.py --out DIR          # on a CUDA machine; ~1 min

A pre-warmed phase holds the 1.1B model's bf16 weights (2.2 GB) in pageable host memory and puts
them on the device at its go, through a ring of pinned slots: 0.14-0.33 s on the H200, bound by
the copy into the slots. Registered memory (``cudaHostRegister``) is copied by DMA alone. But
pinned pages cost about as much to unpin, at the latest at the process's exit, which is on the
next switch's critical path; so here they are unregistered in a thread while the process runs
steps of GPU work (bf16 matmuls sized to ~0.08 s a step), and the steps are timed.

Per way, in a fresh child process: register (s), upload (s), unregister (s), and the step times
before, during and after the unregistering; also the ring's upload for comparison.

Writes registered_weights.json and registered_weights.md into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from _report import write_report

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import ctypes, json, sys, threading, time
import torch
sys.path.insert(0, sys.argv[2])
cfg = json.loads(sys.argv[1])
from launch.staging import Staging
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
n = 2_200_000_000
host = torch.empty(n // 2, dtype=torch.bfloat16)
host.view(torch.uint8)[::4096].fill_(1)  # pages of its own
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
out = {}

def step():
    t = time.perf_counter()
    for _ in range(50):
        a @ a
    torch.cuda.synchronize()
    return time.perf_counter() - t

for _ in range(3):
    step()
if cfg["way"] == "ring":
    staging = Staging(dev)
    t = time.perf_counter(); d = staging.to_device(host); torch.cuda.synchronize(); out["upload"] = time.perf_counter() - t
    out["steps"] = [step() for _ in range(12)]
else:
    cudart = torch.cuda.cudart()
    t = time.perf_counter(); rc = cudart.cudaHostRegister(host.data_ptr(), host.nbytes, 0); out["register"] = time.perf_counter() - t
    out["register_rc"] = int(rc)
    t = time.perf_counter(); d = torch.empty_like(host, device=dev); d.copy_(host, non_blocking=True); torch.cuda.synchronize()
    out["upload"] = time.perf_counter() - t
    marks = {}
    def unregister():
        marks["t0"] = time.perf_counter()
        if cfg["way"] == "ctypes":
            lib = ctypes.CDLL(cfg["cudart"])
            marks["rc"] = lib.cudaHostUnregister(ctypes.c_void_p(host.data_ptr()))
        else:
            marks["rc"] = int(cudart.cudaHostUnregister(host.data_ptr()))
        marks["t1"] = time.perf_counter()
    steps, th = [], None
    for i in range(12):
        if i == 3:
            th = threading.Thread(target=unregister); th.start()
        t0 = time.perf_counter()
        steps.append(step())
        steps[-1] = (t0, steps[-1])
    th.join()
    out["unregister"] = marks["t1"] - marks["t0"]
    out["unregister_rc"] = marks["rc"]
    out["steps"] = [s for _, s in steps]
    out["steps_during"] = [s for t0, s in steps if t0 + s > marks["t0"] and t0 < marks["t1"]]
print(json.dumps(out), flush=True)
"""


def cudart_path() -> str:
    for line in open("/proc/self/maps"):
        if "libcudart" in line:
            return line.split()[-1]
    return "libcudart.so"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    runs = []
    for way in ("ring", "torch", "ctypes", "torch"):
        r = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"way": way, "cudart": cudart_path()}), str(ROOT)],
                           capture_output=True, text=True)
        try:
            runs.append({"way": way, **json.loads(r.stdout.strip().splitlines()[-1])})
        except (json.JSONDecodeError, IndexError):
            runs.append({"way": way, "error": r.stderr[-2000:]})
    lines = ["| way | register s | upload s | unregister s (in a thread) | step s median | steps during unregister |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['way']} | error: {r['error'][-300:]!r} | | | | |")
            continue
        lines.append(f"| {r['way']} | {r.get('register', 0):.3f} | {r['upload']:.3f} | {r.get('unregister', 0):.3f} "
                     f"| {statistics.median(r['steps']):.3f} | {', '.join(f'{s:.3f}' for s in r.get('steps_during', []))} |")
    write_report(args.out, "registered_weights", runs, "2.2 GB of host weights: registered vs the ring", lines)


if __name__ == "__main__":
    main()
