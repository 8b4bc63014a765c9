"""What the small GPU benchmarks write: NAME.json (the raw runs) and NAME.md (a titled table)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def write_report(out: Path, name: str, data: object, title: str, table: list[str]) -> None:
    """Writes ``data`` to out/NAME.json and ``title`` (with the date, the device and torch's version)
    over ``table``'s lines to out/NAME.md, and prints the latter."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    lines = [f"# {title} ({time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name(0)}, torch {torch.__version__})",
             "", *table]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
