"""Where the time between a predecessor's offer and its successor's answer went, switch by switch
(issue #29: 0.39-0.74 s in some 7B switches under LISA's sampling).

The span is cut at two moments: the go (the journal's ``phase_started`` of the successor, written
right after the go) and the successor reading it (its ``t_go``). Each piece has its suspects, and
the records that tell them apart:

- offer -> go, the orchestrator's loop late: blocked in a disk wait (its main thread in D or in
  fsync, ``ThreadWatch``; the journal line it wrote last, usually ``preparing_paused`` from the
  quiet switch, and the page cache still being written back, ``MemInfoWatch``), or busy with a
  finished phase (``checkpoint_committed`` / ``phase_done`` / ``device_after_phase`` /
  ``checkpoint_removed`` journaled just before the go), or concluding the phase before the
  predecessor (its ``t_gone`` just before the go);
- go -> read, the successor busy when the go came: its ``LayerRefresh`` reading its layers that a
  phase since its preload trained (``layers_refreshed``; the checkpoint they came from made just
  before the go), seen as its main thread running or faulting pages in;
- read -> answer, the copy: slow where layers are read from checkpoints before the answer
  (``layers_at_go``).
"""

from __future__ import annotations

import collections

LATE = 0.05
"""Seconds a piece may take before it counts as a cause (a go is normally 0.01-0.02 s after the offer)."""
LOOP_EVENTS = ("checkpoint_committed", "phase_done", "device_after_phase", "checkpoint_removed", "checkpoint_layers_kept",
               "retention_skipped")


def _thread_summary(intervals: list[dict], t0: float, t1: float) -> dict:
    """Seconds of [t0, t1] the thread spent in each (state, wchan, syscall) outside a deliberate sleep."""
    spent: collections.Counter = collections.Counter()
    for i in intervals:
        lo, hi = max(t0, i["t0"]), min(t1, i["t1"])
        if hi > lo:
            spent[f"{i['state']} {i['wchan']} (syscall {i['syscall']})"] += hi - lo
    return {k: round(v, 3) for k, v in spent.most_common(4)}


def _disk_wait(summary: dict, span: float) -> bool:
    waited = sum(v for k, v in summary.items() if k.startswith("D ") or "syscall 74)" in k or "jbd2" in k)
    return span > 0 and waited >= 0.5 * span


def _loop_causes(sw: dict, journal: list[dict], before: dict | None) -> list[str]:
    causes = []
    window = [e for e in journal if sw["t_last_step_end"] - 0.5 <= e["time"] <= sw["t_go"]]
    if _disk_wait(sw["orchestrator_offer_to_go"], sw["gaps"]["offer_to_go"]):
        last = [e for e in journal if e["time"] <= sw["t_offered"]]
        causes.append(f"loop in a disk wait ({', '.join(sw['orchestrator_offer_to_go'])}) after journaling "
                      f"{last[-1]['event'] if last else '-'}; dirty/writeback MB at the offer {sw.get('page_cache_at_offer')}")
    busy = [e["event"] for e in window if e["event"] in LOOP_EVENTS]
    if busy:
        causes.append(f"loop journaling a finished phase just before the go: {', '.join(busy)}")
    if before and before.get("t_gone") and sw["t_last_step_end"] - 0.5 <= before["t_gone"] <= sw["t_go"]:
        causes.append(f"loop concluding phase {before['phase']} (gone {sw['t_go'] - before['t_gone']:.3f} s before the go)")
    return causes or ["loop late, cause not seen (see the stack dumps)"]


def _successor_causes(sw: dict, manifests: dict) -> list[str]:
    made = [m["created"] for m in manifests.values() if m.get("phase_complete") and m.get("created")
            and set(m.get("layers") or []) & set(sw["layers"]) and m["created"] <= sw["t_go_read"]]
    causes = []
    if sw.get("layers_refreshed"):
        ago = f", {sw['t_go'] - max(made):.3f} s before the go" if made else ""
        causes.append(f"successor refreshing layers {sw['layers_refreshed']} when the go came (their checkpoint "
                      f"made{ago}); its thread: {sw['successor_go_to_read']}")
    return causes or [f"successor late reading its go, cause not seen; its thread: {sw['successor_go_to_read']}"]


def analyse(phases: list[dict], journal: list[dict], manifests: dict, threads, meminfo) -> list[dict]:
    """Per handed-over switch: its moments, the pieces between them and the likely cause of each late piece."""
    go = {e["phase"]: e["time"] for e in journal if e["event"] == "phase_started"}
    out = []
    for a, b in zip(phases, phases[1:]):
        if not (a.get("t_offered") and b.get("t_taken") and b.get("t_go") and go.get(b["phase"])):
            continue
        sw = {"from": a["phase"], "to": b["phase"], "layers": b["layers"], "t_last_step_end": a["t_last_step_end"],
              "t_offered": a["t_offered"], "t_go": go[b["phase"]], "t_go_read": b["t_go"], "t_taken": b["t_taken"],
              "t_answered": a.get("t_answered"), "t_first_step_end": b.get("t_first_step_end"),
              "layers_refreshed": b.get("layers_refreshed") or [], "layers_at_go": b.get("layers_at_go") or []}
        sw["gaps"] = {"last_step_to_offer": sw["t_offered"] - sw["t_last_step_end"],
                      "offer_to_go": sw["t_go"] - sw["t_offered"], "go_to_read": sw["t_go_read"] - sw["t_go"],
                      "read_to_taken": sw["t_taken"] - sw["t_go_read"], "offer_to_taken": sw["t_taken"] - sw["t_offered"]}
        sw["page_cache_at_offer"] = _mb(meminfo.at(sw["t_offered"])) if meminfo else None
        sw["page_cache_at_go"] = _mb(meminfo.at(sw["t_go"])) if meminfo else None
        spans = {"orchestrator_offer_to_go": ("orchestrator", sw["t_offered"], sw["t_go"]),
                 "successor_second_before_go": (f"phase {b['phase']}", sw["t_go"] - 1.0, sw["t_go"]),
                 "successor_go_to_read": (f"phase {b['phase']}", sw["t_go"], sw["t_go_read"]),
                 "successor_read_to_taken": (f"phase {b['phase']}", sw["t_go_read"], sw["t_taken"])}
        for key, (who, t0, t1) in spans.items():
            sw[key] = _thread_summary(threads.between(who, t0, t1), t0, t1) if threads else {}
        before = phases[phases.index(a) - 1] if phases.index(a) > 0 else None
        causes = []
        if sw["gaps"]["offer_to_go"] > LATE:
            causes += _loop_causes(sw, journal, before)
        if sw["gaps"]["go_to_read"] > LATE:
            causes += _successor_causes(sw, manifests)
        if sw["gaps"]["read_to_taken"] > 3 * LATE and sw["layers_at_go"]:
            causes.append(f"layers {sw['layers_at_go']} read from checkpoints at the go, before the answer")
        sw["causes"] = causes
        out.append(sw)
    return out


def _mb(sample: dict | None) -> dict | None:
    return {k: round(v / 1e6) for k, v in sample.items()} if sample else None


def table_rows(gaps: list[dict]) -> list[str]:
    """The switches' moments and causes, for table.md."""
    if not gaps:
        return []
    lines = ["", "Offer to answer, piece by piece (s): last step -> offer -> go (the journal's phase_started) -> "
                 "the successor reads its go -> its answer; and what the records say of each late piece:", "",
             "| switch | last step -> offer | offer -> go | go -> read | read -> answer | offer -> answer | "
             "refreshed / at go | causes |", "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for sw in gaps:
        g = sw["gaps"]
        lines.append(f"| {sw['from']} -> {sw['to']} | {g['last_step_to_offer']:.3f} | {g['offer_to_go']:.3f} | "
                     f"{g['go_to_read']:.3f} | {g['read_to_taken']:.3f} | {g['offer_to_taken']:.3f} | "
                     f"{sw['layers_refreshed'] or '-'} / {sw['layers_at_go'] or '-'} | "
                     f"{'; '.join(sw['causes']) or '-'} |")
    return lines
