"""Checkpoint manifests and the run directory's layout, at the manifest level: no torch here.

A checkpoint is the directory ``checkpoints/step-NNNNNNNN``; it counts only when its
``manifest.json`` is present and every file it lists has the recorded size and sha256.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from shard_tools.digest import digest_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
JOURNAL = "journal.jsonl"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or damaged; the message names the file."""


@dataclass
class FileEntry:
    size: int
    sha256_chunked: str
    """sha256 over the sha256 digests of the file's 64 MiB chunks (``shard_tools.digest``)."""


@dataclass
class Manifest:
    global_step: int
    phase: int
    layers: list[int]
    phase_complete: bool
    """True at a phase end (the next phase starts a fresh body); False mid-phase (body_optim holds the body state)."""
    head_step: int
    body_step: int
    world_size: int
    zero_stage: int
    dtype: str
    files: dict[str, FileEntry]
    versions: dict[str, str]
    created: float
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: Path) -> Manifest:
        try:
            data = json.loads(text)
            data["files"] = {k: FileEntry(**v) for k, v in data["files"].items()}
            return cls(**data)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{where}: not a valid manifest ({type(e).__name__}: {e})") from None


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and step_of(path) is not None


def read_manifest(ckpt: Path) -> Manifest:
    path = ckpt / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing: the checkpoint is incomplete") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    return Manifest.from_json(text, path)


def verify_checkpoint(ckpt: Path, *, checksums: bool = True) -> list[str]:
    """Every fault of one checkpoint, each naming its file; empty when the checkpoint is whole."""
    try:
        manifest = read_manifest(ckpt)
    except CheckpointError as e:
        return [str(e)]
    faults = []
    for name, entry in sorted(manifest.files.items()):
        f = ckpt / name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            faults.append(f"{f}: missing")
            continue
        if size != entry.size:
            faults.append(f"{f}: size {size} bytes, the manifest says {entry.size}")
        elif checksums and digest_file(f) != entry.sha256_chunked:
            faults.append(f"{f}: checksum mismatch (sha256 differs from the manifest)")
    return faults


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of a run, oldest first, whether valid or not (temporaries excluded)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_checkpoint_dir(p)), key=lambda p: step_of(p) or 0)


def stray_temporaries(run_dir: Path) -> list[Path]:
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(TMP_PREFIX))


def remove_stray_temporaries(run_dir: Path) -> list[Path]:
    """Removes what a killed writer left behind; returns what it removed."""
    gone = stray_temporaries(run_dir)
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return gone


def remove_temporaries_of(run_dir: Path, pids: set[int]) -> list[Path]:
    """Removes the temporaries (``.tmp-<what>.<pid>[.<n>]``) of processes that are gone."""
    gone = [p for p in stray_temporaries(run_dir) if _pid_of(p.name) in pids]
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return gone


def _pid_of(name: str) -> int | None:
    parts = name[len(TMP_PREFIX):].split(".")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def valid_checkpoints(run_dir: Path, *, checksums: bool = True) -> Iterator[tuple[Path, Manifest | None, list[str]]]:
    """(path, manifest or None, faults) for every checkpoint, newest first."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        faults = verify_checkpoint(ckpt, checksums=checksums)
        yield ckpt, (None if faults else read_manifest(ckpt)), faults


def newest_valid(run_dir: Path, *, checksums: bool = True) -> tuple[Path | None, Manifest | None, list[str]]:
    """The newest whole checkpoint and the faults of every newer one that was skipped."""
    skipped: list[str] = []
    for ckpt, manifest, faults in valid_checkpoints(run_dir, checksums=checksums):
        if manifest is not None:
            return ckpt, manifest, skipped
        skipped.extend(faults)
    return None, None, skipped


def layer_sources(run_dir: Path, upto: Path) -> dict[int, Path]:
    """For each body layer, the newest checkpoint at or before ``upto`` whose layers file holds it.

    Judged by manifests alone, damaged checkpoints included: skipping a damaged source would
    silently compose an older layer (or the base) instead. Callers verify the sources they get;
    an unreadable manifest at or before ``upto`` raises, since it may have held a layer.
    """
    limit = step_of(upto)
    assert limit is not None, upto
    sources: dict[int, Path] = {}
    for ckpt in list_checkpoints(run_dir):
        if (step_of(ckpt) or 0) > limit:
            continue
        try:
            m = read_manifest(ckpt)
        except CheckpointError as e:
            raise CheckpointError(f"{e}; {upto.name} may compose layers from it") from None
        if "layers.safetensors" in m.files:
            sources.update(dict.fromkeys(m.layers, ckpt))
    return sources


def needed_by(run_dir: Path, kept: list[Path]) -> set[Path]:
    """Checkpoints that the kept ones need: themselves and every layer source they compose from."""
    need = set(kept)
    for ckpt in kept:
        need.update(layer_sources(run_dir, ckpt).values())
    return need


def fsync_path(path: Path) -> None:
    """fsync of a file, or of a directory (which makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_durable(ckpt: Path) -> None:
    """fsyncs a checkpoint written with ``durable=False``: its files, its directory, its parent."""
    for f in ckpt.iterdir():
        fsync_path(f)
    fsync_path(ckpt)
    fsync_path(ckpt.parent)


def write_text_atomic(path: Path, text: str, mode: int = 0o640) -> None:
    """Writes to a sibling temporary, fsyncs and renames: readers see the old file or the new one."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


class InputError(Exception):
    """A command was given a path or value it does not take; the message names it and says what is expected."""


def path_kind(path: Path) -> str:
    """``"checkpoint"`` or ``"run"``: what a path given to a command is; InputError for anything else."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise InputError(f"{path}: not a directory; expected a run directory or a checkpoint directory")
    # A step directory without its manifest is still a checkpoint, an incomplete one, so it is reported as such.
    if (path / MANIFEST).exists() or is_checkpoint_dir(path):
        return "checkpoint"
    if checkpoints_dir(path).is_dir() or (path / JOURNAL).exists():
        return "run"
    raise InputError(f"{path}: neither a run directory (no checkpoints/ or journal.jsonl) "
                     f"nor a checkpoint (no {MANIFEST})")
