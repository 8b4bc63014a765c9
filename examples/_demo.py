"""What the examples' run_demo.py scripts share: the set-up before their run and the way they
show and run each relayer command. A demo puts this folder on sys.path to import it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
"""Where this Python's relayer commands are: the demo runs them without an activated venv."""


def start(run: Path, makers: dict[Path, list[Path]]) -> Path:
    """Sets a demo up on the CPU (unless DS_ACCELERATOR says otherwise): runs each maker script
    (``makers``: what it makes -> the script and its arguments) whose output is not there yet, so
    that data and models are made once, then removes ``run``, the demo's own output from an
    earlier time, so that the run starts afresh."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for made, command in makers.items():
        if not made.exists():
            subprocess.run([sys.executable, *map(str, command)], check=True)
    shutil.rmtree(run, ignore_errors=True)
    return run


def step(here: Path, *argv: str) -> None:
    """Runs the relayer command ``argv`` in the example's folder ``here``, shown first as typed."""
    print(f"\n$ {' '.join(argv)}", flush=True)
    subprocess.run([str(BIN / argv[0]), *argv[1:]], check=True, cwd=here)
