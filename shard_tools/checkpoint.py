"""Writing and reading checkpoint tensors (torch level).

Writes are atomic at two levels: each file is written under the checkpoint's temporary directory,
the manifest (with sizes and sha256) is written last, and only then is the directory renamed to
``step-NNNNNNNN``. A killed writer leaves a ``.tmp-*`` directory that readers ignore.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from shard_tools import digest
from shard_tools.manifest import (
    MANIFEST, TMP_PREFIX, CheckpointError, FileEntry, Manifest, checkpoints_dir, fsync_path, layer_sources,
    read_manifest, step_dir_name,
)

HEAD = "head.safetensors"
LAYERS = "layers.safetensors"
BODY_OPTIM = "body_optim.safetensors"
STATE = "state.safetensors"
OPTIM_KEYS = ("master", "exp_avg", "exp_avg_sq")


last_write_timing: dict[str, float] = {}
"""Seconds the last ``write_checkpoint`` of this process spent writing, fsyncing, waiting for hashes."""


def write_checkpoint(
    run_dir: Path,
    manifest: Manifest,
    files: dict[str, dict[str, torch.Tensor]],
    metadata: dict[str, dict[str, str]] | None = None,
    durable: bool = True,
) -> Path:
    """Writes ``files`` (file name -> tensors) and then the manifest; returns the checkpoint dir.

    ``durable=False`` leaves the fsyncs to the caller's process (``manifest.make_durable``): a
    phase-end checkpoint is made durable by the orchestrator while the next phase starts. Until
    then a crash of the machine can tear it, and the checksums tell.

    A damaged checkpoint already at the same step is moved aside (``step-N.damaged-<time>``), not
    deleted: a valid one there is an error, since a step is written once.
    """
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(manifest.global_step)
    tmp = root / f"{TMP_PREFIX}{final.name}.{os.getpid()}"
    tmp.mkdir(mode=0o700)
    try:
        timing = _write_files(tmp, manifest, files, metadata or {}, durable)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = getattr(e, "strerror", None) or str(e).rsplit("I/O error: ", 1)[-1]
        raise CheckpointError(
            f"{final}: could not write the checkpoint ({reason}); nothing of it was kept and "
            f"earlier checkpoints are intact"
        ) from e
    if final.exists():
        os.replace(final, root / f"{final.name}.damaged-{int(time.time())}")
    os.replace(tmp, final)
    if durable:
        fsync_path(root)
    last_write_timing.update(timing)
    return final


_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}


def _safetensors_stream(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> list[memoryview]:
    """The bytes of a safetensors file as views of the tensors themselves, no copy.

    ``safetensors.torch.save_file`` first builds the whole file in one buffer: an extra copy of
    every byte (1.5 GB for a 1.1B model's head) on the switch's critical path. The format is its
    documented one (8-byte header size, JSON header padded to 8 bytes, data); safetensors reads it.
    """
    header: dict = {"__metadata__": metadata} if metadata else {}
    views, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        views.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return [memoryview(struct.pack("<Q", len(head)) + head), *views]


def _write_files(tmp: Path, manifest: Manifest, files: dict[str, dict[str, torch.Tensor]],
                 metadata: dict[str, dict[str, str]], durable: bool) -> dict[str, float]:
    """Writes every file, hashing its bytes on all cores while they are written; returns timings."""
    # Fault injection for the crash tests: SIGKILL this process right after writing one file.
    kill_after = os.environ.get("RELAYER_TEST_KILL_AFTER")
    entries: dict[str, FileEntry] = {}
    timing = {"write": 0.0, "fsync": 0.0}
    with ThreadPoolExecutor(digest.THREADS) as pool:
        for name, tensors in files.items():
            path = tmp / name
            t0 = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                checksum = digest.write_and_digest(fd, _safetensors_stream(tensors, metadata.get(name)), pool)
                t1 = time.perf_counter()
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            entries[name] = FileEntry(size=path.stat().st_size, sha256_chunked=checksum)
            timing["write"] += t1 - t0
            timing["fsync"] += time.perf_counter() - t1
            if kill_after == name:
                os.kill(os.getpid(), signal.SIGKILL)
    manifest.files = entries
    manifest.created = time.time()
    with open(tmp / MANIFEST, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        if durable:
            os.fsync(f.fileno())
    if durable:
        fsync_path(tmp)
    return timing


def load_tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors of one safetensors file whose names start with ``prefix`` (prefix removed)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as e:  # safetensors raises its own SafetensorError for malformed headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def file_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def optim_state(ckpt: Path, file: str) -> dict[str, dict[str, torch.Tensor]]:
    """{'master'|'exp_avg'|'exp_avg_sq': {param name: fp32 tensor}} of head or body_optim."""
    tensors = load_tensors(ckpt / file)
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in OPTIM_KEYS}
    for key, t in tensors.items():
        kind, _, name = key.partition("/")
        if kind not in out:
            raise CheckpointError(f"{ckpt / file}: unexpected tensor {key!r}")
        out[kind][name] = t
    return out


def flatten_optim_state(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{kind}/{name}": t for kind, by_name in state.items() for name, t in by_name.items()}


def layer_weights(sources: dict[int, Path]) -> dict[str, torch.Tensor]:
    """fp32 weights of the given layers, each from its source checkpoint's layers file."""
    by_source: dict[Path, set[int]] = {}
    for layer, src in sources.items():
        by_source.setdefault(src, set()).add(layer)
    weights: dict[str, torch.Tensor] = {}
    for src, layers in by_source.items():
        meta = file_metadata(src / LAYERS)
        held = {int(k) for k in meta.get("layers", "").split(",") if k}
        if layers - held:
            raise CheckpointError(f"{src / LAYERS}: does not hold layers {sorted(layers - held)} its manifest lists")
        prefix = meta["layers_prefix"] + "."
        for name, t in load_tensors(src / LAYERS).items():
            if int(name[len(prefix):].split(".", 1)[0]) in layers:
                weights[name] = t
    return weights


def run_weights(run_dir: Path, ckpt: Path) -> dict[str, torch.Tensor]:
    """What a run's checkpoint changes over the base model: each layer's newest weights, then the head.

    All fp32. The base model itself is not included (see ``shard_tools.model.build_base_model``).
    """
    read_manifest(ckpt)
    weights = layer_weights(layer_sources(run_dir, ckpt))
    weights.update(optim_state(ckpt, HEAD)["master"])
    return weights
