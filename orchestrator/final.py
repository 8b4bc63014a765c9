"""RUN_DIR/final: the finished run as a Hugging Face model folder, written by ``shard-tools export`` in
a subprocess (composing weights needs torch, which the orchestrator never imports)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from orchestrator.errors import RelayerError
from orchestrator.rundir import entry_fault
from shard_tools.digest import folder_digests
from shard_tools.files import read_regular
from shard_tools.manifest import EXPORT_MARKER, FINAL
from shard_tools.store import Checkpoints

EXPORTER = "from shard_tools.cli import main; main(prog_name='shard-tools')"
OUTPUT_LINES = 5
"""The exporter's last lines that a failure names (its message; never a whole traceback)."""


def is_current(run_dir: Path, step: int) -> bool:
    """Whether RUN_DIR/final holds this run's export of its checkpoint at ``step``, unchanged (a
    complete run resumed again): its relayer.json names this run and that checkpoint, and its files
    are the ones it lists, with their sizes and checksums. Another run's final/, or one whose
    weights changed at the same step, is not."""
    folder = run_dir / FINAL
    if not folder.is_dir() or entry_fault(folder):
        return False
    try:
        marker = json.loads(read_regular(folder / EXPORT_MARKER, 1 << 20, follow_symlinks=False))
        ckpt = Checkpoints(run_dir).at(step)
        return (isinstance(marker, dict) and marker.get("run") == str(run_dir.resolve())
                and marker.get("checkpoint") == str(ckpt.resolve()) and marker.get("global_step") == step
                and marker.get("files") == folder_digests(folder, skip=EXPORT_MARKER))
    except (OSError, ValueError, RecursionError):
        return False


def write_final(run_dir: Path, timeout: float = 3600.0) -> tuple[Path, int, str]:
    """Exports the run's newest whole checkpoint to RUN_DIR/final (replacing an older one whole, never
    half); returns (folder, exit code, the exporter's last lines). A link there is never written
    through (RelayerError)."""
    out = run_dir / FINAL
    if fault := entry_fault(out):
        raise RelayerError(f"the run is complete, but {out}: {fault}; the checkpoints are intact")
    cmd = [sys.executable, "-c", EXPORTER, "export", str(run_dir), "--out", str(out), "--force"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return out, proc.returncode, "\n".join(lines[-OUTPUT_LINES:])
