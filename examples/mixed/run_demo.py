"""The mixed-data example end to end on CPU (about a minute and a half on 2 busy cores):

    .venv/bin/python examples/mixed/run_demo.py

Makes the conversations file and the Alpaca example's tiny Llama (once), shows the two sources as
the run sees them, plans and runs the LISA schedule with the real CLI (a fresh run each time) and
prints the held-out loss it logged.
"""

import json
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
    if not (HERE / "data" / "sharegpt.jsonl").exists():
        subprocess.run([sys.executable, str(HERE / "make_data.py")], check=True)
    if not (HERE / "model" / "config.json").exists():
        subprocess.run([sys.executable, str(HERE.parent / "alpaca" / "make_model.py"), str(HERE / "model")], check=True)
    run = HERE / "runs" / "mixed"
    shutil.rmtree(run, ignore_errors=True)  # the demo's own output: start it afresh each time
    step("orchestrator", "data", "schedule.toml", "--show", "1")
    step("orchestrator", "plan", "schedule.toml")
    step("orchestrator", "run", "schedule.toml")
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in x]
    print("\nheld-out loss: " + ", ".join(f"step {e['step']}: {e['eval_loss']:.3f}" for e in evals))
    print(f"run directory: {run}")


if __name__ == "__main__":
    main()
