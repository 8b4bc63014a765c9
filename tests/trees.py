"""A folder's whole tree as a value, for the tests that check a command changed nothing in it:
what a run writes through, and what reading a damaged checkpoint leaves."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def snapshot(root: Path) -> dict[str, object]:
    """Every path under ``root`` with its bytes, link target or kind (FIFOs never opened)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            mode = p.lstat().st_mode
            out[str(p.relative_to(root))] = (os.readlink(p) if stat.S_ISLNK(mode) else p.read_bytes()
                                             if stat.S_ISREG(mode) else stat.S_IFMT(mode))
    return out
