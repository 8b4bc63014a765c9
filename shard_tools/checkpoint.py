"""Writing and reading checkpoint tensors (torch level): a checkpoint's files, whatever they hold
(``shard_tools.state`` says what a phase's checkpoint holds).

Writes are atomic at two levels: each file is written under the checkpoint's temporary directory,
the manifest (with sizes and sha256) is written last, and only then is the directory renamed to
``step-NNNNNNNN``. A killed writer leaves a ``.tmp-*`` directory that readers ignore.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import mmap
import os
import shutil
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from shard_tools import digest
from shard_tools.errors import CheckpointError
from shard_tools.files import TMP_PREFIX, describe, fsync_path, open_regular, regular_fault
from shard_tools.header import read_header
from shard_tools.manifest import MANIFEST, FileEntry, Manifest, checkpoints_dir, step_dir_name


class Written(NamedTuple):
    """What ``write_checkpoint`` wrote: the checkpoint dir, and the seconds it spent writing,
    fsyncing and waiting for hashes (by what)."""

    path: Path
    timing: dict[str, float]


def write_checkpoint(
    run_dir: Path,
    manifest: Manifest,
    files: dict[str, dict[str, torch.Tensor]],
    metadata: dict[str, dict[str, str]] | None = None,
    durable: bool = True,
    prepared: PreparedFiles | None = None,
    on_file_written: Callable[[str], None] | None = None,
) -> Written:
    """Writes ``files`` (file name -> tensors) and then the manifest; returns the checkpoint dir
    and the time spent (``Written``).

    ``durable=False`` leaves the fsyncs to the caller's process (``manifest.make_durable``): a
    phase-end checkpoint is made durable by the orchestrator while the next phase starts. Until
    then a crash of the machine can tear it, and the checksums tell.

    A damaged checkpoint already at the same step is moved aside (``step-N.damaged-<time>``), not
    deleted: a valid one there is an error, since a step is written once.

    ``prepared``: files made ahead (``PreparedFiles``); those that fit are written in place, and the
    prepared folder becomes the checkpoint. It is used up either way.

    ``on_file_written(name)`` is called after each file is written in full (the crash tests'
    fault point).
    """
    metadata = metadata or {}
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(manifest.global_step)
    fitting = {f for f, t in files.items() if prepared is not None and prepared.fits(f, t, metadata.get(f))}
    if fitting:
        tmp = prepared.dir
    else:
        if prepared is not None:
            prepared.discard()
            prepared = None
        tmp = root / f"{TMP_PREFIX}{final.name}.{os.getpid()}"
        tmp.mkdir(mode=0o750)
    try:
        timing = _write_files(tmp, manifest, files, metadata, durable, prepared, fitting, on_file_written)
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
    return Written(final, timing)


_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


def _layout(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None
            ) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """A safetensors file's leading bytes (size, JSON header padded to 8), each tensor's [start, end)
    in the file, and the file's size. The format is safetensors' documented one."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    spans, offset = {}, 0
    for name in sorted(specs):
        dtype, shape = specs[name]
        end = offset + math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        spans[name] = (offset, end)
        offset = end
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    lead = struct.pack("<Q", len(head)) + head
    return lead, {k: (len(lead) + a, len(lead) + b) for k, (a, b) in spans.items()}, len(lead) + offset


def _specs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _safetensors_stream(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> list[memoryview]:
    """The bytes of a safetensors file as views of the tensors themselves, no copy.

    ``safetensors.torch.save_file`` first builds the whole file in one buffer: an extra copy of
    every byte (1.5 GB for a 1.1B model's head) on the switch's critical path.
    """
    lead, _, _ = _layout(_specs(tensors), metadata)
    return [memoryview(lead), *(_bytes_of(tensors[name]) for name in sorted(tensors))]


class PreparedFiles:
    """A checkpoint's big files, made before the step they are written at.

    Writing 1.6 GB into new files costs more for the page cache's allocation than for the copy:
    0.54 s on the H200's host, however many threads write (a file's lock serialises them).
    Made ahead, while the phase prepares, in a temporary folder of the checkpoints directory
    (``.tmp-prepared.<pid>.<n>``: readers ignore it, the orchestrator removes it if the process
    dies), each file has its final size and header, and its pages are in the page cache and
    mapped writable (``MADV_POPULATE_WRITE``, so a full disk is an error now, not a SIGBUS later).
    ``views[file][tensor]`` are tensors over those pages: copying a tensor into its view writes
    it into the file. ``write_checkpoint(prepared=...)`` then only hashes (on all cores) and
    commits. Used once; what a write does not take is removed with it.
    """

    _made = 0

    def __init__(self, run_dir: Path, layouts: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]],
                 metadata: dict[str, dict[str, str]] | None = None):
        metadata = metadata or {}
        root = checkpoints_dir(run_dir)
        root.mkdir(parents=True, exist_ok=True)
        PreparedFiles._made += 1
        self.dir = root / f"{TMP_PREFIX}prepared.{os.getpid()}.{PreparedFiles._made}"
        self.dir.mkdir(mode=0o750)
        self.layouts = {file: (dict(specs), metadata.get(file)) for file, specs in layouts.items()}
        self.maps: dict[str, mmap.mmap] = {}
        self.views: dict[str, dict[str, torch.Tensor]] = {}
        try:
            for file, specs in layouts.items():
                lead, spans, size = _layout(specs, metadata.get(file))
                fd = os.open(self.dir / file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640)
                try:
                    os.ftruncate(fd, size)
                    mm = mmap.mmap(fd, size)
                    _populate(mm, fd)
                finally:
                    os.close(fd)
                mm[:len(lead)] = lead
                self.maps[file] = mm
                self.views[file] = {name: _view(mm, specs[name], start) for name, (start, _) in spans.items()}
        except OSError as e:
            self.discard()
            raise CheckpointError(f"{self.dir}: could not prepare the checkpoint's files ({e.strerror or e})") from e

    def fits(self, file: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bool:
        return file in self.views and self.layouts[file] == (_specs(tensors), metadata)

    def write(self, file: str, tensors: dict[str, torch.Tensor], pool: ThreadPoolExecutor) -> str:
        """Puts ``tensors`` into the file (a tensor already in its view is not copied); its digest."""
        views = self.views[file]
        for name, t in tensors.items():
            if t.data_ptr() != views[name].data_ptr() or t.numel() == 0:
                views[name].copy_(t)
        return digest.digest_buffer(memoryview(self.maps[file]), pool)

    def release(self) -> None:
        """Drops the views: the mappings go with the last tensor over them."""
        self.views, self.maps = {}, {}

    def discard(self) -> None:
        self.release()
        shutil.rmtree(self.dir, ignore_errors=True)


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _madvise(address: int, length: int, advice: int) -> int:
    """madvise(2) through ctypes, which frees the GIL meanwhile (``mmap.madvise`` holds it): 0, or
    the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_int(advice)) == 0:
        return 0
    return ctypes.get_errno()


def _madvise_mapping(mm: mmap.mmap, advice: int) -> int:
    """``_madvise`` over all of ``mm``."""
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return _madvise(ctypes.addressof(anchor), len(mm), advice)
    finally:
        del anchor  # the mapping may be closed once nothing exports it


def _populate(mm: mmap.mmap, fd: int) -> None:
    """Every page of a new file's mapping in the page cache, dirty and mapped writable
    (``populate_writable``). The GIL is free meanwhile: a phase does this in a thread."""
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    try:
        populated = populate_writable(whole)
    finally:
        del whole  # the mapping may be closed once nothing exports it
    if not populated:
        # An older kernel: write the file (errors are errors, not SIGBUS), then touch each page.
        zeros = bytes(digest.CHUNK)
        for offset in range(0, len(mm), digest.CHUNK):
            os.pwrite(fd, zeros[:len(mm) - offset], offset)
        for offset in range(0, len(mm), mmap.PAGESIZE):
            mm[offset] = 0


POPULATE_CHUNK = 32 << 20
"""The bytes one ``populate_writable`` call asks the kernel for at a time."""


def populate_writable(t: torch.Tensor, chunk: int = POPULATE_CHUNK) -> bool:
    """Every page under ``t`` (a shared file's mapping) in memory and mapped writable now, ``chunk``
    bytes a call (``MADV_POPULATE_WRITE``, the GIL free meanwhile), so that the copy that writes it
    later does not stop at every page; False where the kernel cannot (older than 5.14: the pages come
    as first written). In chunks, not at once (``MAP_POPULATE``): the process's mappings stay locked
    while the kernel fills a range, and another thread's allocation waited for all 4.7 GB of a 7B
    offer (the step it was in took 2.3 s instead of 0.47 on an H100,
    benchmarks/results/2026-12-07-issue42-h100-confirm)."""
    if err := _advise_pages(t, MADV_POPULATE_WRITE, chunk):
        if err != errno.EINVAL:
            raise OSError(err, os.strerror(err))
        return False
    return True


def _advise_pages(t: torch.Tensor, advice: int, chunk: int) -> int:
    """``advice`` over the pages under ``t``, ``chunk`` bytes a call: 0, or the first errno."""
    start, end = t.data_ptr() - t.data_ptr() % mmap.PAGESIZE, t.data_ptr() + t.nbytes
    for at in range(start, end, chunk):
        if err := _madvise(at, min(chunk, end - at), advice):
            return err
    return 0


def _view(mm: mmap.mmap, spec: tuple[torch.dtype, tuple[int, ...]], start: int) -> torch.Tensor:
    dtype, shape = spec
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=start).view(shape)


def _write_files(tmp: Path, manifest: Manifest, files: dict[str, dict[str, torch.Tensor]],
                 metadata: dict[str, dict[str, str]], durable: bool, prepared: PreparedFiles | None,
                 fitting: set[str], on_file_written: Callable[[str], None] | None) -> dict[str, float]:
    """Writes every file, hashing its bytes on all cores while they are written (those in
    ``fitting`` into ``prepared``'s); returns timings."""
    entries: dict[str, FileEntry] = {}
    timing = {"write": 0.0, "fsync": 0.0}
    with ThreadPoolExecutor(digest.THREADS) as pool:
        for name, tensors in files.items():
            path = tmp / name
            t0 = time.perf_counter()
            if name in fitting:
                checksum = prepared.write(name, tensors, pool)
                t1 = time.perf_counter()
                if durable:
                    fsync_path(path)
            else:
                if prepared is not None and name in prepared.views:  # made ahead for other tensors (still mapped)
                    path.unlink()
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
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
            if on_file_written is not None:
                on_file_written(name)
    if prepared is not None:
        for unused in set(prepared.views) - set(files):
            (tmp / unused).unlink()
        prepared.release()
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
    _check_regular(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as e:  # safetensors raises its own SafetensorError for malformed headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _check_regular(path: Path) -> None:
    """safe_open follows links and would wait on a FIFO: a checkpoint's files are regular files."""
    if fault := regular_fault(path, follow_symlinks=False):
        raise CheckpointError(f"{path}: {fault}")


def map_tensors(path: Path, populate: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a view of a private mapping of it: no copy.

    For the biggest file on the switch's critical path, the head, which its writer has just put in
    the page cache: mapping its pages (``MADV_POPULATE_READ``) takes a fraction of the time that
    copying 1.6 GB into host memory takes (``safe_open`` copies on one core). Copy-on-write: the
    file is never changed. A committed checkpoint is never rewritten; one cut short under the
    mapping would fault (SIGBUS) where a copy would fail, as with any mapped loader.
    ``populate=False``: the pages are mapped as they are first read, or by ``populate_pages``.
    """
    try:
        fd = open_regular(path, follow_symlinks=False)
    except OSError as e:
        raise CheckpointError(f"{path}: {describe(e, follow_symlinks=False)}") from None
    try:
        size = os.fstat(fd).st_size
        header, _ = read_header(fd, path)
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        unknown = sorted({v["dtype"] for v in header.values()} - _TORCH_DTYPES.keys())
        if unknown:
            raise CheckpointError(f"{path}: dtype {unknown[0]} is not one relayer writes")
        specs = {k: (_TORCH_DTYPES[v["dtype"]], tuple(v["shape"])) for k, v in header.items()}
        spans = {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in header.items()}
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    if populate:
        _madvise_mapping(mm, MADV_POPULATE_READ)  # an error (an older kernel): mapped as first read
    return {k: _view(mm, specs[k], start) for k, (start, _) in spans.items()}


def populate_pages(tensors: list[torch.Tensor]) -> None:
    """Maps the pages of tensors over ``map_tensors``' mappings now (``MADV_POPULATE_READ``), so
    that the copy that reads them later does not stop at every page. The GIL is free meanwhile:
    a thread can do it while the caller goes on, a chunk at a time (``populate_writable``). Does
    nothing where the kernel cannot."""
    for t in tensors:
        if t.numel() and t.device.type == "cpu":
            _advise_pages(t, MADV_POPULATE_READ, POPULATE_CHUNK)  # an error leaves the pages to their first read


def file_metadata(path: Path) -> dict[str, str]:
    _check_regular(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:  # safetensors raises its own SafetensorError for malformed headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
