"""What ``peer.py`` makes of its two runs: per way the whole job's wall time and its parts, the
steady step, the loss curve, device memory over time and per phase, whether the body's optimizer
state was reset where a layer came back; the issue's targets; table.md and peer.png."""

from __future__ import annotations

import statistics
from pathlib import Path

from _switch_report import fmt, fmt_load, mem_main

WAYS = ("peer", "relayer")
FLAT = 0.02
"""A way's memory is flat where its phases' peaks (after the first) stay within 2% of each other."""


def steady_step(steps: list[dict]) -> float | None:
    """The median step, each phase's first left out."""
    seen, steady = set(), []
    for s in steps:
        if s["phase"] in seen:
            steady.append(s["step_seconds"])
        seen.add(s["phase"])
    return statistics.median(steady) if steady else None


def verdict(comebacks: list[dict]) -> str:
    """reset: the Adam step of a layer that came back counts only its new phase's steps; kept: it
    counts every step the layer ever trained."""
    if not comebacks or any(c["adam_step_end"] is None for c in comebacks):
        return "no layer came back" if not comebacks else "unknown (a manifest was not seen)"
    if all(c["adam_step_end"] == c["steps_in_phase"] for c in comebacks):
        return "reset"
    if all(c["adam_step_end"] == c["trained_before"] + c["steps_in_phase"] for c in comebacks):
        return "kept"
    return "mixed"


def peer_comebacks(phases: list[dict]) -> list[dict]:
    out = []
    for p in phases:
        for layer, start in p["at_start"].items():
            if start["trained_before"] > 0:
                out.append({"phase": p["phase"], "layer": int(layer), "steps_in_phase": p["steps"],
                            "trained_before": start["trained_before"], "adam_step_start": start["adam_step"],
                            "exp_avg_abs_sum_start": start["exp_avg_abs_sum"],
                            "adam_step_end": p["at_end"][layer]["adam_step"]})
    return out


def relayer_comebacks(phases: list[dict], manifests: dict) -> list[dict]:
    by_step = {m["global_step"]: m for m in manifests.values() if m.get("phase_complete")}
    trained: dict[int, int] = {}
    end, out = 0, []
    for p in phases:
        end += p["steps"]
        body = by_step.get(end, {}).get("body_step")
        for layer in p["layers"]:
            if trained.get(layer, 0) > 0:
                out.append({"phase": p["phase"], "layer": layer, "steps_in_phase": p["steps"],
                            "trained_before": trained[layer], "adam_step_end": body})
        for layer in p["layers"]:
            trained[layer] = trained.get(layer, 0) + p["steps"]
    return out


def _window_peak(trace: list, t0: float, t1: float) -> int | None:
    inside = [u for t, u in trace if t0 <= t <= t1]
    return max(inside) if inside else None


def memory(phases: list[dict], steps: list[dict], trace: list) -> dict:
    """Per phase: torch's at its start and its peak, the device's (NVML; RSS without a GPU) peak
    over its steps; and how the peaks grew from the first phase to the last."""
    rows = []
    for p in phases:
        times = [s["time"] for s in steps if s["phase"] == p["phase"]]
        device = _window_peak(trace, min(times) - 0.5, max(times)) if times else None
        rows.append({"phase": p["phase"], "layers": p["layers"], "start": mem_main(p["memory_start"]),
                     "peak": p["memory_peak"], "device_peak": device})
    peaks = [r["peak"] for r in rows[1:]] or [r["peak"] for r in rows]
    device = [r["device_peak"] for r in rows if r["device_peak"]]
    return {"phases": rows, "peak": max(peaks), "device_peak": max(u for _, u in trace) if trace else None,
            "growth": rows[-1]["peak"] - rows[0]["peak"], "device_growth": device[-1] - device[0] if device else None,
            "flat": (max(peaks) - min(peaks)) <= FLAT * max(peaks)}


def parts(name: str, w: dict) -> dict:
    """Where the whole job's wall time went, from the command on."""
    if name == "peer":
        t = w["times"]
        return {"start (imports)": t["t_imported"] - w["t_command"], "load the model": t["t_loaded"] - t["t_imported"],
                "trainer set-up": t["t_train_begin"] - t["t_loaded"], "train": t["t_trained"] - t["t_train_begin"],
                "save the model": t["t_saved"] - t["t_trained"]}
    ev = {e["event"]: e["time"] for e in w["journal"]}
    first, last = w["phases"][0], w["phases"][-1]
    return {"to the first step": first["t_first_step_end"] - w["t_command"],
            "train (first step to last)": last["t_last_step_end"] - first["t_first_step_end"],
            "to the final model": ev.get("final_model_written", last["t_last_step_end"]) - last["t_last_step_end"]}


def summarise(result: dict) -> dict:
    out = {}
    for name in WAYS:
        w = result["ways"][name]
        trace = [(t, u) for t, u in w["trace"]]
        comebacks = peer_comebacks(w["phases"]) if name == "peer" else relayer_comebacks(w["phases"], w["manifests"])
        out[name] = {"wall_seconds": w["wall_seconds"], "parts": parts(name, w), "steady_step_seconds": steady_step(w["steps"]),
                     "loss": [[s["step"], s.get("loss")] for s in w["steps"]], "memory": memory(w["phases"], w["steps"], trace),
                     "trace": coarse(trace, w["t_command"]), "comebacks": comebacks, "body_state": verdict(comebacks)}
    p, r = out["peer"], out["relayer"]
    out["targets"] = {
        "wall_ratio": r["wall_seconds"] / p["wall_seconds"], "wall_met": r["wall_seconds"] <= 1.05 * p["wall_seconds"],
        "steady_ratio": (r["steady_step_seconds"] / p["steady_step_seconds"]
                         if r["steady_step_seconds"] and p["steady_step_seconds"] else None),
        "memory_flat_where_peer_grows": r["memory"]["flat"] and p["memory"]["growth"] > 0}
    ratio = out["targets"]["steady_ratio"]
    out["targets"]["steady_met"] = ratio is not None and ratio <= 1.03
    return out


def coarse(trace: list, t0: float, seconds: float = 0.5) -> list[list[float]]:
    bins: dict[int, int] = {}
    for t, u in trace:
        k = int((t - t0) / seconds)
        bins[k] = max(bins.get(k, 0), u)
    return [[round(k * seconds, 2), u] for k, u in sorted(bins.items())]


# -- table and plot ----------------------------------------------------------------------------------
def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.0f}"


def table(result: dict) -> str:
    s, hw, summ = result["shape"], result["hardware"], result["summary"]
    peer = result["ways"]["peer"]
    lines = [f"# The LISA job two ways ({result['name']})", "",
             f"- date: {result['date']}; {fmt(result['seconds_total'], '.0f')} s in all",
             f"- hardware: {hw.get('gpu') or hw.get('gpu_nvml') or 'no GPU'}; CPU {hw['cpu']} ({hw['cpu_count']} cores); "
             f"load average at start {fmt_load(result['load_average']['start'])}, at end "
             f"{fmt_load(result['load_average'].get('end'))}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
             f"- shape {s['name']}: Llama hidden {s['model']['hidden_size']}, {s['model']['num_hidden_layers']} layers, "
             f"vocab {s['model']['vocab_size']}; {s['dtype']}; batch {s['batch_size']} (micro {s['micro_batch_size']}) x "
             f"{s['seq_len']} tokens; lr {s['lr']} constant; {s['total_steps']} steps, {s['layers_per_phase']} layers "
             f"every {s['interval']} steps; seed {s['seed']}; shape.layer_order: {s['layer_order']}",
             f"- the peer: Hugging Face Trainer, optimizer {peer['optimizer']}, LISA callback {peer['callback']['name']} "
             f"{peer['callback']['version'] or ''} ({peer['callback']['how']})",
             f"- relayer: `orchestrator run` on the peer's {len(s['phases'])} phases (deepspeed.zero_stage "
             f"{s.get('zero_stage') if s.get('zero_stage') is not None else 'unset: relayer chose'}, 1 process, handover "
             "relayer's default unless given)",
             f"- model in {result['storage']['model']}; trained models and relayer's run in {result['storage']['outputs']}",
             f"- command: `{' '.join(result['command'])}`", "",
             "| way | whole job (s) | steady step (s) | peak allocated (MB) | growth first -> last phase (MB) | "
             "device peak (MB) | body state where a layer came back |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name in WAYS:
        w = summ[name]
        lines.append(f"| {name} | {w['wall_seconds']:.1f} | {fmt(w['steady_step_seconds'], '.4f')} | "
                     f"{_mb(w['memory']['peak'])} | {_mb(w['memory']['growth'])} | {_mb(w['memory']['device_peak'])} | "
                     f"{w['body_state']} ({len(w['comebacks'])} comebacks) |")
    t = summ["targets"]
    lines += ["", f"Targets: relayer's whole job {t['wall_ratio']:.3f} x the peer's (at most 1.05: "
                  f"{'met' if t['wall_met'] else 'NOT met'}); steady step {fmt(t['steady_ratio'], '.3f')} x "
                  f"(at most 1.03: {'met' if t['steady_met'] else 'NOT met'}); memory flat where the peer's grows: "
                  f"{'yes' if t['memory_flat_where_peer_grows'] else 'NO'}.", ""]
    lines += [f"Where the whole job's time went ({name}): " + ", ".join(f"{k} {v:.1f} s" for k, v in summ[name]["parts"].items())
              for name in WAYS]
    stages = next((e.get("seconds") for e in result["ways"]["relayer"]["journal"] if e["event"] == "final_model_written"),
                  None)
    if stages:  # the export's own account (orchestrator.final): the final model's stages
        lines += ["The final model's export (relayer): " + ", ".join(
            f"{k} {v:.1f} s" if isinstance(v, float) else f"{k} {v}" for k, v in stages.items())]
    lines += _phase_rows(result)
    return "\n".join(lines) + "\n"


def _phase_rows(result: dict) -> list[str]:
    summ = result["summary"]
    lines = ["", "Per phase: torch's allocated MB at its start / its peak, the device's peak over its steps "
                 "(NVML; RSS without a GPU):", "", "| phase | layers | steps | peer start / peak / device | "
                 "relayer start / peak / device |", "| ---: | --- | ---: | ---: | ---: |"]
    for p, r, ph in zip(summ["peer"]["memory"]["phases"], summ["relayer"]["memory"]["phases"], result["shape"]["phases"]):
        lines.append(f"| {p['phase']} | {','.join(map(str, ph['layers']))} | {ph['steps']} | {_mb(p['start'])} / "
                     f"{_mb(p['peak'])} / {_mb(p['device_peak'])} | {_mb(r['start'])} / {_mb(r['peak'])} / "
                     f"{_mb(r['device_peak'])} |")
    lines += ["", "Layers that came back (Adam's step where their phase ends; reset: the new phase's steps only):", "",
              "| way | phase | layer | trained before | steps in phase | Adam step at the end |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in WAYS:
        for c in summ[name]["comebacks"]:
            lines.append(f"| {name} | {c['phase']} | {c['layer']} | {c['trained_before']} | {c['steps_in_phase']} | "
                         f"{c['adam_step_end']} |")
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ, cuda = result["summary"], result["device"] == "cuda"
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for name, color in zip(WAYS, ("tab:blue", "tab:orange")):
        w = summ[name]
        loss = [(s, v) for s, v in w["loss"] if v is not None]
        axes[0].plot([s for s, _ in loss], [v for _, v in loss], label=name, lw=1, color=color)
        axes[1].plot([t for t, _ in w["trace"]], [u / 1e9 for _, u in w["trace"]], label=name, lw=1, color=color)
        ph = w["memory"]["phases"]
        axes[2].plot([p["phase"] for p in ph], [p["peak"] / 1e9 for p in ph], marker="o", color=color,
                     label=f"{name} peak")
        axes[2].plot([p["phase"] for p in ph], [p["start"] / 1e9 for p in ph], ls="--", color=color,
                     label=f"{name} at start")
    axes[0].set(title="loss", xlabel="step", ylabel="loss")
    axes[1].set(title="device memory used (NVML)" if cuda else "RSS of the processes", xlabel="seconds from the command",
                ylabel="GB")
    axes[2].set(title="per phase (torch allocated)" if cuda else "per phase (RSS)", xlabel="phase", ylabel="GB")
    for ax in axes:
        ax.legend(fontsize=8)
    s = result["shape"]
    fig.suptitle(f"{result['name']}: {result['hardware'].get('gpu') or result['hardware']['cpu']}, {s['dtype']}, "
                 f"{s['total_steps']} steps, {s['layers_per_phase']} layers every {s['interval']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def alone(w: dict) -> dict:
    """relayer's way without the peer (``--skip-peer``, or the peer failed): how far it got, its
    steady step, and per switch (from each phase's records) the overhead and its pieces: the go
    after the predecessor's last step, the engine built, the state restored, the first step."""
    steady = steady_step(w["steps"])
    switches = []
    for before, after in zip(w["phases"], w["phases"][1:]):
        t_last = before["t_last_step_end"]
        switches.append({"to_phase": after["phase"], "threads": after.get("threads"),
                         "overhead": after["t_first_step_end"] - t_last - (steady or 0.0),
                         "go": after.get("t_go", t_last) - t_last,
                         "engine_built": after.get("t_engine_built", 0) - after.get("t_go", 0),
                         "restored": after.get("t_restored", 0) - after.get("t_engine_built", 0),
                         "first_step": after.get("first_step_seconds")})
    overheads = sorted(s["overhead"] for s in switches)
    return {"finished": w.get("finished", True), "wall_seconds": w["wall_seconds"],
            "steps_done": max((s["step"] for s in w["steps"] if "loss" in s), default=0),
            "phases_done": len(w["phases"]), "steady_step_seconds": steady,
            "threads": [p.get("threads") for p in w["phases"]], "torch_peaks": [p.get("memory_peak") for p in w["phases"]],
            "device_peak": max((u for _, u in w["trace"]), default=None),
            "switch_median_seconds": statistics.median(overheads) if overheads else None, "switches": switches}
