"""The mixed-data example end to end on CPU (about a minute and a half on 2 busy cores):

    .venv/bin/python examples/mixed/run_demo.py

Makes the conversations file and the Alpaca example's tiny Llama (once), shows the two sources as
the run sees them, plans and runs the LISA schedule with the real CLI (a fresh run each time) and
prints the held-out loss it logged.
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # examples/_demo.py, what the demos share
from _demo import start, step  # noqa: E402


def main() -> None:
    run = start(HERE / "runs" / "mixed", {
        HERE / "data" / "sharegpt.jsonl": [HERE / "make_data.py"],
        HERE / "model" / "config.json": [HERE.parent / "alpaca" / "make_model.py", HERE / "model"]})
    step(HERE, "orchestrator", "data", "schedule.toml", "--show", "1")
    step(HERE, "orchestrator", "plan", "schedule.toml")
    step(HERE, "orchestrator", "run", "schedule.toml")
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in x]
    print("\nheld-out loss: " + ", ".join(f"step {e['step']}: {e['eval_loss']:.3f}" for e in evals))
    print(f"run directory: {run}")


if __name__ == "__main__":
    main()
