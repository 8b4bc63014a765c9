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
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise BadFile(errno.EINVAL, f"{kind_of(mode)}, not a file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
