"""The tiny example end to end, as ``make demo`` runs it (CPU, about a minute):

    .venv/bin/python examples/tiny/run_demo.py

Makes the tiny Llama and its tokenizer (once), runs the 3-phase schedule with the real CLI
(a fresh run each time), which ends with the trained model as a Hugging Face folder in RUN_DIR/final,
and verifies the checkpoints.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def step(*argv: str) -> None:
    print(f"\n$ {' '.join(argv)}", flush=True)
    subprocess.run([str(BIN / argv[0]), *argv[1:]], check=True, cwd=HERE)


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not (HERE / "model" / "config.json").exists():
        subprocess.run([sys.executable, str(HERE / "make_model.py")], check=True)
    run = HERE / "runs" / "tiny"
    shutil.rmtree(run, ignore_errors=True)  # the demo's own output: start it afresh each time
    step("orchestrator", "plan", "schedule.toml")
    step("orchestrator", "run", "schedule.toml")
    step("shard-tools", "verify", str(run))
    step("shard-tools", "inspect", str(run))
    print(f"\nrun directory: {run}\nthe trained model (Hugging Face): {run / 'final'}\n"
          f"look around: orchestrator status {run} | orchestrator report {run}")


if __name__ == "__main__":
    main()
