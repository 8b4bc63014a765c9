"""``shard-tools inspect``: what a run or one checkpoint holds.

Reads only the manifests and the safetensors headers, never torch, so it answers at once however
big the run; a run's phases, as its journal records them, come from the control plane
(``orchestrator report --json``, see ``run_history``):

    shard-tools inspect runs/tiny            # phase table
    shard-tools inspect runs/tiny/checkpoints/step-00000030 --json
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shard_tools.files import describe, open_regular, regular_fault
from shard_tools.sizes import format_bytes
from shard_tools.manifest import (
    JOURNAL, CheckpointError, InputError, list_checkpoints, path_kind, read_manifest, step_of, stray_temporaries,
    verify_checkpoint,
)

# File name -> tensor group, in display order (names as shard_tools.checkpoint writes them).
GROUPS = {"head.safetensors": "head", "layers.safetensors": "body", "body_optim.safetensors": "body_optim",
          "state.safetensors": "state"}
_MAX_HEADER = 100 << 20  # the safetensors library refuses larger headers too
# The replay reads the journal once; even a run of 100,000 phases takes seconds, never minutes.
REPLAY_TIMEOUT = 300


def tensor_headers(path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """({tensor name: {dtype, shape, data_offsets}}, metadata) of a safetensors file, without torch.

    Checked as the safetensors library checks before it reads: a known dtype, each tensor's byte
    span equal to its shape times its dtype's size, the spans tiling the data exactly, the data
    ending where the file does. A symbolic link is followed (a hub cache's snapshot is links); a
    FIFO or a directory is refused, never waited on. CheckpointError naming the file otherwise.
    """
    try:
        fd = open_regular(path)
    except OSError as e:
        raise CheckpointError(f"{path}: {describe(e)}") from None
    try:
        return read_header(fd, path)
    finally:
        os.close(fd)


def read_header(fd: int, path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """``tensor_headers`` of a file already open (``path`` names it in messages)."""
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise CheckpointError(f"{path}: not a readable safetensors file ({size} bytes, less than its header length)")
        length = int.from_bytes(os.pread(fd, 8, 0), "little")
        if length > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{path}: not a readable safetensors file (a header of {length} bytes "
                                  f"announced, {size - 8} present)")
        raw = os.pread(fd, length, 8)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # ValueError: not JSON, or not UTF-8
        raise CheckpointError(f"{path}: not a readable safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: its __metadata__ is not an object of strings")
    data = size - 8 - length
    offset = 0
    for name, entry in sorted(header.items(), key=lambda item: _start(item[1])):
        fault = _entry_fault(entry)
        if fault:
            raise CheckpointError(f"{path}: tensor {name!r}: {fault}")
        start, end = entry["data_offsets"]
        if start != offset:
            raise CheckpointError(f"{path}: tensor {name!r} starts at data byte {start}, the tensor before it "
                                  f"ends at {offset} (a gap or an overlap)")
        if end > data:
            raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {8 + length + end}, "
                                  f"the file has {size}")
        offset = end
    if offset != data:
        raise CheckpointError(f"{path}: {data - offset} bytes after the last tensor's data")
    return header, metadata


# Bits per element of every dtype the safetensors format names.
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E5M2FNUZ": 8, "F8_E4M3FNUZ": 8,
              "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def _start(entry: Any) -> int:
    """Sort key: a malformed entry first, so that it is the one reported."""
    try:
        start = entry["data_offsets"][0]
        return start if isinstance(start, int) else -1
    except (TypeError, KeyError, IndexError):
        return -1


def _entry_fault(entry: Any) -> str | None:
    if not (isinstance(entry, dict) and entry.keys() == {"dtype", "shape", "data_offsets"}):
        return "its header entry is not {dtype, shape, data_offsets}"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        return f"unknown dtype {dtype!r}"
    if not (isinstance(shape, list) and all(_natural(d) for d in shape)):
        return f"shape {shape!r} is not a list of integers >= 0"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        return f"data_offsets {offsets!r} are not [start, end] with 0 <= start <= end"
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        return (f"shape {shape} of {dtype} is {bits / 8:g} bytes, its data_offsets span "
                f"{offsets[1] - offsets[0]}")
    return None


def _natural(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def inspect_checkpoint(ckpt: Path) -> dict[str, Any]:
    manifest = read_manifest(ckpt)
    order = list(GROUPS)
    files = sorted(manifest.files, key=lambda f: (order.index(f) if f in order else len(order), f))
    tensors, metadata = [], {}
    for file in files:
        if fault := regular_fault(ckpt / file, follow_symlinks=False):
            raise CheckpointError(f"{ckpt / file}: {fault}")
        header, metadata[file] = tensor_headers(ckpt / file)
        for name, entry in sorted(header.items()):
            start, end = entry["data_offsets"]
            tensors.append({"name": name, "file": file, "group": GROUPS.get(file, file), "shape": entry["shape"],
                            "dtype": entry["dtype"], "bytes": end - start})
    return {"kind": "checkpoint", "path": str(ckpt), **asdict(manifest),
            "bytes": sum(e.size for e in manifest.files.values()), "metadata": metadata, "tensors": tensors}


def _checkpoint_summary(ckpt: Path) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": ckpt.name, "step": step_of(ckpt)}
    faults = verify_checkpoint(ckpt, checksums=False)
    try:
        m = read_manifest(ckpt)
    except CheckpointError:
        return {**entry, "phase": None, "layers": [], "complete": False, "bytes": None, "faults": faults}
    return {**entry, "phase": m.phase, "layers": m.layers, "phase_complete": m.phase_complete,
            "complete": not faults, "bytes": sum(e.size for e in m.files.values()), "faults": faults}


def _number(v: Any) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _records(v: Any) -> dict[str, float]:
    """A phase's numeric records; anything else in them is not shown."""
    return {k: x for k, x in v.items() if _number(x) is not None} if isinstance(v, dict) else {}


def _phase_row(index: int, **known: Any) -> dict[str, Any]:
    return {"index": index, "start_step": None, "end_step": None, "layers": None, "nproc": None,
            "status": "started", "attempts": 0, "seconds": None, "switch_seconds": None, "records": {},
            "resumed": False, **known}


def run_history(run_dir: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The run's phases as the control plane replays its journal (``orchestrator report --json``,
    in a process of its own: this package reads no control-plane events and imports nothing of the
    orchestrator), and warnings; (None, []) for a run without a journal.

    Without the orchestrator installed, (None, [why]): the checkpoints still tell their phases.
    """
    journal = Path(run_dir) / JOURNAL
    if not journal.exists():
        return None, []
    if importlib.util.find_spec("orchestrator") is None:
        return None, [f"{journal}: not read: the phases' history needs relayer's orchestrator, which is not "
                      f"installed here; showing what the checkpoints say"]
    cmd = [sys.executable, "-m", "orchestrator", "report", "--json", "--", str(run_dir)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=REPLAY_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"{journal}: not replayed within {REPLAY_TIMEOUT} s") from None
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines() or [f"exit code {r.returncode}"]
        message = lines[-1].removeprefix("orchestrator: ")
        raise (InputError if r.returncode == 2 else CheckpointError)(message)
    try:
        return json.loads(r.stdout), []
    except ValueError:
        raise CheckpointError(f"{journal}: the orchestrator's replay of it is not JSON: {r.stdout[:100]!r}") from None


def inspect_run(run_dir: Path) -> dict[str, Any]:
    history, warnings = run_history(run_dir)
    phases = {p["index"]: {**p, "records": _records(p["records"])} for p in (history or {}).get("phases", [])}
    checkpoints = [_checkpoint_summary(c) for c in list_checkpoints(run_dir)]
    for c in checkpoints:
        if c["phase"] is not None and c["phase"] not in phases:
            # Journal lost or cut short: the manifests still say which phase wrote what.
            phases[c["phase"]] = _phase_row(c["phase"], end_step=c["step"], layers=c["layers"], status="unknown")
    ordered = [phases[i] for i in sorted(phases)]
    for p in ordered:
        p["checkpoints"] = [c for c in checkpoints if c["phase"] == p["index"]]
    return {"kind": "run", "path": str(run_dir), "events": history["events"] if history else 0,
            "last_event": history["last_event"] if history else None, "phases": ordered,
            "checkpoints": checkpoints, "stray_temporaries": [str(p) for p in stray_temporaries(run_dir)],
            "warnings": warnings}


def inspect_path(path: Path) -> dict[str, Any]:
    path = Path(path)
    return inspect_checkpoint(path) if path_kind(path) == "checkpoint" else inspect_run(path)


def human_bytes(n: float | None) -> str:
    return "-" if n is None else format_bytes(n)


def _or_unknown(value: Any) -> str:
    return "?" if value is None else str(value)


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f} s"


def _switch(p: dict[str, Any]) -> str:
    """The switch cell: the downtime before a resumed phase is no switch, and shown as none."""
    return "resumed" if p["switch_seconds"] is None and p["resumed"] else _seconds(p["switch_seconds"])


def render(report: dict[str, Any], console) -> None:
    """Prints an inspect report as rich tables."""
    if report["kind"] == "checkpoint":
        _render_checkpoint(report, console)
    else:
        _render_run(report, console)


def _render_checkpoint(r: dict[str, Any], console) -> None:
    from rich.table import Table

    console.print(f"{r['path']}  step {r['global_step']}, phase {r['phase']}, layers {r['layers']}"
                  f"{'' if r['phase_complete'] else ' (mid-phase)'}", style="bold", markup=False)
    console.print(f"head_step {r['head_step']}, body_step {r['body_step']}, world size {r['world_size']}, "
                  f"ZeRO {r['zero_stage']}, {r['dtype']}, {human_bytes(r['bytes'])}")
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in sorted(r["versions"].items())))
    table = Table("tensor", "group", "dtype", "shape", "bytes")
    for t in r["tensors"]:
        table.add_row(t["name"], t["group"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar",
                      human_bytes(t["bytes"]))
    console.print(table)


def _render_run(r: dict[str, Any], console) -> None:
    from rich.table import Table

    console.print(f"{r['path']}  {len(r['phases'])} phases, {len(r['checkpoints'])} checkpoints, "
                  f"last event: {r['last_event']}", style="bold", markup=False)
    table = Table("phase", "global steps", "layers", "procs", "status", "wall", "switch", "peak mem", "checkpoints")
    for p in r["phases"]:
        ckpts = "\n".join(f"{c['name']} {human_bytes(c['bytes'])}{'' if c['complete'] else ' (incomplete)'}"
                          for c in p["checkpoints"]) or "-"
        last = None if p["end_step"] is None else p["end_step"] - 1
        table.add_row(str(p["index"]), f"{_or_unknown(p['start_step'])}-{_or_unknown(last)}",
                      ",".join(map(str, p["layers"] or [])), _or_unknown(p["nproc"]), p["status"],
                      _seconds(p["seconds"]), _switch(p),
                      human_bytes(p["records"].get("memory_peak")), ckpts)
    console.print(table)
    for c in r["checkpoints"]:
        for fault in c["faults"]:
            console.print(f"incomplete checkpoint: {fault}", markup=False, highlight=False)
    for stray in r["stray_temporaries"]:
        console.print(f"stray temporary: {stray}", markup=False, highlight=False)
