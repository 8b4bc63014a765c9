"""The README of issue #29's results folder, made from what its steps wrote (``run_issue29.sh``):

    python benchmarks/_issue29_readme.py RESULTS_DIR [README.md]

RESULTS_DIR holds a folder per step that ran (peer7b: ``peer.py``'s results.json; lisa7b, big13,
big30: ``switch.py``'s). The README names the date, versions, hardware, every shape and its
``shape.layer_order``, the device command of each step, the numbers against the issue's targets,
and leaves the conclusions to be written (``TO WRITE``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _switch_report import mem_main

COMMAND = 'run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash benchmarks/run_issue29.sh {step}")'
SWITCH_STEPS = {"lisa7b": "7B switches under LISA's sampling", "big13": "13B (Llama-2-13B) on one H200",
                "big30": "the largest model one H200 holds (~30B)"}


def _load(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "results.json").read_text())
    except (OSError, ValueError):
        return None


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def header(results: dict[str, dict]) -> list[str]:
    first = next(iter(results.values()))
    hw, v = first["hardware"], first["versions"]
    gpu = hw.get("gpu") or hw.get("gpu_nvml") or "no GPU"
    return [f"# Issue #29 on one {gpu}: relayer beside the HF Trainer + LISA, 7B switches under LISA's sampling, "
            f"13B and ~30B ({first['date'][:10]})", "",
            f"- hardware: {gpu} ({_fmt(hw.get('gpu_memory_total', 0) / 2**20, '.0f')} MiB), CPU {hw['cpu']} "
            f"({hw['cpu_count']} cores), {hw['memory_total'] / 2**30:.0f} GiB host memory",
            "- versions: " + ", ".join(f"{k} {x}" for k, x in v.items()),
            "- every step on a lent machine of kind nvidia-h200, after `../shared/device/make-wheels.sh` and "
            "`benchmarks/peer-wheels.sh` filled `.whl/`; each step's command is below, its log and raw files in "
            "`results.tgz`", ""]


def peer_section(r: dict) -> list[str]:
    s, summ, peer = r["shape"], r["summary"], r["ways"]["peer"]
    t = summ["targets"]
    lines = ["## The peer, side by side (`peer7b`)", "", f"    {COMMAND.format(step='peer7b')}", "",
             f"Shape {s['name']} (hidden {s['model']['hidden_size']}, {s['model']['num_hidden_layers']} layers), "
             f"{s['dtype']}, batch {s['batch_size']} (micro {s['micro_batch_size']}) x {s['seq_len']}, lr {s['lr']}, "
             f"{s['total_steps']} steps, {s['layers_per_phase']} layers every {s['interval']} steps, seed {s['seed']}; "
             f"`shape.layer_order`: {s['layer_order']}, {len(s['phases'])} phases. The peer: the HF Trainer "
             f"({peer['optimizer']}) with the LISA callback {peer['callback']['name']} {peer['callback']['version'] or ''}"
             f" ({peer['callback']['how']}). Model in `{r['storage']['model']}`, outputs in `{r['storage']['outputs']}`.",
             "", "| way | whole job (s) | steady step (s) | peak allocated (GB) | growth first -> last phase (GB) | "
             "device peak (GB) | body state where a layer came back |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name in ("peer", "relayer"):
        w = summ[name]
        m = w["memory"]
        lines.append(f"| {name} | {w['wall_seconds']:.1f} | {_fmt(w['steady_step_seconds'], '.4f')} | "
                     f"{m['peak'] / 1e9:.2f} | {m['growth'] / 1e9:.2f} | {_fmt((m['device_peak'] or 0) / 1e9, '.1f')} | "
                     f"{w['body_state']} ({len(w['comebacks'])} comebacks) |")
    lines += ["", f"Targets at 7B: whole job {t['wall_ratio']:.3f} x the peer's (<= 1.05: "
                  f"{'met' if t['wall_met'] else 'NOT met'}), steady step {_fmt(t['steady_ratio'])} x (<= 1.03: "
                  f"{'met' if t['steady_met'] else 'NOT met'}), memory flat where the peer's grows: "
                  f"{'yes' if t['memory_flat_where_peer_grows'] else 'NO'}. Curves: `peer7b/peer.png`; per phase and "
                  "per comeback: `peer7b/table.md`.", "", "TO WRITE: what the side by side shows.", ""]
    return lines


def _switches(r: dict) -> dict:
    w = r["ways"]["relayer"]
    sw = w["switches"]
    ready = [x.get("ready_at_go") for x in sw if x.get("ready_at_go") is not None]
    starts = [mem_main(p["memory_start"]) for p in w["phases"][1:] if isinstance(p.get("memory_start"), dict)]
    peaks = [x["device_peak"] for x in sw if x.get("device_peak")]
    plan = r.get("plan_estimate", {}).get("overlaps") or []
    return {"median": w.get("overhead_median_seconds"), "max": w.get("overhead_max_seconds"), "n": len(sw),
            "ready": f"{sum(ready)}/{len(ready)}", "paths": sorted({x.get("handover") or "checkpoint" for x in sw}),
            "steady": w["steady_step_seconds"], "starts": starts, "nvml_peak": max(peaks) if peaks else None,
            "plan_peak": max(plan) if plan and isinstance(plan[0], (int, float)) else None,
            "causes": [c for g in w.get("switch_gaps") or [] for c in g["causes"]]}


def switch_section(step: str, r: dict) -> list[str]:
    s, x = r["shape"], _switches(r)
    flat = (max(x["starts"]) - min(x["starts"])) / 1e6 if x["starts"] else None
    both = " (or `big`: big13, then big30, in one command)" if step.startswith("big") else ""
    lines = [f"## {SWITCH_STEPS[step]} (`{step}`)", "", f"    {COMMAND.format(step=step)}{both}", "",
             f"Shape {s['name']} (hidden {s['model']['hidden_size']}, {s['model']['num_hidden_layers']} layers), "
             f"{s['dtype']}, ZeRO-{s['zero_stage']}, batch {s['batch_size']} (micro {s['micro_batch_size']}) x "
             f"{s['seq_len']}, {len(s['phases'])} phases x {s['phases'][0]['steps']} steps; `shape.layer_order`: "
             f"{s['layer_order']}; handover {s.get('handover') or 'auto'}, prewarm "
             f"{'off' if s.get('prewarm') is False else 'on'}, prewarm_depth {s.get('prewarm_depth') or 'default'}.",
             "", f"- switch overhead median {_fmt(x['median'])} s, max {_fmt(x['max'])} s over {x['n']} switches; "
                 f"steady step {x['steady']:.4f} s; successors ready at their go {x['ready']}; paths {', '.join(x['paths'])}",
             f"- memory at each phase start (phase 1 on; torch's allocated, RSS without a GPU): spread {_fmt(flat, '.0f')} MB; overlap peak NVML "
             f"{_fmt((x['nvml_peak'] or 0) / 1e9, '.1f')} GB against the plan's {_fmt((x['plan_peak'] or 0) / 1e9, '.1f')} GB",
             f"- `{step}/table.md` has each switch, its path, the plan's output and (handed-over switches) the offer "
             f"-> go -> read -> answer pieces with their causes; `{step}/breakdown.md` each switch's parts"]
    if step == "lisa7b":
        met = x["median"] is not None and x["median"] <= 0.17 and (x["max"] or 0) <= 0.35
        lines.append(f"- target (median <= 0.17 s, max <= 0.35 s, every successor ready): "
                     f"{'met' if met and x['ready'].split('/')[0] == x['ready'].split('/')[1] else 'NOT met'}")
        if x["causes"]:
            lines.append("- late pieces: " + "; ".join(sorted(set(x["causes"])))[:1500])
    return lines + ["", "TO WRITE: what the run shows.", ""]


def readme(folder: Path) -> str:
    results = {step: r for step in ("peer7b", *SWITCH_STEPS) if (r := _load(folder / step)) is not None}
    if not results:
        return "# Issue #29: no step has written results yet\n"
    lines = header(results)
    if "peer7b" in results:
        lines += peer_section(results["peer7b"])
    for step in SWITCH_STEPS:
        if step in results:
            lines += switch_section(step, results[step])
    missing = [s for s in ("peer7b", *SWITCH_STEPS) if s not in results]
    if missing:
        lines += ["## Not run", "", *(f"- `{s}`: {COMMAND.format(step=s)}" for s in missing), ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    text = readme(Path(argv[1]))
    if len(argv) > 2:
        Path(argv[2]).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
