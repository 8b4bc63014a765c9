"""Weights & Biases reporting from a phase's rank 0 (``run.report_to = ["wandb"]``, the extra
``relayer[wandb]``). Every phase is a process of its own, so each one resumes the same W&B run,
named by the run directory; ``WANDB_MODE=offline`` writes it under RUN_DIR/wandb for ``wandb sync``."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from launch.contract.files import WANDB_TMP

KEYS = ("loss", "eval_loss", "lr", "tokens_per_s", "step_seconds")


def run_id(run_dir: Path) -> str:
    """One W&B run per run directory, the same in every phase process."""
    return "relayer-" + hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


class WandbReport:
    def __init__(self, run_dir: Path, phase: int, config: dict):
        # W&B makes folders in TMPDIR as it is imported (tmp*wandb-media, tmp*wandb-artifacts) and
        # removes them at interpreter exit, which a phase's os._exit skips: they go in a folder of
        # this process's, removed by ``finish``.
        self.tmp = tempfile.mkdtemp(prefix=f"{WANDB_TMP}{os.getpid()}.")
        before, tempfile.tempdir = tempfile.tempdir, self.tmp
        try:
            import wandb

            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "relayer"), id=run_id(run_dir),
                                  resume="allow", name=Path(run_dir).name, dir=str(run_dir), config=config,
                                  job_type=f"phase-{phase}")
        finally:
            tempfile.tempdir = before

    def log(self, record: dict) -> None:
        """The scalars, each source's evaluation loss, and the generations as a table."""
        import wandb

        logged = {k: v for k, v in record.items() if k in KEYS or k.startswith("eval_loss/")}
        if record.get("generations"):
            logged["generations"] = wandb.Table(columns=["prompt", "text"],
                                                data=[[g["prompt"], g["text"]] for g in record["generations"]])
        self.run.log(logged, step=record["step"])

    def finish(self) -> None:
        try:
            self.run.finish()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
