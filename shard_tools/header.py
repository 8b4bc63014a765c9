"""The safetensors header, read and checked without torch: what ``verify``, ``inspect``, the
mapped loader (``shard_tools.checkpoint.map_tensors``) and the control plane's model check
(``orchestrator.modelcheck``) read of a file before, or instead of, its tensors."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable

from shard_tools.errors import CheckpointError
from shard_tools.files import describe, open_regular

_MAX_HEADER = 100 << 20  # the safetensors library refuses larger headers too


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


def copy_tensors(src: Path, dst: int, keep: Callable[[str], bool], metadata: dict[str, str]) -> None:
    """Writes into the empty file ``dst`` (a descriptor) the tensors of the safetensors file
    ``src`` whose names ``keep`` accepts, byte for byte, with ``metadata`` as its __metadata__: a
    subset of a file without torch and without holding more than a chunk of it (retention trims a
    layers file this way). CheckpointError where ``src`` is not a whole safetensors file."""
    try:
        fd = open_regular(src, follow_symlinks=False)
    except OSError as e:
        raise CheckpointError(f"{src}: {describe(e, follow_symlinks=False)}") from None
    try:
        tensors, _ = read_header(fd, src)
        data_start = 8 + int.from_bytes(os.pread(fd, 8, 0), "little")
        kept = sorted(((n, e) for n, e in tensors.items() if keep(n)), key=lambda item: item[1]["data_offsets"][0])
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for name, entry in kept:
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            header[name] = {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # as the safetensors library pads it
        os.write(dst, len(raw).to_bytes(8, "little") + raw)
        for _, entry in kept:
            start, end = entry["data_offsets"]
            _copy_range(fd, dst, data_start + start, end - start)
    finally:
        os.close(fd)


def _copy_range(src: int, dst: int, offset: int, length: int, chunk: int = 64 << 20) -> None:
    while length > 0:
        block = os.pread(src, min(chunk, length), offset)
        if not block:
            raise OSError(f"the file ended {length} bytes early")
        view = memoryview(block)
        while view:
            view = view[os.write(dst, view):]
        offset, length = offset + len(block), length - len(block)
