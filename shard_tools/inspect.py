"""``shard-tools inspect``: what a run or one checkpoint holds.

Reads only the journal, the manifests and the safetensors headers, never torch, so it answers at
once however big the run:

    shard-tools inspect runs/tiny            # phase table
    shard-tools inspect runs/tiny/checkpoints/step-00000030 --json
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shard_tools.manifest import (
    JOURNAL, CheckpointError, list_checkpoints, path_kind, read_manifest, step_of, stray_temporaries,
    verify_checkpoint,
)

# File name -> tensor group, in display order (names as shard_tools.checkpoint writes them).
GROUPS = {"head.safetensors": "head", "layers.safetensors": "body", "body_optim.safetensors": "body_optim",
          "state.safetensors": "state"}
_MAX_HEADER = 100 << 20  # the safetensors library refuses larger headers too


def tensor_headers(path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """({tensor name: {dtype, shape, data_offsets}}, metadata) of a safetensors file, without torch."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, less than its header length)")
            length = int.from_bytes(f.read(8), "little")
            if length > min(_MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: truncated safetensors header ({length} bytes announced, "
                                      f"{size - 8} present)")
            raw = f.read(length)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    for name, entry in header.items():
        if not _well_formed(entry):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry")
        end = entry["data_offsets"][1]
        if 8 + length + end > size:
            raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {8 + length + end}, "
                                  f"the file has {size}")
    return header, metadata


def _well_formed(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
            and isinstance(entry.get("shape"), list) and all(isinstance(d, int) for d in entry["shape"])
            and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
            and all(isinstance(o, int) for o in entry["data_offsets"]))


def inspect_checkpoint(ckpt: Path) -> dict[str, Any]:
    manifest = read_manifest(ckpt)
    order = list(GROUPS)
    files = sorted(manifest.files, key=lambda f: (order.index(f) if f in order else len(order), f))
    tensors, metadata = [], {}
    for file in files:
        header, metadata[file] = tensor_headers(ckpt / file)
        for name, entry in sorted(header.items()):
            start, end = entry["data_offsets"]
            tensors.append({"name": name, "file": file, "group": GROUPS.get(file, file), "shape": entry["shape"],
                            "dtype": entry["dtype"], "bytes": end - start})
    return {"kind": "checkpoint", "path": str(ckpt), **asdict(manifest),
            "bytes": sum(e.size for e in manifest.files.values()), "metadata": metadata, "tensors": tensors}


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every complete journal event; a torn last line (a writer killed mid-write) is skipped."""
    try:
        lines = (Path(run_dir) / JOURNAL).read_text().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def _checkpoint_summary(ckpt: Path) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": ckpt.name, "step": step_of(ckpt)}
    faults = verify_checkpoint(ckpt, checksums=False)
    try:
        m = read_manifest(ckpt)
    except CheckpointError:
        return {**entry, "phase": None, "layers": [], "complete": False, "bytes": None, "faults": faults}
    return {**entry, "phase": m.phase, "layers": m.layers, "phase_complete": m.phase_complete,
            "complete": not faults, "bytes": sum(e.size for e in m.files.values()), "faults": faults}


def _phases(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Phase rows from the journal; events lacking a field leave it unknown rather than failing."""
    phases: dict[int, dict[str, Any]] = {}
    for e in events:
        kind, index = e.get("event"), e.get("phase")
        if not isinstance(index, int) or kind not in ("phase_started", "phase_done", "phase_failed", "preempted"):
            continue
        p = phases.setdefault(index, _phase_row(index))
        if kind == "phase_started":
            starts = [s for s in (p["start_step"], e.get("start_step")) if isinstance(s, int)]
            # A resumed phase starts again mid-way; the phase itself began at its first start.
            p.update(start_step=min(starts, default=None), end_step=e.get("end_step"), layers=e.get("layers"),
                     nproc=e.get("nproc"), status="started", attempts=p["attempts"] + 1)
        elif kind == "phase_done":
            p.update(status="done", end_step=e.get("step", p["end_step"]), seconds=e.get("seconds"),
                     records=e.get("records") or {})
        else:
            p["status"] = "failed" if kind == "phase_failed" else "preempted"
    return phases


def _phase_row(index: int, **known: Any) -> dict[str, Any]:
    return {"index": index, "start_step": None, "end_step": None, "layers": None, "nproc": None,
            "status": "started", "attempts": 0, "seconds": None, "switch_seconds": None, "records": {}, **known}


def _switch_seconds(prev: dict[str, Any], cur: dict[str, Any]) -> float | None:
    """From the previous phase's last step to this one's first, less this phase's typical step."""
    last, first = prev["records"].get("t_last_step_end"), cur["records"].get("t_first_step_end")
    if last is None or first is None:
        return None
    return first - last - (cur["records"].get("step_seconds_median") or 0.0)


def inspect_run(run_dir: Path) -> dict[str, Any]:
    events = read_events(run_dir)
    phases = _phases(events)
    checkpoints = [_checkpoint_summary(c) for c in list_checkpoints(run_dir)]
    for c in checkpoints:
        if c["phase"] is not None and c["phase"] not in phases:
            # Journal lost or cut short: the manifests still say which phase wrote what.
            phases[c["phase"]] = _phase_row(c["phase"], end_step=c["step"], layers=c["layers"], status="unknown")
    ordered = [phases[i] for i in sorted(phases)]
    for prev, cur in zip(ordered, ordered[1:]):
        if cur["index"] == prev["index"] + 1:
            cur["switch_seconds"] = _switch_seconds(prev, cur)
    for p in ordered:
        p["checkpoints"] = [c for c in checkpoints if c["phase"] == p["index"]]
    return {"kind": "run", "path": str(run_dir), "events": len(events),
            "last_event": events[-1].get("event") if events else None, "phases": ordered,
            "checkpoints": checkpoints, "stray_temporaries": [str(p) for p in stray_temporaries(run_dir)]}


def inspect_path(path: Path) -> dict[str, Any]:
    path = Path(path)
    return inspect_checkpoint(path) if path_kind(path) == "checkpoint" else inspect_run(path)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    unit = 0
    while n >= 1024 and unit < 4:
        n, unit = n / 1024, unit + 1
    return f"{n:.0f} B" if unit == 0 else f"{n:.1f} {'KMGT'[unit - 1]}iB"


def _or_unknown(value: Any) -> str:
    return "?" if value is None else str(value)


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f} s"


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
                      _seconds(p["seconds"]), _seconds(p["switch_seconds"]),
                      human_bytes(p["records"].get("memory_peak")), ckpts)
    console.print(table)
    for c in r["checkpoints"]:
        for fault in c["faults"]:
            console.print(f"incomplete checkpoint: {fault}", markup=False, highlight=False)
    for stray in r["stray_temporaries"]:
        console.print(f"stray temporary: {stray}", markup=False, highlight=False)
