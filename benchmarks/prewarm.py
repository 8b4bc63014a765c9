"""Wall time of one schedule with and without pre-warmed successors ([launch] prewarm).

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/prewarm.py --out benchmarks/results/prewarm-cpu-tiny

On the CPU it runs a tiny Llama over 6 phases of 4 steps (the case where process start dominates);
both runs must end with bitwise equal weights, which it checks. Writes result.json and result.md.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _tiny_schedule import parse_args

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def one_run(work: Path, model: Path, data: Path, prewarm: bool, phases: int, steps: int) -> dict:
    from tests.conftest import schedule_dict, write_schedule

    sched = write_schedule(work / f"prewarm-{prewarm}.toml", schedule_dict(
        model, data, run={"output_dir": f"run-{prewarm}"},
        schedule={"phases": [{"steps": steps, "layers": [i % 4]} for i in range(phases)]},
        launch={"prewarm": prewarm}))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", "from orchestrator.cli import main; main()", "run", str(sched)],
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(r.stderr)
    run = work / f"run-{prewarm}"
    events = [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]
    done = [e["records"] for e in events if e["event"] == "phase_done"]
    switches = [b["t_first_step_end"] - a["t_last_step_end"] - b["step_seconds_median"] for a, b in zip(done, done[1:])]
    return {"prewarm": prewarm, "wall_seconds": wall, "switch_overhead_seconds": switches, "run": run}


def main() -> None:
    args = parse_args(__doc__)
    from tests.conftest import make_llama, make_tokens
    from tests.reference import bitwise_equal, composed

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, data = make_llama(work / "model"), make_tokens(work / "train.jsonl")
        cold = one_run(work, model, data, False, args.phases, args.steps)
        warm = one_run(work, model, data, True, args.phases, args.steps)
        equal = bitwise_equal(composed(model, cold.pop("run")), composed(model, warm.pop("run")))
    import torch

    result = {
        "date": datetime.date.today().isoformat(), "host": platform.node(), "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "phases": args.phases, "steps_per_phase": args.steps, "cold": cold, "warm": warm,
        "ratio_warm_over_cold": warm["wall_seconds"] / cold["wall_seconds"], "bitwise_equal": equal,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    (args.out / "result.md").write_text(
        f"# prewarm on/off, {result['date']}, {result['cores']} cores, torch {result['torch']}\n\n"
        f"| | wall (s) | median switch overhead (s) |\n|---|---|---|\n"
        f"| cold (prewarm = false) | {cold['wall_seconds']:.1f} | {med(cold['switch_overhead_seconds']):.2f} |\n"
        f"| pre-warmed | {warm['wall_seconds']:.1f} | {med(warm['switch_overhead_seconds']):.2f} |\n\n"
        f"ratio warm / cold: {result['ratio_warm_over_cold']:.2f}; final weights bitwise equal: {equal}\n")
    print((args.out / "result.md").read_text())


if __name__ == "__main__":
    main()
