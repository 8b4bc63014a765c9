"""Two runs of ``benchmarks/switch.py`` side by side (``benchmarks/run_ab.sh``: a base commit's code and
the checkout's on one GPU): per switch the device's NVML peak while both phases lived and the switch's
overhead, per phase torch's allocated peak, the run's NVML peak and the plan's overlaps, as a Markdown table.

    python benchmarks/ab_report.py RESULTS_DIR [--sides base,new] [--out ab.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GB = 1e9


def side(results: Path) -> dict:
    r = json.loads((results / "results.json").read_text())
    way = r["ways"]["relayer"]
    trace = [b for _, b in way.get("device_trace") or []]
    return {
        "relayer": r["versions"]["relayer"], "device": r["device"],
        "switch_peaks": [s.get("device_peak") for s in way["switches"]],
        "overheads": [s["overhead_seconds"] for s in way["switches"]],
        "handovers": [s.get("handover") for s in way["switches"]],
        "torch_peaks": [p.get("memory_peak") for p in way["phases"]],
        "median": way["overhead_median_seconds"], "max": way["overhead_max_seconds"],
        "steady": way["steady_step_seconds"], "wall": way["wall_seconds"],
        "run_peak": max([*trace, *[p or 0 for p in (s.get("device_peak") for s in way["switches"])]], default=None),
        "planned": r.get("plan_estimate", {}).get("overlaps"),
    }


def _gb(x) -> str:
    return "-" if x is None else f"{x / GB:.1f}"


def table(sides: dict[str, dict]) -> str:
    names = list(sides)
    rows = [("code", *(s["relayer"] for s in sides.values())), ("device", *(s["device"] for s in sides.values())),
            ("whole run (s)", *(f"{s['wall']:.1f}" for s in sides.values())),
            ("steady step (s)", *(f"{s['steady']:.4f}" for s in sides.values())),
            ("switch median / max (s)", *(f"{s['median']:.3f} / {s['max']:.3f}" for s in sides.values())),
            ("NVML peak of the run (GB)", *(_gb(s["run_peak"]) for s in sides.values())),
            ("NVML at the switches (GB)", *(", ".join(_gb(p) for p in s["switch_peaks"]) for s in sides.values())),
            ("planned overlaps (GB)", *(", ".join(_gb(p) for p in s["planned"] or []) for s in sides.values())),
            ("handed over", *(", ".join(str(h) for h in s["handovers"]) for s in sides.values())),
            ("torch's phase peaks (GB)", *(", ".join(_gb(p) for p in s["torch_peaks"]) for s in sides.values()))]
    lines = ["| | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--sides", default="base,new")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    text = table({name: side(args.results / name) for name in args.sides.split(",")})
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
