"""``shard-tools diff``: per tensor, what changed between the weights two checkpoints stand for.

    shard-tools diff runs/tiny/checkpoints/step-00000010 runs/tiny/checkpoints/step-00000030
    shard-tools diff runs/a runs/b        # the newest whole checkpoints of two runs

Each side is its composed weights in fp32 (base model, each layer's newest weights, the head). A
tensor that only one side changed is compared with the other side's base model. When the two runs
start from the same base, tensors neither changed are equal and not listed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from shard_tools.export import base_model, base_spec
from shard_tools.errors import CheckpointError
from shard_tools.manifest import MANIFEST, Manifest
from shard_tools.state import run_weights
from shard_tools.verify import trusted_checkpoint


@dataclass
class _Side:
    ckpt: Path
    manifest: Manifest
    weights: dict[str, torch.Tensor]
    base_key: str


def _side(path: Path, warn: Callable[[str], None] | None = None) -> _Side:
    run_dir, ckpt, manifest = trusted_checkpoint(path, warn)
    key = json.dumps(asdict(base_spec(ckpt, manifest)), sort_keys=True)
    return _Side(ckpt, manifest, run_weights(run_dir, ckpt), key)


def _base(side: _Side, built: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The side's base parameters, built once per distinct base (the sides often share one)."""
    if side.base_key not in built:
        built[side.base_key] = {n: p.detach() for n, p in base_model(side.ckpt, side.manifest).named_parameters()}
    return built[side.base_key]


def _group(name: str, layers_attr: str | None, persistent: list[str]) -> str:
    if layers_attr and name.startswith(layers_attr + "."):
        return f"layer {name[len(layers_attr) + 1:].split('.', 1)[0]}"
    if any(name == p or name.startswith(p + ".") for p in persistent):
        return "head"
    return "other"


def _group_order(group: str) -> tuple[int, int]:
    if group.startswith("layer "):
        return 1, int(group.split()[1])
    return (0, 0) if group == "head" else (2, 0)


def _compare(a: torch.Tensor | None, b: torch.Tensor | None) -> dict[str, Any]:
    if a is None or b is None:
        return {"changed": True, "max_abs": None, "rel_change": None, "diff_norm": None, "norm": None,
                "note": "only in " + ("B" if a is None else "A")}
    if a.shape != b.shape:
        return {"changed": True, "max_abs": None, "rel_change": None, "diff_norm": None, "norm": None,
                "note": f"shape {list(a.shape)} -> {list(b.shape)}"}
    d = b - a
    diff_norm, norm = d.norm().item(), a.norm().item()
    rel = diff_norm / norm if norm else (0.0 if diff_norm == 0 else None)
    return {"changed": bool(d.any()), "max_abs": d.abs().max().item() if d.numel() else 0.0, "rel_change": rel,
            "diff_norm": diff_norm, "norm": norm, "note": ""}


def diff_paths(a: Path, b: Path, warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``warn``: told where a run's newest checkpoint is damaged and an older one is compared."""
    sides = [_side(Path(a), warn), _side(Path(b), warn)]
    built: dict[str, dict[str, torch.Tensor]] = {}
    same_base = sides[0].base_key == sides[1].base_key
    names = set(sides[0].weights) | set(sides[1].weights)
    if not same_base:
        names |= set(_base(sides[0], built)) | set(_base(sides[1], built))
    for side in sides:
        _check_parts(side)
    extra = {**sides[1].manifest.extra, **sides[0].manifest.extra}
    layers_attr, persistent = extra.get("layers_attr"), extra.get("persistent") or []
    tensors = []
    for name in sorted(names):
        pair = [s.weights[name] if name in s.weights else _base(s, built).get(name) for s in sides]
        shape = list((pair[0] if pair[0] is not None else pair[1]).shape)
        tensors.append({"name": name, "group": _group(name, layers_attr, persistent), "shape": shape,
                        **_compare(*(t.float() if t is not None else None for t in pair))})
    return {"a": _describe(sides[0]), "b": _describe(sides[1]), "same_base": same_base,
            "groups": _groups(tensors), "tensors": tensors}


def _check_parts(side: _Side) -> None:
    """The manifest fields that name the groups tensors are shown in must be what the writer writes."""
    extra, where = side.manifest.extra, side.ckpt / MANIFEST
    layers_attr, persistent = extra.get("layers_attr"), extra.get("persistent") or []
    if not (layers_attr is None or isinstance(layers_attr, str)):
        raise CheckpointError(f"{where}: field extra.layers_attr: expected a string, found {layers_attr!r}")
    if not (isinstance(persistent, list) and all(isinstance(p, str) for p in persistent)):
        raise CheckpointError(f"{where}: field extra.persistent: expected a list of strings, found {persistent!r}")


def _describe(side: _Side) -> dict[str, Any]:
    return {"checkpoint": str(side.ckpt), "global_step": side.manifest.global_step, "phase": side.manifest.phase}


def _groups(tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per group: changed tensor count, the largest change, and ||b-a|| / ||a|| over all its tensors."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for t in tensors:
        groups.setdefault(t["group"], []).append(t)
    out = []
    for name in sorted(groups, key=_group_order):
        ts = groups[name]
        comparable = [t for t in ts if t["diff_norm"] is not None]
        diff_sq, norm_sq = sum(t["diff_norm"] ** 2 for t in comparable), sum(t["norm"] ** 2 for t in comparable)
        rel = math.sqrt(diff_sq / norm_sq) if norm_sq else (0.0 if diff_sq == 0 else None)
        out.append({"group": name, "tensors": len(ts), "changed": sum(t["changed"] for t in ts),
                    "max_abs": max((t["max_abs"] for t in comparable), default=None),
                    "rel_change": rel if len(comparable) == len(ts) else None})
    return out


def _number(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def render(report: dict[str, Any], console) -> None:
    from rich.table import Table

    for label, side in (("A", report["a"]), ("B", report["b"])):
        console.print(f"{label}: {side['checkpoint']} (step {side['global_step']})", markup=False)
    if report["same_base"]:
        console.print("same base model: tensors that neither side changed over it are equal and not listed")
    groups = Table("group", "tensors", "changed", "max |b-a|", "||b-a|| / ||a||")
    for g in report["groups"]:
        groups.add_row(g["group"], str(g["tensors"]), str(g["changed"]), _number(g["max_abs"]),
                       _number(g["rel_change"]))
    console.print(groups)
    tensors = Table("tensor", "shape", "changed", "max |b-a|", "||b-a|| / ||a||", "note")
    for t in report["tensors"]:
        tensors.add_row(t["name"], "x".join(map(str, t["shape"])), "yes" if t["changed"] else "no",
                        _number(t["max_abs"]), _number(t["rel_change"]), t["note"])
    console.print(tensors)
