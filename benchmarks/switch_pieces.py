"""Where each switch of a run went, from its phases' records (``phases/phase-N/records.json``, rank 0):
the predecessor's last step to the go, then from the go the successor's pieces, in seconds.

    python benchmarks/switch_pieces.py RUN_DIR [--json out.json]

Columns: ``last->go`` (the predecessor's last step's end to the successor's go), then each mark's time
after the go: taken (the offer read and answered), on_device (its own weights there), engine (built),
restored, predecessor_gone (under a budget, its wait for the predecessor to leave the device before
the first step, ``exit_wait`` long; before 2026-12-07 it came before on_device), first (its first step's
end); the predecessor's ``gathered`` and ``offered`` after its last step (its state read, then in the host
path's file and released, before the go); ``warm`` says how it warmed up (a one-layer toy, the smallest toy, skipped) and ``pinned`` what
its engine took of the host memory it pinned ahead (``launch.pinned``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MARKS = ("t_taken", "t_on_device", "t_engine_built", "t_restored", "t_predecessor_gone", "t_first_step_end")


def pieces(run: Path) -> list[dict]:
    """One row per phase after the first: its switch's pieces."""
    records = {}
    for f in sorted((run / "phases").glob("phase-*/records.json")):
        r = json.loads(f.read_text())
        records[int(f.parent.name.split("-")[1])] = r[0] if isinstance(r, list) else r
    rows = []
    for k in sorted(records)[1:]:
        r, before = records[k], records.get(k - 1, {})
        go = r.get("t_go")
        if go is None:
            continue
        row = {"phase": k, "handover": r.get("handover"),
               "last->go": round(go - before["t_last_step_end"], 3) if "t_last_step_end" in before else None}
        row.update({m.removeprefix("t_"): round(r[m] - go, 3) if m in r else None for m in MARKS})
        for mark in ("t_gathered", "t_offered"):
            if mark in before and "t_last_step_end" in before:
                row[mark.removeprefix("t_")] = round(before[mark] - before["t_last_step_end"], 3)
        wait = r.get("predecessor_exit_wait")
        row["exit_wait"] = round(wait, 3) if isinstance(wait, float) else wait
        small = r.get("warm_up_small") is True  # the smallest toy; warm_up_skipped: the one layer did not fit
        skipped = r.get("warm_up_small_skipped") or (r.get("warm_up_skipped") and not small)
        row["warm"] = "skipped" if skipped else "small" if small else "one layer"
        row["pinned"] = r.get("pinned_ahead")
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = pieces(args.run)
    keys = list(rows[0]) if rows else []
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
