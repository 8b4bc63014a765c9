"""What the end of a phase costs on a GPU, piece by piece: the process's exit, and writing the head.

    python benchmarks/exit_write.py --out DIR          # on a CUDA machine; ~1 min

A finished phase's processes must be gone before the next phase may touch the device, so both
sit on the switch's critical path. Measured here in isolation, with the 1.1B model's head size
(1.57 GB of fp32 master + Adam moments):

- exit: a child process builds some state (CUDA context, device memory, pinned host memory, an
  NCCL group), then stamps the time and calls ``os._exit``; the time until ``waitpid`` returns
  it is the exit cost. Variants free the pinned memory first, timing that too.
- write: the head's bytes from pinned host memory, or straight from the device, into a new file
  under --dir (the run directory's file system) and under /dev/shm, by the ways relayer could:
  threads doing ``pwrite`` (what ``shard_tools.digest`` does), threads copying into an ``mmap``
  of the file, with the sha256 chunk digests computed alongside.

Writes exit_write.json and exit_write.md into --out.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from shard_tools import digest  # noqa: E402
HEAD_BYTES = 131_074_048 * 12  # embed + lm_head + norm of TinyLlama-1.1B: fp32 master, exp_avg, exp_avg_sq

CHILD = r"""
import os, sys, time, json
import torch
cfg = json.loads(sys.argv[1])
out = {}
torch.cuda.init(); torch.empty(1, device="cuda")
keep = []
if cfg.get("device_gb"):
    keep.append(torch.empty(int(cfg["device_gb"] * 2**30), dtype=torch.uint8, device="cuda"))
if cfg.get("nccl"):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]), RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", 0))
    torch.distributed.all_reduce(torch.ones(1024, device="cuda"))
pinned = []
if cfg.get("pinned_gb"):
    for _ in range(int(cfg["pinned_gb"] * 4)):
        pinned.append(torch.empty(2**28, dtype=torch.uint8, pin_memory=True))
    for p in pinned:
        p.fill_(1)
torch.cuda.synchronize()
if cfg.get("free_pinned"):
    t0 = time.perf_counter()
    pinned.clear()
    torch._C._host_emptyCache()
    out["free_pinned_seconds"] = time.perf_counter() - t0
out["t_exit"] = time.time()
os.write(1, (json.dumps(out) + "\n").encode())
os._exit(0)
"""


def exit_cost(cfg: dict, repeat: int) -> dict:
    runs = []
    for i in range(repeat):
        cfg = {**cfg, "port": 29600 + i}
        proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)], stdout=subprocess.PIPE)
        line = proc.stdout.readline()
        proc.wait()
        t_reaped = time.time()
        rec = json.loads(line)
        runs.append({"exit_seconds": t_reaped - rec.pop("t_exit"), **rec})
    return {"config": cfg, "runs": runs,
            "exit_seconds_median": statistics.median(r["exit_seconds"] for r in runs)}


def write_ways(directory: Path, torch, repeat: int) -> list[dict]:
    n = HEAD_BYTES
    dev = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    out = []

    def timed(name, fn):
        for r in range(repeat):
            path = directory / f"w-{name}-{r}"
            t0 = time.perf_counter()
            try:
                extra = fn(path) or {}
            except Exception as e:  # one way failing must not lose the others
                extra = {"error": repr(e)}
            out.append({"way": name, "dir": str(directory), "seconds": time.perf_counter() - t0, **extra})
            path.unlink(missing_ok=True)

    def d2h_pinned(_):
        pinned.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()

    def d2h_pageable(_):
        pageable.copy_(dev)
        torch.cuda.synchronize()

    def pwrite_threads(path):
        with ThreadPoolExecutor(digest.THREADS) as pool:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            digest.write_and_digest(fd, [memoryview(pinned.numpy())], pool)
            os.close(fd)

    def mmap_threads(path, source=None):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n)
        os.close(fd)
        dst = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        src = (source if source is not None else pinned).data_ptr()
        t0 = time.perf_counter()

        def piece(o):
            length = min(digest.CHUNK, n - o)
            ctypes.memmove(dst + o, src + o, length)
            return hashlib.sha256(memoryview(mm)[o:o + length]).digest()

        with ThreadPoolExecutor(digest.THREADS) as pool:
            digest._combine(list(pool.map(piece, range(0, n, digest.CHUNK))))
        t1 = time.perf_counter()
        mm.close()
        return {"copy_hash_seconds": t1 - t0}

    def d2h_into_mmap(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n)
        os.close(fd)
        t0 = time.perf_counter()
        torch.frombuffer(mm, dtype=torch.uint8).copy_(dev)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        with ThreadPoolExecutor(digest.THREADS) as pool:
            digest.digest_buffer(memoryview(mm), pool)
        t2 = time.perf_counter()
        mm.close()
        return {"d2h_seconds": t1 - t0, "hash_seconds": t2 - t1}

    timed("d2h_pinned", d2h_pinned)
    timed("d2h_pageable", d2h_pageable)
    timed("pwrite_threads", pwrite_threads)
    timed("mmap_threads", mmap_threads)
    timed("d2h_into_mmap", d2h_into_mmap)
    t0 = time.perf_counter()
    del pinned
    torch._C._host_emptyCache()
    out.append({"way": "free_pinned_1.57GB", "dir": "-", "seconds": time.perf_counter() - t0})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    exits = {name: exit_cost(cfg, args.repeat) for name, cfg in {
        "context": {},
        "device 8 GB": {"device_gb": 8},
        "device 8 GB + NCCL": {"device_gb": 8, "nccl": True},
        "pinned 4 GB": {"pinned_gb": 4},
        "pinned 4 GB, freed first": {"pinned_gb": 4, "free_pinned": True},
        "device 8 GB + NCCL + pinned 4 GB": {"device_gb": 8, "nccl": True, "pinned_gb": 4},
    }.items()}
    writes = []
    for d in (args.dir, Path("/dev/shm")):
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            writes += write_ways(Path(tmp), torch, args.repeat)
    df = subprocess.run(["df", "-hT", str(args.dir), "/dev/shm"], capture_output=True, text=True).stdout
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(), "head_bytes": HEAD_BYTES, "exit": exits, "write": writes,
              "df": df}
    (args.out / "exit_write.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Phase-end costs on {result['device']} ({result['date']}, torch {torch.__version__})", "",
             "| process state at exit | exit seconds (median) | runs |", "| --- | ---: | --- |"]
    for name, e in exits.items():
        lines.append(f"| {name} | {e['exit_seconds_median']:.3f} | "
                     + ", ".join(f"{r['exit_seconds']:.3f}" + (f" (free {r['free_pinned_seconds']:.3f})"
                                                                if "free_pinned_seconds" in r else "")
                                 for r in e["runs"]) + " |")
    lines += ["", f"Writing {HEAD_BYTES / 1e9:.2f} GB:", "", "| way | dir | seconds (median) |", "| --- | --- | ---: |"]
    seen = {}
    for w in writes:
        seen.setdefault((w["way"], w["dir"]), []).append(w["seconds"])
    for (way, d), secs in seen.items():
        lines.append(f"| {way} | {d} | {statistics.median(secs):.3f} |")
    lines += ["", "```", df, "```"]
    (args.out / "exit_write.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
