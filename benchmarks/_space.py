"""Where a benchmark run's model and run directory go on a lent machine, and the settings that
let it fit: its disk (64 GB on the H200 machine), its host memory (128 GiB, /dev/shm in it) and
its device.

    python benchmarks/_space.py --shape 7b --phases 13 --layers lisa --disk /tmp/x --shm /dev/shm/x
    eval "$(python benchmarks/_space.py ... --shell)"   # MODEL_DIR, WORK_DIR, MICRO, DEPTH, FITS, WHY

What it counts, all from relayer's own plan formulas (``orchestrator.estimate``, no torch):
- the disk: a phase-end checkpoint holds the head's fp32 masters and Adam moments (12 bytes a
  parameter) and its layers' fp32 masters (4 bytes); retention (``orchestrator.retention``)
  keeps the newest ``keep_last`` checkpoints and every older one whose layers they still read,
  simulated here for the run's own layer order; one more checkpoint is in flight at a time (a
  finished phase writes while its successor's files are made); the final model, where written,
  is the weights once more;
- the host memory: /dev/shm's files (the model where it lives there, the run where it does), a
  few GB a process, and, for every phase pre-warmed to go *through the checkpoint* (the
  handover's overlap does not fit the device), its pinned copy of the weights
  (``launch.staging.register_module``); a phase pre-warmed to take over holds none;
- the device: the micro batch is the largest of the shape's, 2 and 1 whose phase fits the
  device and, where the run wants the handover, whose overlap peak fits too (the batch stays).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from orchestrator.estimate import PROCESS_BYTES, on_device, offered_bytes, overlap_peak, param_count, phase_memory  # noqa: E402

from _shapes import SHAPES, layer_walk  # noqa: E402

PROCESS_HOST_BYTES = 3_000_000_000
"""A phase process's own host memory besides the weights (torch and CUDA's host side, the pinned
ring, its data): a waiting phase held 1.6 GB (USS) on the H200, a training one more."""
RAM_SHARE = 0.85
"""The part of the available host memory a plan may use (the page cache and the kernel need the rest)."""
DISK_MARGIN = 2_000_000_000
DEVICE_SHARE = 0.9
"""The part of the device's memory a plan may fill: the overlap's formula matched NVML within 1% at
7B, but a 13B or 30B run has not checked it yet, and a predecessor out of memory while it gathers
its offer fails the run (a successor out of memory only reads the checkpoint instead)."""
DEFAULT_DEPTH = 3


@dataclass(frozen=True)
class Sizes:
    weights: int
    head: int
    per_layer: int

    def checkpoint(self, layers: int) -> int:
        return self.head * 12 + layers * self.per_layer * 4

    def final_model(self) -> int:
        return self.weights


def sizes(model: dict, dtype_bytes: int = 2) -> Sizes:
    count = param_count(model)
    return Sizes(weights=count.total * dtype_bytes, head=sum(count.head.values()), per_layer=count.per_layer)


def retained_disk(phases: list[list[int]], size, keep_last: int = 2) -> int:
    """The most bytes a run's checkpoints hold at once: after each phase end, retention keeps the
    newest ``keep_last`` and every older one holding the newest copy of a layer they read; one
    more (the next phase's) may be in flight meanwhile. ``size(layers)``: one checkpoint's bytes."""
    present: list[int] = []
    peak = 0
    for j in range(len(phases)):
        in_flight = size(len(phases[j + 1])) if j + 1 < len(phases) else 0
        peak = max(peak, sum(size(len(phases[i])) for i in present) + size(len(phases[j])) + in_flight)
        present.append(j)
        kept = present[-keep_last:]
        newest: dict[int, int] = {}
        for i in present:
            if i <= kept[-1]:
                newest.update(dict.fromkeys(phases[i], i))
        needed = set(kept) | set(newest.values())
        present = [i for i in present if i in needed]
    return peak


def micro_batch(shape: dict, device_bytes: int, want_handover: bool, depth: int) -> tuple[int, bool]:
    """(the largest micro batch that fits, whether the handover's overlap fits with it)."""
    count = param_count(shape["model"])
    head = sum(count.head.values())
    trainable = head + 2 * count.per_layer
    choices = [m for m in (shape["micro_batch_size"], 2, 1) if m <= shape["micro_batch_size"]]
    fallback = None
    for mb in choices:
        # One copy of the model per GPU (launch.resident, relayer's default on a GPU): the holder's.
        mem = phase_memory(count, trainable, dtype="bfloat16", zero_stage=2, world=1, micro_batch=mb,
                           seq_len=shape["seq_len"], resident=True)
        held = count.total * 2 + PROCESS_BYTES
        overlap = held + overlap_peak(mem, mem, offered_bytes(count, head, 2), depth * PROCESS_BYTES)
        if want_handover and overlap <= device_bytes:
            return mb, True
        if fallback is None and held + on_device(mem) + depth * 2_600_000_000 <= device_bytes:
            fallback = mb
    return (fallback or 1), False


def host_need(s: Sizes, shm_bytes: int, depth: int, taking: bool, layers: int) -> int:
    """Host memory at a switch's peak: /dev/shm's files, the processes, the pre-warmed phases'
    copies of the weights (none where they take over; the starting phase's own until its first
    step), and the finished phase's end state gathered for its checkpoint."""
    copies = 0 if taking else (depth + 1) * s.weights if depth else 0
    return shm_bytes + PROCESS_HOST_BYTES * (depth + 2) + copies + s.checkpoint(layers)


@dataclass
class Plan:
    model_on: str
    work_on: str
    micro_batch: int
    prewarm_depth: int
    handover_fits: bool
    fits: bool
    why: str
    need_disk: int
    need_shm: int
    need_ram: int
    free_disk: int
    free_shm: int
    available_ram: int


def free_bytes(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free


def _placements(s: Sizes, run_disk: int, outputs: int) -> list[tuple[str, str, int, int]]:
    """(model on, work on, disk bytes, /dev/shm bytes), most on disk first."""
    w = s.weights
    return [("disk", "disk", w + max(run_disk, outputs), 0), ("shm", "disk", max(run_disk, outputs), w),
            ("shm", "shm", 0, w + max(run_disk, outputs))]


def plan(shape: dict, phases: list[list[int]], *, free_disk: int, free_shm: int, ram: int, device: int,
         final_model: bool, peer_output: bool, want_handover: bool, prewarm: bool, keep_last: int = 2,
         carried: int = 0) -> Plan:
    """The first placement (most on disk) that fits, with the deepest pre-warming (at most the
    default) whose host memory fits and the micro batch that fits the device with it. ``carried``:
    the run's phase ends write no checkpoint but this many (``checkpoint.every_seconds``), each
    holding every layer trained since the last (counted as every layer the run trains)."""
    s = sizes(shape["model"])
    trained = len({layer for p in phases for layer in p})
    checkpoints = carried * s.checkpoint(trained) + trained * s.per_layer * 4 if carried else \
        retained_disk(phases, s.checkpoint, keep_last)
    run_disk = checkpoints + (s.final_model() if final_model else 0)
    outputs = s.final_model() if peer_output else 0
    for model_on, work_on, disk, shm in _placements(s, run_disk, outputs):
        for d in range(DEFAULT_DEPTH if prewarm else 0, -1, -1):
            mb, taking = micro_batch(shape, int(device * DEVICE_SHARE), want_handover and d > 0, d)
            need_ram = host_need(s, shm, d, taking, 2)
            if need_ram <= ram * RAM_SHARE:
                break
        if disk + DISK_MARGIN <= free_disk and shm <= free_shm and need_ram <= ram * RAM_SHARE:
            why = f"model on {model_on}, run on {work_on}" + ("" if d == (DEFAULT_DEPTH if prewarm else 0) else
                                                             f"; prewarm_depth {d} (host memory)")
            return Plan(model_on, work_on, mb, d, taking, True, why, disk, shm, need_ram, free_disk, free_shm, ram)
    return Plan("shm", "shm", mb, 0, taking, False,
                f"does not fit: {disk / 1e9:.1f} GB of disk ({free_disk / 1e9:.1f} free), {shm / 1e9:.1f} GB of "
                f"/dev/shm ({free_shm / 1e9:.1f} free), {need_ram / 1e9:.1f} GB of host memory "
                f"({ram / 1e9:.1f} available)", disk, shm, need_ram, free_disk, free_shm, ram)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--phases", type=int, help="phases (default: the shape's)")
    ap.add_argument("--phase-layers", help="the phases' layers as JSON ([[0, 1], ...]), instead of --layers")
    ap.add_argument("--layers", choices=("walk", "lisa"), default="walk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disk", type=Path, required=True, help="a folder on the disk the run would use")
    ap.add_argument("--shm", type=Path, required=True, help="a folder in /dev/shm")
    ap.add_argument("--device-memory", type=int, required=True, help="bytes of the device (NVML's total)")
    ap.add_argument("--final-model", action="store_true", help="relayer writes RUN_DIR/final")
    ap.add_argument("--peer-output", action="store_true", help="the peer writes a model too (before relayer runs)")
    ap.add_argument("--handover", action="store_true", help="the run wants the device handover")
    ap.add_argument("--no-prewarm", action="store_true")
    ap.add_argument("--carried", type=int, default=0,
                    help="the run writes this many checkpoints, each of every layer (checkpoint.every_seconds); "
                         "0: one at every phase end")
    ap.add_argument("--shell", action="store_true", help="print shell assignments instead of JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    shape = SHAPES[args.shape]
    phases = (json.loads(args.phase_layers) if args.phase_layers else
              layer_walk(args.layers, args.phases or shape["phases"], shape["model"]["num_hidden_layers"], args.seed))
    p = plan(shape, phases, free_disk=free_bytes(args.disk), free_shm=free_bytes(args.shm),
             ram=psutil.virtual_memory().available, device=args.device_memory, final_model=args.final_model,
             peer_output=args.peer_output, want_handover=args.handover, prewarm=not args.no_prewarm,
             carried=args.carried)
    if args.shell:
        at = {"disk": args.disk, "shm": args.shm}
        print(f"MODEL_DIR={at[p.model_on]}/model-{args.shape} WORK_DIR={at[p.work_on]}/work MICRO={p.micro_batch} "
              f"DEPTH={p.prewarm_depth} FITS={int(p.fits)} HANDOVER_FITS={int(p.handover_fits)} WHY={json.dumps(p.why)}")
    else:
        print(json.dumps(asdict(p), indent=1))
    return 0 if p.fits else 1


if __name__ == "__main__":
    sys.exit(main())
