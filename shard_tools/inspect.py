"""``shard-tools inspect``: what a run or one checkpoint holds.

Reads only the manifests, the safetensors headers and the run's journal (replayed by
``shard_tools.history``, as ``orchestrator report`` replays it), never torch, so it answers at
once however big the run:

    shard-tools inspect runs/tiny            # phase table
    shard-tools inspect runs/tiny/checkpoints/step-00000030 --json
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shard_tools.errors import CheckpointError
from shard_tools.files import regular_fault
from shard_tools.header import tensor_headers
from shard_tools.history import JOURNAL, read_history
from shard_tools.manifest import BODY_OPTIM, HEAD, LAYERS, STATE, path_kind, read_manifest, step_of, verify_checkpoint
from shard_tools.sizes import format_bytes
from shard_tools.store import Checkpoints, gone_since_listed

# File name -> tensor group, in display order.
GROUPS = {HEAD: "head", LAYERS: "body", BODY_OPTIM: "body_optim", STATE: "state"}


def inspect_checkpoint(ckpt: Path) -> dict[str, Any]:
    manifest = read_manifest(ckpt)
    group = {**GROUPS, manifest.layers_name: "body"}  # a trimmed layers file has a name of its own
    order = list(group.values())
    files = sorted(manifest.files, key=lambda f: (order.index(group[f]) if f in group else len(order), f))
    tensors, metadata = [], {}
    for file in files:
        if fault := regular_fault(ckpt / file, follow_symlinks=False):
            raise CheckpointError(f"{ckpt / file}: {fault}")
        header, metadata[file] = tensor_headers(ckpt / file)
        for name, entry in sorted(header.items()):
            start, end = entry["data_offsets"]
            tensors.append({"name": name, "file": file, "group": group.get(file, file), "shape": entry["shape"],
                            "dtype": entry["dtype"], "bytes": end - start})
    return {"kind": "checkpoint", "path": str(ckpt), **asdict(manifest),
            "bytes": sum(e.size for e in manifest.files.values()), "metadata": metadata, "tensors": tensors}


def _checkpoint_summary(ckpt: Path, store: Checkpoints) -> dict[str, Any] | None:
    """None where it is gone since it was listed (``gone_since_listed``). A recorded layer source
    that is gone is its fault (``lost``: the layers whose trained weights are gone)."""
    entry: dict[str, Any] = {"name": ckpt.name, "step": step_of(ckpt)}
    faults = verify_checkpoint(ckpt, checksums=False)
    lost: list[tuple[int, int | None]] = []
    if not faults and (e := store.lost_source(ckpt)):
        faults, lost = [str(e)], [(e.layer, step_of(Path(e.source)))]
    try:
        m = read_manifest(ckpt)
    except CheckpointError:
        if gone_since_listed(ckpt):
            return None
        return {**entry, "phase": None, "layers": [], "complete": False, "bytes": None, "faults": faults}
    return {**entry, "phase": m.phase, "layers": m.layers, "carried_layers": m.carried_layers,
            "phase_complete": m.phase_complete,
            "layers_only": m.layers_only, "lost_layers": lost, "complete": not faults, "bytes": sum(e.size for e in m.files.values()), "faults": faults}


def _number(v: Any) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _records(v: Any) -> dict[str, float]:
    """A phase's numeric records; anything else in them is not shown."""
    return {k: x for k, x in v.items() if _number(x) is not None} if isinstance(v, dict) else {}


def _phase_row(index: int, **known: Any) -> dict[str, Any]:
    return {"index": index, "start_step": None, "end_step": None, "layers": None, "nproc": None,
            "status": "started", "attempts": 0, "seconds": None, "switch_seconds": None, "records": {},
            "resumed": False, **known}


def inspect_run(run_dir: Path) -> dict[str, Any]:
    history = read_history(run_dir) if (Path(run_dir) / JOURNAL).exists() else None
    phases = {p.index: {**asdict(p), "records": _records(p.records)} for p in (history.phases if history else [])}
    store = Checkpoints(run_dir)
    checkpoints = [s for c in store.all() if (s := _checkpoint_summary(c, store)) is not None]
    writing, stray = store.being_written()
    for c in checkpoints:
        if c["phase"] is not None and c["phase"] not in phases:
            # Journal lost or cut short: the manifests still say which phase wrote what.
            phases[c["phase"]] = _phase_row(c["phase"], end_step=c["step"], layers=c["layers"], status="unknown")
    ordered = [phases[i] for i in sorted(phases)]
    _mark_lost(ordered, checkpoints)
    for p in ordered:
        p["checkpoints"] = [c for c in checkpoints if c["phase"] == p["index"]]
    return {"kind": "run", "path": str(run_dir), "events": history.events if history else 0,
            "last_event": history.last_event if history else None, "phases": ordered,
            "checkpoints": checkpoints, "stray_temporaries": [str(p) for p in stray],
            "being_written": [str(p) for p in writing]}


def _mark_lost(phases: list[dict[str, Any]], checkpoints: list[dict[str, Any]]) -> None:
    """A phase whose trained layer is in a checkpoint gone since (a later one's record names it) is
    shown "lost", not done: the newest phase that trained that layer by the missing checkpoint's step."""
    for layer, step in {tuple(x) for c in checkpoints for x in c.get("lost_layers", [])}:
        trained = [p for p in phases if layer in (p["layers"] or []) and p["end_step"] is not None
                   and step is not None and p["end_step"] <= step]
        if trained:
            trained[-1]["status"] = f"lost: layer {layer} (step-{step:08d} is gone)"


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
    if isinstance(started := (r.get("extra") or {}).get("state_from"), dict):
        console.print("optimizer state started from: " + state_from_line(started), markup=False, highlight=False)
    table = Table("tensor", "group", "dtype", "shape", "bytes")
    for t in r["tensors"]:
        table.add_row(t["name"], t["group"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar",
                      human_bytes(t["bytes"]))
    console.print(table)


def state_from_line(started: dict[str, Any]) -> str:
    """A manifest's ``extra.state_from`` in words: each origin, and how many tensors (which, if few) start from it."""
    by: dict[str, list[str]] = {}
    for name, origin in sorted(started.items()):
        by.setdefault(str(origin), []).append(name)
    return "; ".join(f"{origin}: {len(names)} tensor{'s' if len(names) > 1 else ''}"
                     + (f" ({', '.join(names)})" if len(names) <= 3 else "") for origin, names in by.items())


def _render_run(r: dict[str, Any], console) -> None:
    from rich.table import Table

    console.print(f"{r['path']}  {len(r['phases'])} phases, {len(r['checkpoints'])} checkpoints, "
                  f"last event: {r['last_event']}", style="bold", markup=False)
    table = Table("phase", "global steps", "layers", "procs", "status", "wall", "switch", "peak mem", "checkpoints")
    for p in r["phases"]:
        ckpts = "\n".join(f"{c['name']} {human_bytes(c['bytes'])}{' (layers only)' if c.get('layers_only') else ''}"
                          + (f" (+ layers {','.join(map(str, c['carried_layers']))})" if c.get("carried_layers") else "")
                          + f"{'' if c['complete'] else ' (incomplete)'}"
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
    for writing in r["being_written"]:
        console.print(f"being written or removed by a running process: {writing}", markup=False, highlight=False)
