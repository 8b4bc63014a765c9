"""What ``switch.py`` makes of a run: the summary of each way (steady step, per-switch overhead,
whether each successor was ready at its go, how its state came over, the overlap's device peak,
a waiting phase's host memory), table.md and switch.png; and ``compare``, one table over several
results folders (the handover on against off, 1 GPU against 2).

    python benchmarks/_switch_report.py compare OUT.md RESULTS_DIR...
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from _switch_gaps import table_rows

WAYS = {"a": "relayer", "b": "inprocess", "c": "naive"}
READY_SLACK = 0.005
"""Seconds a successor may finish preparing after its go was sent and still count as ready (the
journal's time is taken just after the go is written)."""


# -- summary -----------------------------------------------------------------------------------
def steady_step(steps: list[dict]) -> float:
    """The median step of the run, each phase's first step left out (steps 2..K of each phase)."""
    seen, steady = set(), []
    for s in steps:
        if s["phase"] in seen:
            steady.append(s["step_seconds"])
        seen.add(s["phase"])
    return statistics.median(steady or [s["step_seconds"] for s in steps])


def summarise(way: dict) -> dict:
    """Steady step, per-switch overhead and the first step's time, from records and metrics."""
    phases, steps = way["phases"], way["steps"]
    first_step = {}
    for s in steps:
        first_step.setdefault(s["phase"], s["step_seconds"])
    steady_s = steady_step(steps)
    extra = {(d["from"], d["to"]): d for d in way.get("switch_details", [])}
    switches = []
    for prev, nxt in zip(phases, phases[1:]):
        gap = nxt["t_first_step_end"] - prev["t_last_step_end"]
        switches.append({"from": prev["phase"], "to": nxt["phase"], "gap_seconds": gap,
                         "overhead_seconds": gap - steady_s, **extra.get((prev["phase"], nxt["phase"]), {})})
    for p in phases:
        p["first_step_seconds"] = first_step.get(p["phase"])
    overheads = [s["overhead_seconds"] for s in switches]
    return {"steady_step_seconds": steady_s, "switches": switches,
            "overhead_mean_seconds": statistics.mean(overheads) if overheads else None,
            "overhead_median_seconds": statistics.median(overheads) if overheads else None,
            "overhead_max_seconds": max(overheads) if overheads else None}


def go_times(journal: list[dict]) -> dict[int, float]:
    """When each pre-warmed phase got its go: the orchestrator journals phase_started right after
    writing it (on today's path once the predecessor is gone, with the handover once it offered)."""
    return {e["phase"]: e["time"] for e in journal if e["event"] == "phase_started" and e.get("prewarmed")}


def waiting_since(phase: dict, stages: list[dict]) -> float | None:
    """When a pre-warmed phase began to wait for its go: its "waiting for the go" stage where it
    says so, else the end of its preparation."""
    said = [s["time"] for s in stages if s.get("stage") == "waiting for the go"]
    return said[0] if said else phase.get("t_prepared")


def relayer_details(phases: list[dict], journal: list[dict], stages: dict[int, list[dict]], host, trace,
                    bare: dict | None) -> list[dict]:
    """Per switch: readiness at the go, the handover's path, the overlap's device peak; per phase
    (into ``phases``): the host USS and RSS peaks while it waited for its go, and those above a
    bare process's (``HostWatch`` says why both)."""
    gos = go_times(journal)
    for p in phases:
        k = p["phase"]
        since, go = waiting_since(p, stages.get(k, [])), gos.get(k)
        peak = host.peak(k, since, go) if host is not None and since and go and go > since else None
        for key in ("uss", "rss"):
            p[f"waiting_{key}_peak"] = peak[key] if peak else None
            p[f"waiting_{key}_over_bare"] = peak[key] - bare[key] if peak and bare else None
    out = []
    for a, b in zip(phases, phases[1:]):
        go = gos.get(b["phase"])
        # The worker's handover records: the successor's path and reason, the predecessor's answer.
        d = {"from": a["phase"], "to": b["phase"], "go_sent": go, "successor_prewarmed": go is not None,
             "handover": b.get("handover"), "handover_reason": b.get("handover_reason"),
             "predecessor_answer": a.get("handover_answer"), "predecessor_taken": a.get("handover_taken"),
             "t_offered": a.get("t_offered"), "t_answered": a.get("t_answered"), "t_taken": b.get("t_taken")}
        if d["t_offered"] and d["t_taken"]:
            d["offer_to_taken_seconds"] = d["t_taken"] - d["t_offered"]
        if go is not None and b.get("t_prepared"):
            late = b["t_prepared"] - go
            d["ready_at_go"] = late <= READY_SLACK
            d["late_seconds"] = max(0.0, late)
        if trace is not None and a.get("t_last_step_end") and b.get("t_first_step_end"):
            # Both alive: from the predecessor's last step to its exit or the successor's first step.
            d["device_peak"] = trace.peak(a["t_last_step_end"], max(b["t_first_step_end"], a.get("t_gone") or 0))
        out.append(d)
    return out


# -- table ---------------------------------------------------------------------------------------
def mem_main(m: dict) -> float:
    """The one number per memory sample that the plot and table lead with."""
    return m["allocated"] if "allocated" in m else m["rss"]


def fmt_mem(m: dict | float | None) -> str:
    if m is None:
        return "-"
    if isinstance(m, (int, float)):
        return f"{m / 1e6:.0f}"
    if "allocated" in m:
        return f"{m['allocated'] / 1e6:.0f} / {m['reserved'] / 1e6:.0f}"
    return f"{m['rss'] / 1e6:.0f}"


def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def fmt_load(load) -> str:
    return "-" if load is None else ", ".join(f"{x:.1f}" for x in load)


def header(result: dict) -> list[str]:
    names = [n for n in WAYS.values() if n in result["ways"]]
    cuda = result["device"] == "cuda"
    unit = "MB allocated / reserved (torch)" if cuda else "MB RSS of the phase's process"
    s, hw = result["shape"], result["hardware"]
    layers = sorted({len(p["layers"]) for p in s["phases"]})
    return [
        f"# Layer switch: {', '.join(names)} ({result['name']})", "",
        f"- date: {result['date']}",
        f"- hardware: {hw.get('gpu') or hw.get('gpu_nvml') or 'no GPU'}; CPU {hw['cpu']} "
        f"({hw['cpu_count']} cores); load average (1, 5, 15 min) at start "
        f"{fmt_load(result['load_average']['start'])}, at end {fmt_load(result['load_average'].get('end'))}",
        f"- {fmt(result['seconds_total'], '.0f')} s in all (making the base model, then the ways one after another)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
        f"- shape {s['name']}: Llama hidden {s['model']['hidden_size']}, {s['model']['num_hidden_layers']} layers, "
        f"intermediate {s['model']['intermediate_size']}, {s['model']['num_attention_heads']} heads "
        f"({s['model']['num_key_value_heads']} kv), vocab {s['model']['vocab_size']}; {s['dtype']}, "
        f"ZeRO-{s['zero_stage']}, {s.get('nproc', 1)} process(es), batch {s['batch_size']} "
        f"(micro {s['micro_batch_size']}) x {s['seq_len']} tokens; {len(s['phases'])} phases x "
        f"{s['phases'][0]['steps']} steps, {'/'.join(map(str, layers))} body layer(s) a phase (shape.layer_order "
        f"{s.get('layer_order', 'walk')}); relayer's handover {s.get('handover') or 'auto (default)'}, prewarm "
        f"{'off' if s.get('prewarm') is False else 'on'}, prewarm_depth {s.get('prewarm_depth') or 'default'}",
        f"- overhead = end of phase k+1's first step - end of phase k's last step - one steady step "
        f"(median of all but each phase's first step); memory in {unit}" + ("" if cuda else " (peak: RSS at the phase's end)"),
        *[f"- note: {n}" for n in result.get("notes", [])],
    ]


def way_rows(result: dict, names: list[str]) -> list[str]:
    lines = ["", "| way | steady step (s) | switch overhead: median (max) (s) | mean (s) | total wall (s) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for n in names:
        w = result["ways"][n]
        lines.append(f"| {n} | {w['steady_step_seconds']:.3f} | {fmt(w.get('overhead_median_seconds'))} "
                     f"({fmt(w.get('overhead_max_seconds'))}) | {fmt(w['overhead_mean_seconds'])} | "
                     f"{w['wall_seconds']:.1f} |")
    return lines


def switch_rows(result: dict, names: list[str]) -> list[str]:
    relayer = result["ways"].get("relayer")
    cols = ["ready at go (late s)", "path (offer -> taken s; reason)", "device peak MB (fullest GPU)"] if relayer else []
    lines = ["", "Switch overhead (s)" + (", and relayer's successor at its go:" if relayer else ":"), "",
             "| switch | " + " | ".join(names + [f"relayer {c}" for c in cols]) + " |",
             "| --- |" + " ---: |" * (len(names) + len(cols))]
    for i in range(len(result["shape"]["phases"]) - 1):
        cells = [f"{result['ways'][n]['switches'][i]['overhead_seconds']:.2f}" for n in names]
        if relayer:
            d = relayer["switches"][i]
            ready = d.get("ready_at_go")
            cells += ["-" if ready is None else f"{'yes' if ready else 'NO'} ({d.get('late_seconds', 0):.2f})",
                      f"{d.get('handover') or '-'}" + (f" ({d['offer_to_taken_seconds']:.3f})"
                                                       if d.get("offer_to_taken_seconds") is not None else "")
                      + (f" ({d['handover_reason']})" if d.get("handover_reason") else ""),
                      fmt(d["device_peak"] / 1e6 if d.get("device_peak") else None, ".0f")]
        lines.append(f"| {i} -> {i + 1} | " + " | ".join(cells) + " |")
    return lines


def memory_rows(result: dict, names: list[str]) -> list[str]:
    cuda = result["device"] == "cuda"
    unit = "MB allocated / reserved (torch)" if cuda else "MB RSS of the phase's process"
    relayer = "relayer" in result["ways"]
    extra = ["relayer waiting USS / RSS", "above bare USS / RSS"] if relayer else []
    lines = ["", f"Memory per phase ({unit}): at phase start / after the engine is built / peak"
             + ("; relayer's host USS / RSS (MB) while waiting for its go, and those above a bare phase process's"
                if relayer else "") + ":", "",
             "| phase | layers | " + " | ".join(f"{n} start | {n} engine | {n} peak" for n in names)
             + "".join(f" | {c}" for c in extra) + " |",
             "| ---: | ---: |" + " ---: | ---: | ---: |" * len(names) + " ---: |" * len(extra)]
    for k, ph in enumerate(result["shape"]["phases"]):
        cells = []
        for n in names:
            p = result["ways"][n]["phases"][k]
            cells += [fmt_mem(p["memory_start"]), fmt_mem(p["memory_engine"]), fmt_mem(p["memory_peak"])]
        if relayer:
            p = result["ways"]["relayer"]["phases"][k]
            cells += [f"{fmt_mem(p.get('waiting_uss_peak'))} / {fmt_mem(p.get('waiting_rss_peak'))}",
                      f"{fmt_mem(p.get('waiting_uss_over_bare'))} / {fmt_mem(p.get('waiting_rss_over_bare'))}"]
        lines.append(f"| {k} | {','.join(map(str, ph['layers']))} | " + " | ".join(cells) + " |")
    bare = result.get("bare_process")
    if bare:
        lines.append(f"\nA bare phase process (imports torch, deepspeed, transformers; CUDA initialised: "
                     f"{bare.get('cuda')}): USS {bare['uss'] / 1e6:.0f} MB, RSS {bare['rss'] / 1e6:.0f} MB. A phase "
                     "forked from relayer's fork server shares its imports copy-on-write: its USS leaves them out "
                     "(and can be below the bare one), its RSS counts them.")
    return lines


def device_rows(result: dict, names: list[str]) -> list[str]:
    lines = []
    checks = [(n, result["ways"][n]["device_between_phases"]) for n in names
              if "device_between_phases" in result["ways"][n]]
    if checks:
        lines += ["", "Device memory used by anything (NVML, the run's GPUs) once each phase's processes are gone: "
                      "MB used, compute processes on the devices (a pre-started successor counts), and how many of "
                      "them belong to the finished phase (must be 0):", "",
                  "| after phase | " + " | ".join(n for n, _ in checks) + " |", "| ---: |" + " ---: |" * len(checks)]
        for k in range(len(result["shape"]["phases"])):
            cells = []
            for _, samples in checks:
                hit = [x for x in samples if x["after_phase"] == k]
                cells.append(f"{hit[0]['used'] / 1e6:.0f} MB, {len(hit[0]['processes'])} procs, "
                             f"{len(hit[0].get('leftover', []))} left" if hit else "-")
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        before = result["ways"].get("relayer", {}).get("device_before")
        if before:
            lines.append(f"\nBefore relayer's run: {before['used'] / 1e6:.0f} MB used, "
                         f"{len(before['processes'])} compute processes.")
    plan = result.get("plan_estimate")
    relayer = result["ways"].get("relayer")
    if plan and relayer:
        peaks = [s["device_peak"] for s in relayer["switches"] if s.get("device_peak")]
        lines.append(f"\nOverlap peak (NVML, max over the switch windows, the fullest of the run's GPUs): "
                     f"{fmt(max(peaks) / 1e6 if peaks else None, '.0f')} MB; the plan's overlap estimate: "
                     f"{plan.get('overlap_text') or '-'}; the plan's largest phase: "
                     f"{fmt(plan['phase_max'] / 1e6 if plan.get('phase_max') else None, '.0f')} MB a process.")
    return lines


def probe_rows(result: dict) -> list[str]:
    """Each handed-over switch piece by piece (``_switch_gaps``), the stacks of late ones, relayer's plan."""
    relayer = result["ways"].get("relayer") or {}
    lines = table_rows(relayer.get("switch_gaps") or [])
    dumps = relayer.get("stall_dumps") or []
    if dumps:
        lines += ["", f"{len(dumps)} py-spy stack(s) of late switches in results.json (``stall_dumps``): "
                  + ", ".join(f"{d['who']} waiting for the {d['waiting_for']} of phase {d['offering_phase']} "
                              f"({d['late_seconds']} s late)" for d in dumps)]
    if relayer.get("plan_text"):
        lines += ["", "`orchestrator plan` of the schedule (against the device's memory):", "", "```",
                  *relayer["plan_text"].rstrip().splitlines()[-40:], "```"]
    return lines


def disk_rows(result: dict) -> list[str]:
    """relayer's checkpoint writes (checkpoint.every_seconds) and the most its run directory held."""
    d = (result["ways"].get("relayer") or {}).get("disk")
    if not d:
        return []
    every = result["shape"].get("every_seconds")
    return ["", f"relayer's checkpoints (checkpoint.every_seconds = {'default' if every is None else f'{every:g}'}): "
            f"{d['checkpoints_written']} written, {d['bytes_written'] / 1e9:.2f} GB in all, "
            f"{d['bytes_per_phase'] / 1e9:.3f} GB a phase, {d['bytes_per_second'] / 1e9:.3f} GB/s over the run; "
            f"the checkpoints folder held at most {d['peak_checkpoint_bytes'] / 1e9:.2f} GB, "
            f"the run directory {d['peak_run_dir_bytes'] / 1e9:.2f} GB"]


def table(result: dict) -> str:
    names = [n for n in WAYS.values() if n in result["ways"]]
    lines = header(result) + way_rows(result, names) + switch_rows(result, names) + memory_rows(result, names) \
        + disk_rows(result)
    return "\n".join(lines + device_rows(result, names) + probe_rows(result)) + "\n"


# -- plot ----------------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = result["ways"]
    names = [n for n in WAYS.values() if n in ways]
    cuda = result["device"] == "cuda"
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for i, key in enumerate(("memory_start", "memory_engine")):
        ax = axes[i]
        for n in names:
            ph = ways[n]["phases"]
            line, = ax.plot([p["phase"] for p in ph], [mem_main(p[key]) / 1e6 for p in ph], marker="o",
                            label=n + (" allocated" if cuda else ""))
            if cuda:
                ax.plot([p["phase"] for p in ph], [p[key]["reserved"] / 1e6 for p in ph], ls="--",
                        color=line.get_color(), label=f"{n} reserved")
        ax.set_title("memory at phase start" if key == "memory_start" else "memory after engine build")
        ax.set_xticks(range(len(result["shape"]["phases"])))
        ax.set_xlabel("phase")
        ax.set_ylabel("MB (torch, device)" if cuda else "MB (process RSS)")
        ax.legend(fontsize=8)
    ax = axes[2]
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        sw = ways[n]["switches"]
        ax.bar([s["from"] + (j - (len(names) - 1) / 2) * width for s in sw], [s["overhead_seconds"] for s in sw],
               width=width, label=n)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_title("switch overhead (beyond one steady step)")
    switches = range(len(result["shape"]["phases"]) - 1)
    ax.set_xticks(list(switches), [f"{k}->{k + 1}" for k in switches])
    ax.set_xlabel("switch")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    hw = result["hardware"].get("gpu") or result["hardware"]["cpu"]
    s = result["shape"]
    fig.suptitle(f"{result['name']}: {hw}, {s['dtype']}, ZeRO-{s['zero_stage']}, {s.get('nproc', 1)} process(es)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- several runs --------------------------------------------------------------------------------
def compare_row(result: dict) -> str:
    s, w = result["shape"], result["ways"].get("relayer")
    if w is None:
        return f"| {result['name']} | {s['name']} | {s.get('nproc', 1)} | - | (no relayer way) | | | | | |"
    sw = w["switches"]
    ready = [x.get("ready_at_go") for x in sw if x.get("ready_at_go") is not None]
    paths = sorted({x.get("handover") or "-" for x in sw})
    peaks = [x["device_peak"] for x in sw if x.get("device_peak")]
    waiting = [p["waiting_uss_over_bare"] for p in w["phases"] if p.get("waiting_uss_over_bare") is not None]
    waiting_rss = [p["waiting_rss_over_bare"] for p in w["phases"] if p.get("waiting_rss_over_bare") is not None]
    return (f"| {result['name']} | {s['name']} | {s.get('nproc', 1)} | {s.get('handover') or 'auto'} "
            f"| {fmt(w.get('overhead_median_seconds'))} ({fmt(w.get('overhead_max_seconds'))}) "
            f"| {w['steady_step_seconds']:.4f} | {sum(ready)}/{len(ready)} | {', '.join(paths)} "
            f"| {fmt(max(peaks) / 1e9 if peaks else None)} | {fmt(max(waiting) / 1e9 if waiting else None)} "
            f"/ {fmt(max(waiting_rss) / 1e9 if waiting_rss else None)} |")


def compare(folders: list[Path]) -> str:
    """One line per results folder: relayer's switches, steady step, readiness, path, peaks; and
    each inprocess way's growth per switch where there is one."""
    lines = ["| run | shape | nproc | handover | switch median (max) s | steady step s | ready at go "
             "| path | overlap peak GB | waiting above bare, max GB (USS / RSS) |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    results = []
    for f in folders:
        try:
            results.append(json.loads((f / "results.json").read_text()))
        except (OSError, ValueError) as e:
            lines.append(f"| {f.name} | (no results: {type(e).__name__}) | | | | | | | | |")
    lines += [compare_row(r) for r in results]
    for r in results:
        b = r["ways"].get("inprocess")
        if b:
            starts = [mem_main(p["memory_start"]) for p in b["phases"][1:]]
            growth = (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else None
            lines.append(f"\n{r['name']}: inprocess steady step {b['steady_step_seconds']:.4f} s, switch median "
                         f"{fmt(b.get('overhead_median_seconds'))} s; memory at phase start grows "
                         f"{fmt(growth / 1e9 if growth is not None else None)} GB per switch (phase 1 on).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "compare":
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    Path(sys.argv[2]).write_text(compare([Path(p) for p in sys.argv[3:]]))
