"""Where each relayer switch of a ``benchmarks/switch.py`` run went, from the phases' records.

    python benchmarks/breakdown.py benchmarks/results/DATE-nvidia-h200/      # writes breakdown.md there

Per switch k -> k+1, in the order they happen (seconds):

- end: phase k's last step -> its processes gone (gather to the host, write, exit); of it: gather,
  write (what of the hash was left after the gather, and the commit), exit (the end of the save ->
  the last rank reaped by the fork server: mostly the device's teardown) and reaped -> gone (the
  orchestrator seeing it);
- gone -> go read: the orchestrator's go, as read by phase k+1 (later when k+1 was still preparing,
  or still reading phase k's checkpoint, which it starts at the commit); "-" where k+1 read its go
  before k was gone (handed over on the device: the go comes at the offer, and the switch's
  table has its offer -> go -> answer pieces) or was not prepared when k was gone (a cold start:
  its imports and model load are in no column, only in the overhead);
- engine: k+1 building its engine; of it: weights to the device (the rest is ``deepspeed.initialize``);
- restore: injecting the head's optimizer state; of it: waiting for the head's moments to be mapped;
- first: k+1's first step;
- preparing: how many later phases were still preparing (warm-up etc.) during the switch;
- paused: how many of the later phases the orchestrator paused for the switch (``orchestrator.quiet``);
- overhead: as switch.py counts it (gap - one steady step).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(result: dict) -> list[str]:
    phases = result["phases"]
    out = ["| switch | end | (gather | write | exit | reaped -> gone) | gone -> go read | early read | engine "
           "| (to device) | restore | (populate wait) | first step | preparing | paused | overhead |",
           "| --- |" + " ---: |" * 16]
    pauses = [e for e in result.get("journal", []) if e["event"] == "preparing_paused"]
    overhead = {(s["from"], s["to"]): s["overhead_seconds"] for s in result["switches"]}
    for a, b in zip(phases, phases[1:]):
        t = lambda p, k: p.get(k) or 0.0  # noqa: E731

        def span(p, k0, q, k1) -> str:  # "-" where a record lacks a time (older results)
            return f"{t(q, k1) - t(p, k0):.2f}" if p.get(k0) and q.get(k1) else "-"

        ck = (a.get("checkpoints") or [{}])[-1]
        window = (t(a, "t_last_step_end"), t(b, "t_first_step_end"))
        preparing = sum(1 for p in phases[b["phase"] + 1:]
                        if p.get("t_prepared") and p["t_process_start"] < window[1] and p["t_prepared"] > window[0])
        early = t(b, "t_early_read_end") - t(b, "t_early_read_start")
        paused = sum(len(e["phases"]) for e in pauses if t(a, "t_first_step_end") < e["time"] < t(a, "t_gone"))
        out.append(
            f"| {a['phase']} -> {b['phase']} | {t(a, 't_gone') - t(a, 't_last_step_end'):.2f} "
            f"| {ck.get('gather_seconds', 0):.2f} | {ck.get('write_seconds', 0):.2f} "
            f"| {span(a, 't_saved', a, 't_reaped')} | {span(a, 't_reaped', a, 't_gone')} "
            f"| {go_after_gone(a, b)} | {f'{early:.2f}' if early else '-'} "
            f"| {t(b, 't_engine_built') - t(b, 't_delta_loaded'):.2f} | {span(b, 't_delta_loaded', b, 't_on_device')} "
            f"| {t(b, 't_restored') - t(b, 't_engine_built'):.2f} | {span(b, 't_engine_built', b, 't_head_populated')} "
            f"| {t(b, 't_first_step_end') - t(b, 't_restored'):.2f} | {preparing} | {paused} "
            f"| {overhead.get((a['phase'], b['phase']), float('nan')):.2f} |")
    return out


def go_after_gone(a: dict, b: dict) -> str:
    """Seconds from phase ``a`` gone to ``b`` reading its go, where that is what the switch waited on:
    ``b`` prepared before ``a`` was gone and its go read after; "-" otherwise (see the module)."""
    gone, go, prepared = a.get("t_gone"), b.get("t_go"), b.get("t_prepared")
    if not (gone and go and prepared) or go < gone or prepared > gone:
        return "-"
    return f"{go - gone:.2f}"


def main(folder: Path) -> None:
    result = json.loads((folder / "results.json").read_text())["ways"]["relayer"]
    lines = [f"# relayer's switches, piece by piece ({folder.name})", "", *rows(result), ""]
    (folder / "breakdown.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
