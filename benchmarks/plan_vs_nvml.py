"""The plan's device memory against what NVML saw, per switch, for a run of ``benchmarks/peer.py``.

    python benchmarks/plan_vs_nvml.py RESULTS_DIR [--device-memory 81559MiB] [--out plan-vs-nvml.md]

RESULTS_DIR is peer.py's results folder (its results.json: the command, the phases, NVML's trace of
the device every 20 ms, each phase's records). The schedule relayer ran is written again from the
command (``peer.make_setup``, ``switch.write_schedule``) with the model's config inline, and
``orchestrator plan`` (in this process, no torch) gives each switch's planned overlap
(``PlanEstimate.overlaps``, the holder's copy included). A switch's NVML peak is the device's most
from the predecessor's last step to the later of its exit and the successor's first step (and 0.3 s
more). Where the switches go through host memory (a budget, ``--device-memory``), no switch overlaps
two phases on the device, and the run's NVML peak is set beside ``plan``'s budget line (the largest
phase's peak, ``budget.phase_peak``). Runs on a CPU: the results were measured on the device.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from orchestrator.budget import phase_peak  # noqa: E402
from orchestrator.estimate import estimate_plan, size_option  # noqa: E402
from orchestrator.handover import plan_switches  # noqa: E402
from orchestrator.plan import plan_phases  # noqa: E402
from orchestrator.validate import load_schedule  # noqa: E402

from _shapes import SHAPES  # noqa: E402
from peer import make_setup, parse  # noqa: E402
from switch import toml_value, write_schedule  # noqa: E402

AFTER = 0.3
"""Seconds after a switch's last mark its window still looks at (NVML's samples are 20 ms apart)."""


def schedule_of(result: dict, work: Path) -> Path:
    """The schedule of the run in ``result``, its model inline (``model.config``), its data a stand-in."""
    args = parse(result["command"][1:])
    shape = SHAPES[result["shape"]["name"]]
    setup = make_setup(args, shape, work, work, cuda=True)
    setup["phases"] = result["shape"]["phases"]
    data = work / "train.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(shape["seq_len"]))}) + "\n" for _ in range(8)))
    setup["data_path"] = str(data)
    path = work / "schedule.toml"
    write_schedule(path, setup)
    text = path.read_text().replace(f"path = {toml_value(setup['model_dir'])}\n",
                                    f"config = {toml_value(result['shape']['model'])}\n", 1)
    path.write_text(text)
    return path


def switch_peaks(way: dict) -> list[tuple[int, float, str | None]]:
    """Per switch (after phase k): k, NVML's peak in its window (bytes), how it went."""
    trace, phases = way["trace"], way["phases"]
    out = []
    for before, after in zip(phases, phases[1:]):
        start = before["t_last_step_end"]
        end = max(before.get("t_gone", start), after.get("t_first_step_end", start)) + AFTER
        out.append((before["phase"], max((u for t, u in trace if start <= t <= end), default=0), after.get("handover")))
    return out


def table(result: dict, device_memory: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_schedule(schedule_of(result, Path(tmp)))
        phases = plan_phases(loaded)
        estimate = estimate_plan(loaded, phases)
    planned = {s.after: s for s in plan_switches(loaded, phases, estimate, size_option(device_memory, "--device-memory"))}
    rows = ["| switch after phase | went | planned | planned overlap (GB) | NVML peak (GB) | planned / NVML |",
            "| ---: | --- | --- | ---: | ---: | ---: |"]
    peaks = switch_peaks(result["ways"]["relayer"])
    ratios = []
    for k, seen, went in peaks:
        plan = estimate.overlaps[k]
        ratios.append(plan / seen)
        way = "through host memory" if planned[k].host else "device" if planned[k].reason is None else "checkpoint"
        rows.append(f"| {k} | {went} | {way} | {plan / 1e9:.1f} | {seen / 1e9:.1f} | {plan / seen:.3f} |")
    peak = max(seen for _, seen, _ in peaks)
    rows.append("")
    rows.append(f"The run's largest switch: NVML {peak / 1e9:.1f} GB, planned {max(estimate.overlaps) / 1e9:.1f} GB "
                f"({max(estimate.overlaps) / peak:.3f}); per switch {min(ratios):.3f}-{max(ratios):.3f}.")
    if any(s.host for s in planned.values()):
        # No switch overlaps two phases on the device: the run's peak is the largest phase's, as
        # ``plan``'s budget line gives it (``budget.phase_peak``), against NVML's whole trace.
        phase = max(phase_peak(loaded, phases, estimate, i) for i in range(len(phases)))
        run = max(u for _, u in result["ways"]["relayer"]["trace"])
        rows.append(f"Through host memory, the run's peak: planned {phase / 2**30:.2f} GiB (a phase's most, `plan`'s "
                    f"budget line), NVML {run / 2**30:.2f} GiB over the whole run ({phase / run:.3f}).")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="peer.py's results folder (results.json)")
    ap.add_argument("--device-memory", default="81559MiB", help="the card's memory (default: an H100's, NVML's total)")
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args()
    result = json.loads((args.results / "results.json").read_text())
    dm = "" if args.device_memory == "81559MiB" else f" --device-memory {args.device_memory}"
    text = (f"# The plan against NVML: {result['name']} ({result['date']}, {result['hardware'].get('gpu_nvml', '?')})\n\n"
            f"`python benchmarks/plan_vs_nvml.py {args.results}{dm}` (the plan of this checkout)\n\n" + table(result, args.device_memory))
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
