"""One checkpoint's manifest and the names of its files, at the manifest level: no torch here.

A checkpoint is the directory ``checkpoints/step-NNNNNNNN``; it counts only when its
``manifest.json`` is present and every file it lists has the recorded size and sha256. A run's
checkpoints together are ``shard_tools.store.Checkpoints``; what a phase's files hold,
``shard_tools.state``.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shard_tools.digest import digest_fd
from shard_tools.errors import CheckpointError, InputError
from shard_tools.files import describe, fsync_path, open_regular, read_regular
from shard_tools.header import read_header
from shard_tools.history import JOURNAL

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
FINAL = "final"
"""RUN_DIR/final: the finished run's model, the one export that lives inside its run."""
EXPORT_MARKER = "relayer.json"
EXPORT_TIMINGS = "timings "
"""The line ``shard-tools export --wait-for-go`` prints its stages' seconds on (JSON after it)."""
"""Written into every export: what it was exported from, and each file's size and checksum.
``--force`` replaces only a folder that has one."""
_STEP_DIR = re.compile(r"^step-(\d{8})$")
STEP_DIR_SHAPE = "step-NNNNNNNN"
"""How messages name any checkpoint folder (``step_dir_name`` spells one)."""
_MAX_MANIFEST = 16 << 20  # a manifest lists a few files; anything near this is not one
HEAD = "head.safetensors"
LAYERS = "layers.safetensors"
_TRIMMED = re.compile(r"^layers-[0-9a-f]{16}\.safetensors$")
"""A layers-only checkpoint's layers file after retention kept only some of its layers
(``layers-<the first 16 hex digits of its checksum>.safetensors``: a new name each time, so that a
reader holding the old manifest finds the old file or none, never another file under its name)."""
BODY_OPTIM = "body_optim.safetensors"
STATE = "state.safetensors"


def trimmed_name(sha256_chunked: str) -> str:
    """The name of a trimmed layers file with this checksum (``_TRIMMED``)."""
    return f"layers-{sha256_chunked[:16]}.safetensors"


def layers_file(files: dict[str, Any]) -> str:
    """The name of the layers file a manifest lists: ``LAYERS``, or in a layers-only checkpoint
    retention trimmed, its ``layers-<checksum>.safetensors``."""
    return LAYERS if LAYERS in files else next((n for n in files if _TRIMMED.match(n)), LAYERS)


def files_needed(phase_complete: bool, layers_only: bool = False) -> tuple[str, ...]:
    """What every checkpoint's manifest lists: the head, its phase's layers (even none) and the
    run state; mid-phase also the body's optimizer state. A layers-only one (retention kept it
    for its layers alone) lists its layers file alone."""
    if layers_only:
        return (LAYERS,)
    return (HEAD, LAYERS, STATE) if phase_complete else (HEAD, LAYERS, BODY_OPTIM, STATE)


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
    layers_only: bool = False
    """Retention dropped its head, state and body optimizer state: a source of layers for the
    checkpoints after it, never a restore point."""
    carried_layers: list[int] = field(default_factory=list)
    """Layers its layers file holds besides its phase's: trained by phases since the last checkpoint
    whose ends wrote none (``checkpoint.every_seconds``), carried on to this one."""
    layer_sources: dict[str, dict[str, str]] | None = None
    """For each layer trained before it that its own layers file does not hold: the checkpoint it
    composes that layer from and the checksum of that one's layers file then,
    {"2": {"checkpoint": "step-00000020", "sha256_chunked": "..."}}. A reader never composes such a
    layer from anything else (a lost source is a fault, never the base model's layer). None in
    checkpoints written before it was recorded (their layers compose by the newest that holds each),
    and in a layers-only one (retention drops it: what it named may go)."""
    written_sha256: str | None = None
    """In a layers-only checkpoint whose layers file retention trimmed to the layers a kept
    checkpoint still composes from: the checksum of the layers file its phase wrote, which the
    records (``layer_sources``) of the checkpoints after it name. None otherwise."""
    kept_layers: list[int] | None = None
    """With ``written_sha256``: the layers its trimmed file still holds (``layers`` and
    ``carried_layers`` still say what its phase wrote)."""

    @property
    def layers_name(self) -> str:
        """Its layers file's name (``layers_file``)."""
        return layers_file(self.files)

    @property
    def layers_sha256(self) -> str:
        """The checksum a record names this checkpoint's layers by: of the file its phase wrote."""
        return self.written_sha256 or self.files[self.layers_name].sha256_chunked

    @property
    def stored_layers(self) -> list[int]:
        """Every layer its layers file holds: its phase's, then the carried ones (of a trimmed one,
        ``kept_layers``)."""
        if self.kept_layers is not None:
            return list(self.kept_layers)
        return [*self.layers, *(l for l in self.carried_layers if l not in self.layers)]

    def to_json(self) -> str:
        data = asdict(self)
        for name in ("layers_only", "carried_layers", "layer_sources", "written_sha256", "kept_layers"):  # absent: as every earlier reader knows it
            if not data[name] and data[name] != {}:
                del data[name]
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: Path) -> Manifest:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # ValueError: not JSON, or not UTF-8
            raise CheckpointError(f"{where}: not a valid manifest (not JSON: {e})") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: not a valid manifest (not a JSON object)")
        _check_fields(data, _FIELDS, where, "", optional={"extra", "format_version", "layers_only", "carried_layers", "layer_sources",
                                                          "written_sha256", "kept_layers"})
        if data.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
            raise CheckpointError(f"{where}: format_version {data['format_version']}; this relayer reads "
                                  f"format {FORMAT_VERSION}")
        for name, entry in data["files"].items():
            if not _plain_name(name):
                raise CheckpointError(f"{where}: files: {json.dumps(name)} is not a plain file name inside the "
                                      f"checkpoint (no path separators, no '..')")
            _check_fields(entry, _FILE_FIELDS, where, f"files[{json.dumps(name)}].")
        files = {k: FileEntry(**v) for k, v in data["files"].items()}
        # A manifest that leaves out a file would verify without it, and its layers would quietly
        # be composed from an older checkpoint.
        needed = files_needed(data["phase_complete"], data.get("layers_only", False))
        if "written_sha256" in data or "kept_layers" in data:
            if not (data.get("layers_only") and "written_sha256" in data and "kept_layers" in data):
                raise CheckpointError(f"{where}: fields written_sha256 and kept_layers: a trimmed layers file is "
                                      f"recorded by both, in a layers-only checkpoint")
            needed = (layers_file(files),)
        if missing := [n for n in needed if n not in files]:
            kind = "layers-only" if data.get("layers_only") else "phase-end" if data["phase_complete"] else "mid-phase"
            raise CheckpointError(f"{where}: files: {missing[0]} is not listed; a {kind} checkpoint lists "
                                  f"{', '.join(needed)}")
        return cls(**{**data, "files": files})


_MAX_INT = 2 ** 63 - 1  # what an int64 tensor holds


def _count(lo: int = 0, hi: int = _MAX_INT):
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi,
            f"an integer from {lo} to {hi}" if hi != _MAX_INT else f"an integer >= {lo}")


def _of(kind: type, what: str):
    return lambda v: isinstance(v, kind), what


_FIELDS = {
    "global_step": _count(), "phase": _count(), "head_step": _count(), "body_step": _count(),
    "world_size": _count(1), "zero_stage": _count(0, 3), "format_version": _count(),
    "layers": (lambda v: isinstance(v, list) and all(_count()[0](x) for x in v), "a list of integers >= 0"),
    "carried_layers": (lambda v: isinstance(v, list) and all(_count()[0](x) for x in v), "a list of integers >= 0"),
    "phase_complete": _of(bool, "true or false"),
    "dtype": _of(str, "a string"),
    "files": (lambda v: isinstance(v, dict) and all(isinstance(e, dict) for e in v.values()),
              "an object of file name -> {size, sha256_chunked}"),
    "versions": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                 "an object of strings"),
    "created": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                "a finite number (seconds since the epoch)"),
    "extra": _of(dict, "an object"),
    "layers_only": _of(bool, "true or false"),
    "written_sha256": (lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None,
                       "64 lowercase hex digits"),
    "kept_layers": (lambda v: isinstance(v, list) and all(_count()[0](x) for x in v), "a list of integers >= 0"),
    "layer_sources": (lambda v: isinstance(v, dict) and all(_source_ok(k, e) for k, e in v.items()),
                      'an object of layer -> {"checkpoint": "step-NNNNNNNN", "sha256_chunked": "<64 hex digits>"}'),
}
_FILE_FIELDS = {
    "size": _count(),
    "sha256_chunked": (lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) is not None,
                       "64 lowercase hex digits"),
}


def _source_ok(layer: str, entry: Any) -> bool:
    return (isinstance(layer, str) and layer.isdigit() and len(layer) <= 18 and isinstance(entry, dict)
            and entry.keys() == {"checkpoint", "sha256_chunked"} and isinstance(entry["checkpoint"], str)
            and _STEP_DIR.match(entry["checkpoint"]) is not None and isinstance(entry["sha256_chunked"], str)
            and re.fullmatch(r"[0-9a-f]{64}", entry["sha256_chunked"]) is not None)


def _check_fields(data: dict, fields: dict, where: Path, prefix: str, optional: frozenset | set = frozenset()) -> None:
    """CheckpointError naming the first field that is missing, unknown or of the wrong type or range."""
    unknown = sorted(data.keys() - fields.keys())
    if unknown:
        raise CheckpointError(f"{where}: unknown field {prefix}{unknown[0]}")
    for name, (ok, expected) in fields.items():
        if name not in data:
            if name in optional:
                continue
            raise CheckpointError(f"{where}: field {prefix}{name} is missing")
        if not ok(data[name]):
            shown = json.dumps(data[name])
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise CheckpointError(f"{where}: field {prefix}{name}: expected {expected}, found {shown}")


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def step_dir_name(step: int) -> str:
    """The name of the checkpoint folder at global step ``step``; every writer and reader spells it here."""
    return f"step-{step:08d}"


def step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and step_of(path) is not None


def read_manifest(ckpt: Path) -> Manifest:
    path = ckpt / MANIFEST
    try:
        text = read_regular(path, _MAX_MANIFEST, follow_symlinks=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing: the checkpoint is incomplete") from None
    except OSError as e:
        raise CheckpointError(f"{path}: {describe(e, follow_symlinks=False)}") from None
    manifest = Manifest.from_json(text, path)
    step = step_of(ckpt)
    if step is not None and manifest.global_step != step:
        raise CheckpointError(f"{path}: global_step {manifest.global_step}, but the checkpoint is {ckpt.name}")
    return manifest


def verify_checkpoint(ckpt: Path, *, checksums: bool = True) -> list[str]:
    """Every fault of one checkpoint, each naming its file; empty when the checkpoint is whole.

    Only regular files count, opened without following a symbolic link and without blocking on
    a FIFO: a checksum vouches for the checkpoint's own bytes, and verifying never hangs. With
    ``checksums``, each safetensors header is checked too (``shard_tools.header``).
    """
    if step_of(ckpt) is not None and ckpt.is_symlink():
        # Not the run's own bytes: retention could not remove it, and it could change under the run.
        return [f"{ckpt}: a symbolic link, where a run's checkpoint is a folder of its own: ignored"]
    try:
        manifest = read_manifest(ckpt)
    except CheckpointError as e:
        return [str(e)]
    faults = []
    for name, entry in sorted(manifest.files.items()):
        f = ckpt / name
        try:
            fd = open_regular(f, follow_symlinks=False)
        except OSError as e:
            faults.append(f"{f}: {describe(e, follow_symlinks=False)}")
            continue
        try:
            size = os.fstat(fd).st_size
            if size != entry.size:
                faults.append(f"{f}: size {size} bytes, the manifest says {entry.size}")
            elif checksums and digest_fd(fd) != entry.sha256_chunked:
                faults.append(f"{f}: checksum mismatch (sha256 differs from the manifest)")
            elif checksums and name.endswith(".safetensors"):
                # A manifest that vouches for a malformed file (a writer's bug) must not make it whole.
                tensors, metadata = read_header(fd, f)
                if name == manifest.layers_name and (fault := _layers_fault(f, tensors, metadata, manifest.stored_layers)):
                    faults.append(fault)
        except CheckpointError as e:
            faults.append(str(e))
        except OSError as e:
            faults.append(f"{f}: cannot read: {e.strerror or e}")
        finally:
            os.close(fd)
    return faults


def listing_fault(ckpt: Path) -> str | None:
    """Where a checkpoint's manifest lists other layers than its layers file holds, judged by the
    file's header alone (no checksum); None where either cannot be read (nothing to judge by). For
    the checkpoints a later one does not compose from, by their manifests: one whose manifest lost
    a layer would have been that layer's source (``Checkpoints.source_faults``)."""
    try:
        manifest = read_manifest(ckpt)
        if manifest.layers_name not in manifest.files:
            return None
        f = ckpt / manifest.layers_name
        fd = open_regular(f, follow_symlinks=False)
    except (CheckpointError, OSError):
        return None
    try:
        return _layers_fault(f, *read_header(fd, f), manifest.stored_layers)
    except CheckpointError:
        return None
    finally:
        os.close(fd)


def layers_said(f: Path, metadata: dict[str, str]) -> tuple[set[int], str]:
    """The layers a layers file's metadata says it holds, and the prefix of their tensors' names
    ("model.layers."); CheckpointError where it does not say (every reader needs both)."""
    try:
        return {int(k) for k in metadata.get("layers", "").split(",") if k}, metadata["layers_prefix"] + "."
    except (KeyError, ValueError):
        raise CheckpointError(f"{f}: its metadata does not say which layers it holds (layers, layers_prefix)") from None


def layer_of(f: Path, name: str, prefix: str) -> int:
    """The layer a layers file's tensor belongs to; CheckpointError where it is under no layer."""
    index = name[len(prefix):].partition(".")[0] if name.startswith(prefix) else ""
    if not index.isdigit():
        raise CheckpointError(f"{f}: tensor {name!r} is not under {prefix}<layer>")
    return int(index)


def _layers_fault(f: Path, tensors: dict, metadata: dict[str, str], listed: list[int]) -> str | None:
    """Where the layers file (checksummed) does not say which layers it holds, as its readers need
    (``state.layer_weights``), or holds other layers than its manifest lists: a manifest that lost a
    layer would make the checkpoints after it compose an older copy of it, or the base model's."""
    try:
        said, prefix = layers_said(f, metadata)
        held = sorted({layer_of(f, n, prefix) for n in tensors})
    except CheckpointError as e:
        return str(e)
    said, listed = sorted(said), sorted(set(listed))
    if said != listed or held != listed:
        return f"{f}: holds layers {held} (its metadata says {said}), the manifest lists {listed}"
    return None


def make_durable(ckpt: Path) -> None:
    """fsyncs a checkpoint written with ``durable=False``: its files, its directory, its parent."""
    for f in ckpt.iterdir():
        fsync_path(f)
    fsync_path(ckpt)
    fsync_path(ckpt.parent)


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def path_kind(path: Path) -> str:
    """``"checkpoint"`` or ``"run"``: what a path given to a command is; InputError for anything else."""
    path = Path(path)
    try:
        path.stat()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file or directory") from None
    except OSError as e:
        raise InputError(f"{path}: {'a symbolic link loop' if e.errno == errno.ELOOP else e.strerror}") from None
    if not path.is_dir():
        raise InputError(f"{path}: not a directory; expected a run directory or a checkpoint directory")
    # A step directory without its manifest is still a checkpoint, an incomplete one, so it is reported as such.
    if (path / MANIFEST).exists() or is_checkpoint_dir(path):
        return "checkpoint"
    if checkpoints_dir(path).is_dir() or (path / JOURNAL).exists():
        return "run"
    raise InputError(f"{path}: neither a run directory (no checkpoints/ or journal.jsonl) "
                     f"nor a checkpoint (no {MANIFEST})")
