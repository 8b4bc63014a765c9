"""File checksums that parallelise: sha256 over the sha256 digests of fixed 64 MiB chunks.

A plain sha256 of a 1.5 GB head file is ~0.8 s on one core and sits on the switch's critical
path; chunk digests are computed on all cores (hashlib and os.pread release the GIL), from the
tensors' memory while they are being written, and again from the file by ``verify``.
No torch here.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shard_tools.files import open_regular

CHUNK = 64 << 20
_READ = 8 << 20
THREADS = min(16, os.cpu_count() or 1)


def _combine(digests: list[bytes]) -> str:
    return hashlib.sha256(b"".join(digests)).hexdigest()


def _file_chunk(fd: int, offset: int, length: int) -> bytes:
    h = hashlib.sha256()
    end = offset + length
    while offset < end:
        block = os.pread(fd, min(_READ, end - offset), offset)
        if not block:
            break
        h.update(block)
        offset += len(block)
    return h.digest()


def digest_fd(fd: int, chunk: int = CHUNK) -> str:
    """The digest of an open file's bytes (the caller opened it and closes it)."""
    size = os.fstat(fd).st_size
    offsets = range(0, max(size, 1), chunk)
    with ThreadPoolExecutor(THREADS) as pool:
        digests = list(pool.map(lambda o: _file_chunk(fd, o, min(chunk, size - o)), offsets))
    return _combine(digests)


def digest_buffer(buf: memoryview, pool: ThreadPoolExecutor, chunk: int = CHUNK) -> str:
    """The digest of bytes in memory (a mapped file), a chunk a thread."""
    views = [buf[o:o + chunk] for o in range(0, max(len(buf), 1), chunk)]
    return _combine(list(pool.map(lambda v: hashlib.sha256(v).digest(), views)))


def chunk_pieces(buffers: list[memoryview], chunk: int = CHUNK) -> list[list[memoryview]]:
    """The byte stream ``buffers`` (concatenated) cut at multiples of ``chunk``, as slices."""
    chunks: list[list[memoryview]] = [[]]
    room = chunk
    for buf in buffers:
        while len(buf):
            take = min(room, len(buf))
            chunks[-1].append(buf[:take])
            buf, room = buf[take:], room - take
            if room == 0:
                chunks.append([])
                room = chunk
    if not chunks[-1] and len(chunks) > 1:
        chunks.pop()
    return chunks


def _write_and_hash(fd: int, offset: int, pieces: list[memoryview]) -> bytes:
    h = hashlib.sha256()
    for p in pieces:
        h.update(p)
        while len(p):
            n = os.pwrite(fd, p, offset)
            p, offset = p[n:], offset + n
    return h.digest()


def write_and_digest(fd: int, buffers: list[memoryview], pool: ThreadPoolExecutor, chunk: int = CHUNK) -> str:
    """Writes the concatenation of ``buffers`` to ``fd`` and returns its digest, a chunk a thread:
    copying into the page cache and hashing both scale with cores where one thread would not."""
    jobs, offset = [], 0
    for pieces in chunk_pieces(buffers, chunk):
        jobs.append(pool.submit(_write_and_hash, fd, offset, pieces))
        offset += sum(len(p) for p in pieces)
    return _combine([j.result() for j in jobs])


def folder_digests(folder: Path, skip: str = "",
                   known: dict[str, dict[str, int | str]] | None = None) -> dict[str, dict[str, int | str]]:
    """Each entry of ``folder`` but ``skip`` by name, with its size and digest; OSError where one is
    not a regular file of its own (a link is not followed). What an export's relayer.json records,
    so that a run tells its own final/ from a changed or another run's one. ``known``: digests of
    files hashed as they were written, taken where the size is still the same."""
    out: dict[str, dict[str, int | str]] = {}
    known = known or {}
    for f in sorted(Path(folder).iterdir()):
        if f.name == skip:
            continue
        fd = open_regular(f, follow_symlinks=False)
        try:
            size = os.fstat(fd).st_size
            was = known.get(f.name)
            out[f.name] = dict(was) if was and was["size"] == size else {"size": size, "sha256_chunked": digest_fd(fd)}
        finally:
            os.close(fd)
    return out
