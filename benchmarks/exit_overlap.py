"""Can a finished phase's device teardown overlap its checkpoint's hash? Measured on a GPU.

    python benchmarks/exit_overlap.py --out DIR          # on a CUDA machine; ~1 min

A phase's end is: gather to the host, hash what is left to hash, commit, exit. The exit is mostly
the driver tearing the CUDA context down (0.13-0.15 s on an H200, ``exit_write.md``), and it
starts only once the hash is done. Here a child process holds what a phase holds (8 GB on the
device, an NCCL group of one, a 1.57 GB host buffer standing for the head file), stamps t0, and
then either

- ``sequential``: hashes the buffer on 16 threads, then ``os._exit`` (what relayer does), or
- ``reset``: starts the hash threads, ends the NCCL group, resets the device's primary context
  (``cuDevicePrimaryCtxReset``: every allocation freed), waits for the hash, ``os._exit``,

and the parent stamps the time ``waitpid`` returns. Reported: t0 -> hash done, t0 -> reaped, and
for ``reset`` the teardown's own time, plus whether the process exited cleanly (a crash of NCCL's
watchdog after the reset would show as a signal).

Writes exit_overlap.json and exit_overlap.md into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _report import write_report

CHILD = r"""
import ctypes, hashlib, json, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import torch
cfg = json.loads(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]), RANK="0", WORLD_SIZE="1")
torch.cuda.set_device(0)
torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", 0))
keep = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
torch.distributed.all_reduce(torch.ones(1024, device="cuda"))
host = bytearray(1_572_888_576)
for o in range(0, len(host), 4096):
    host[o] = 1
torch.cuda.synchronize()
view = memoryview(host)
out = {}
t0 = time.time()
pool = ThreadPoolExecutor(16)
jobs = [pool.submit(lambda o=o: hashlib.sha256(view[o:o + (64 << 20)]).digest()) for o in range(0, len(host), 64 << 20)]
if cfg["mode"] == "reset":
    t = time.time()
    torch.distributed.destroy_process_group()
    out["destroy_seconds"] = time.time() - t
    cuda = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    t = time.time()
    out["reset_rc"] = cuda.cuDevicePrimaryCtxReset(dev)
    out["reset_seconds"] = time.time() - t
[j.result() for j in jobs]
out["hash_done"] = time.time() - t0
out["t0"] = t0
out["t_exit"] = time.time()
os.write(1, (json.dumps(out) + "\n").encode())
os._exit(0)
"""


def run(mode: str, repeat: int) -> list[dict]:
    runs = []
    for i in range(repeat):
        proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps({"mode": mode, "port": 29700 + i})],
                                stdout=subprocess.PIPE)
        line = proc.stdout.readline()
        rc = proc.wait()
        t_reaped = time.time()
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            runs.append({"mode": mode, "rc": rc, "error": line.decode(errors="replace")})
            continue
        t0 = rec.pop("t0")
        runs.append({"mode": mode, "rc": rc, "end_seconds": t_reaped - t0, "exit_seconds": t_reaped - rec.pop("t_exit"),
                     **rec})
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    runs = [r for mode in ("sequential", "reset") for r in run(mode, args.repeat)]
    lines = ["| mode | rc | t0 -> reaped (median) | runs: t0 -> reaped / hash done / exit / reset / destroy |",
             "| --- | --- | ---: | --- |"]
    for mode in ("sequential", "reset"):
        rs = [r for r in runs if r["mode"] == mode and "end_seconds" in r]
        cells = ", ".join(f"{r['end_seconds']:.3f} / {r['hash_done']:.3f} / {r['exit_seconds']:.3f} / "
                          f"{r.get('reset_seconds', 0):.3f} / {r.get('destroy_seconds', 0):.3f}" for r in rs)
        med = f"{statistics.median(r['end_seconds'] for r in rs):.3f}" if rs else "-"
        lines.append(f"| {mode} | {sorted({r['rc'] for r in runs if r['mode'] == mode})} | {med} | {cells} |")
    write_report(args.out, "exit_overlap", runs, "Device teardown overlapping the hash", lines)


if __name__ == "__main__":
    main()
