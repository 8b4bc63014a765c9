"""The tiny example end to end, as ``make demo`` runs it (CPU, a few minutes):

    .venv/bin/python examples/tiny/run_demo.py

Makes the tiny Llama and its tokenizer (once), runs the 3-phase schedule with the real CLI
(a fresh run each time), which ends with the trained model as a Hugging Face folder in RUN_DIR/final,
verifies the checkpoints, and prints the commands to go on with, as they will work (the README's
"First run").
"""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # examples/_demo.py, what the demos share
from _demo import BIN, start, step  # noqa: E402


def main() -> None:
    run = start(HERE / "runs" / "tiny", {HERE / "model" / "config.json": [HERE / "make_model.py"]})
    step(HERE, "orchestrator", "plan", "schedule.toml")
    step(HERE, "orchestrator", "run", "schedule.toml")
    step(HERE, "shard-tools", "verify", str(run))
    step(HERE, "shard-tools", "inspect", str(run))
    print(f"\nrun directory: {here(run)}\nthe trained model (Hugging Face): {here(run / 'final')}")
    print(f"\nnext (as the README's \"First run\"): the tools are in {here(BIN)}/, so first\n"
          f"  source {here(BIN / 'activate')}")
    for command in next_commands(run):
        print(f"  {command}")
    print(f"or, without activating it: {here(BIN / 'orchestrator')} status {here(run)}")


def here(path: Path) -> str:
    """``path`` as the user, in the folder they ran make from, types it (links kept: a .venv that is
    a link is still ``.venv``)."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith(os.pardir) else relative


def next_commands(run: Path) -> list[str]:
    example = here(HERE)
    return [f"orchestrator status {here(run)}", f"orchestrator report {here(run)}",
            f"orchestrator plan {example}/schedule.toml",
            f"orchestrator run  {example}/schedule.toml --output-dir {example}/runs/mine "
            "--set 'schedule.phases=[{steps = 4, layers = [1]}]'"]


if __name__ == "__main__":
    main()
