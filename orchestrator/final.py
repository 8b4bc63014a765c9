"""RUN_DIR/final: the finished run as a Hugging Face model folder, written by ``shard-tools export`` in
a subprocess (composing weights needs torch, which the orchestrator never imports)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from shard_tools.manifest import EXPORT_MARKER, FINAL

EXPORTER = "from shard_tools.cli import main; main(prog_name='shard-tools')"


def is_current(run_dir: Path, step: int) -> bool:
    """Whether RUN_DIR/final already holds the weights of ``step`` (a complete run resumed again)."""
    try:
        return json.loads((run_dir / FINAL / EXPORT_MARKER).read_text())["global_step"] == step
    except (OSError, ValueError, KeyError, TypeError):
        return False


def write_final(run_dir: Path, timeout: float = 3600.0) -> tuple[Path, int, str]:
    """Exports the run's newest whole checkpoint to RUN_DIR/final (replacing an older one whole, never
    half); returns (folder, exit code, the exporter's output)."""
    out = run_dir / FINAL
    cmd = [sys.executable, "-c", EXPORTER, "export", str(run_dir), "--out", str(out), "--force"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return out, proc.returncode, (proc.stdout + proc.stderr).strip()
