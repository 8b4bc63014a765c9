"""RUN_DIR/final: the finished run as a Hugging Face model folder, written by ``shard-tools export`` in
a subprocess (composing weights needs torch, which the orchestrator never imports).

The subprocess (an ``Exporter``) starts before the last checkpoint exists (with the last phase's
pre-warmed group, else at its go): it imports torch and transformers and builds the base model
then (7B: 13.5 GB read, seconds), and waits for its go until the last checkpoint is committed.
Without a go it exits having written nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

from orchestrator.errors import RelayerError
from orchestrator.estimate import DTYPE_BYTES, EstimateError, model_config, param_count
from orchestrator.phasespec import recorded_base
from orchestrator.rundir import entry_fault
from orchestrator.schedule import LoadedSchedule
from shard_tools.digest import folder_digests
from shard_tools.files import read_regular
from shard_tools.manifest import EXPORT_MARKER, EXPORT_TIMINGS, FINAL
from shard_tools.store import Checkpoints

EXPORTER = "from shard_tools.cli import main; main(prog_name='shard-tools')"
OUTPUT_LINES = 5
"""The exporter's last lines that a failure names (its message; never a whole traceback)."""
HOST_SHARE = 2
"""The base model is built ahead only where the host has this many times its size available: the
rest is for what the last phase and its pre-warmed neighbours still hold on the host."""


def base_ahead(loaded: LoadedSchedule) -> dict[str, Any] | None:
    """The base model the exporter builds ahead, as the phases record it (``extra.base_model``); None
    where its size is unknown or the host has not ``HOST_SHARE`` times it available (the exporter
    then builds it after the go)."""
    try:
        need = param_count(model_config(loaded)).total * DTYPE_BYTES[loaded.schedule.model.dtype]
    except (EstimateError, OSError, ValueError):
        return None
    if psutil.virtual_memory().available < HOST_SHARE * need:
        return None
    return recorded_base(loaded)


class Exporter:
    """``shard-tools export RUN_DIR --out RUN_DIR/final --force``, started ahead and waiting for its go."""

    def __init__(self, run_dir: Path, base: dict[str, Any] | None):
        self.log = tempfile.TemporaryFile()  # not a pipe: nobody reads it until the export is over
        cmd = [sys.executable, "-c", EXPORTER, "export", str(run_dir), "--out", str(run_dir / FINAL), "--force",
               "--wait-for-go", *(["--base-spec", json.dumps(base)] if base is not None else [])]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout: float) -> tuple[int, str]:
        """Its go; (exit code, output) once it is over (killed after ``timeout`` seconds)."""
        try:
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it died: its exit code and output say why
        late = ""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc, late = self.proc.wait(), f"\nthe export was killed after {timeout:.0f} s"
        self.log.seek(0)
        output = self.log.read().decode(errors="replace")
        self.log.close()
        return rc, output + late

    def cancel(self) -> None:
        """No go: killed at once (before its go it has written nothing, and a fault or a stop must not
        wait for its imports); an exporter whose orchestrator died sees EOF instead and exits."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.log.close()


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


def write_final(run_dir: Path, ahead: Exporter | None = None,
                timeout: float = 3600.0) -> tuple[Path, int, str, dict[str, Any]]:
    """Exports the run's newest whole checkpoint to RUN_DIR/final (replacing an older one whole, never
    half), by the exporter started ahead where it is alive, else a new one; returns (folder, exit code,
    the exporter's last lines, its stages' seconds). A link there is never written through (RelayerError)."""
    out = run_dir / FINAL
    fault = entry_fault(out)
    if ahead is not None and (fault or not ahead.alive()):  # not to be used, or it died waiting (a signal, OOM)
        ahead.cancel()
        ahead = None
    if fault:
        raise RelayerError(f"the run is complete, but {out}: {fault}; the checkpoints are intact")
    rc, output = (ahead or Exporter(run_dir, None)).finish(timeout)
    lines = output.strip().splitlines()
    timings = next((json.loads(line[len(EXPORT_TIMINGS):]) for line in lines if line.startswith(EXPORT_TIMINGS)), {})
    lines = [line for line in lines if not line.startswith(EXPORT_TIMINGS)]
    return out, rc, "\n".join(lines[-OUTPUT_LINES:]), timings
