"""Opening files that a disk holds, as untrusted input: regular files only, and never a hang.

A FIFO opened for reading blocks until a writer comes, so every open is non-blocking and the
kind is checked on the open descriptor (no race with a rename in between). Inside a checkpoint
a file is never followed through a symbolic link: its checksum would vouch for another file.
No torch here.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

SMALL_FILE = 64 << 20
"""The most ``read_regular`` is asked to take of a small record file (a spec, an answer, a reason)."""


class BadFile(OSError):
    """The path is there but is not a file this reader takes (a directory, a FIFO, too big)."""


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFLNK: "a symbolic link",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def kind_of(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path: Path, follow_symlinks: bool = True) -> int:
    """A read-only descriptor of ``path``, which must be a regular file; OSError otherwise.

    ``follow_symlinks=False``: a symbolic link is refused (ELOOP), not followed.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    return _regular(os.open(path, flags), path)


def _regular(fd: int, path: Path) -> int:
    """``fd`` (opened non-blocking, so that a FIFO or a device never blocks the open) in blocking
    mode, where it is a regular file; closed and BadFile otherwise."""
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise BadFile(errno.EINVAL, f"{kind_of(mode)}, not a file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: Path, mode: int = 0o640) -> int:
    """A descriptor appending to ``path``, made if missing, which must be a regular file of its
    own: a symbolic link is refused (ELOOP), not followed out of the folder, and a FIFO or a
    device is refused without blocking (``describe`` says why)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        # O_NOFOLLOW: ELOOP for any link; a FIFO without a reader: ENXIO instead of a block.
        kind = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a directory", errno.ENXIO: "a FIFO"}.get(e.errno)
        if kind is None:
            raise
        raise BadFile(e.errno, f"{kind}, not a file", str(path)) from None
    return _regular(fd, path)


def regular_fault(path: Path, follow_symlinks: bool = True) -> str | None:
    """Why ``path`` is not a regular file to read (without opening it), or None when it is."""
    try:
        st = os.stat(path, follow_symlinks=follow_symlinks)
    except OSError as e:
        return describe(e, follow_symlinks)
    return None if stat.S_ISREG(st.st_mode) else f"{kind_of(st.st_mode)}, not a file"


def describe(error: OSError, follow_symlinks: bool = True) -> str:
    """What an ``open_regular`` failure means, in words for a message that names the file."""
    if isinstance(error, BadFile):
        return error.strerror
    if isinstance(error, FileNotFoundError):
        return "missing"
    if error.errno == errno.ELOOP:
        return "a symbolic link loop" if follow_symlinks else "a symbolic link, not a file"
    return f"cannot read: {error.strerror or error}"


def read_regular(path: Path, limit: int, follow_symlinks: bool = True) -> bytes:
    """All of a regular file of at most ``limit`` bytes; OSError (``describe`` says why) otherwise."""
    fd = open_regular(path, follow_symlinks)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise BadFile(errno.EFBIG, f"{size} bytes, more than the {limit} this file can have",
                                 str(path))
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)[:limit]
    finally:
        os.close(fd)


TMP_PREFIX = ".tmp-"
"""What a temporary that a writer renames into place starts with; readers skip such names."""


def fsync_path(path: Path) -> None:
    """fsync of a file, or of a directory (which makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: str | bytes, mode: int = 0o640, durable: bool = True) -> None:
    """Writes ``data`` to a sibling temporary and renames it over ``path``: readers see the old file
    or the new one, never a torn one. ``durable`` fsyncs the file and its folder, so the new file
    survives a power cut; records that only live processes read skip that cost."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)


def write_new(path: Path, data: str, mode: int = 0o600) -> bool:
    """Writes ``path`` whole where no file is there yet; False where one is (it stays as it was):
    the first of several writers wins, and a reader never sees a torn file."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as f:
        f.write(data)
    try:
        os.link(tmp, path)  # never replaces
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
