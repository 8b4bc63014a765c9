"""What ``prewarm.py`` and ``multinode_switch.py`` share: each times one schedule of a tiny Llama
(``--phases`` phases of ``--steps`` steps) several ways, on the CPU unless DS_ACCELERATOR says
otherwise, and writes result.json and result.md into ``--out``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def parse_args(doc: str) -> argparse.Namespace:
    """The options, described by the first line of the benchmark's docstring ``doc``; sets the CPU
    as the accelerator where nothing else is set."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phases", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return args
