"""The CPU each test costs: its own process's and that of every process it started and waited for
(``RUSAGE_CHILDREN``: a run's orchestrator, fork server, data tool and phase ranks), beside its wall
time. On a machine whose cores the suite keeps full, CPU time, not wall time, is what a test costs the
suite: a test that waits costs wall time and leaves a core to the other worker.

    make test PYTEST_ARGS="-p tests.cpu_costs"        # one JSON line a test in $RELAYER_CPU_COSTS/WORKER.jsonl
    .venv/bin/python tests/cpu_costs.py DIR           # the modules and tests that cost the most

Processes a test did not wait for (SLURM's daemons' steps) are not counted.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

FOLDER = "RELAYER_CPU_COSTS"


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    t0, own, children = time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    record = {"id": item.nodeid, "wall": time.monotonic() - t0, "self": _cpu(resource.RUSAGE_SELF) - own,
              "children": _cpu(resource.RUSAGE_CHILDREN) - children}
    folder = Path(os.environ.get(FOLDER, "cpu-costs"))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def summary(folder: Path, top: int = 25) -> str:
    records = [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]
    cpu = {r["id"]: r["self"] + r["children"] for r in records}
    modules, walls = Counter(), Counter()
    for r in records:
        modules[r["id"].split("::")[0]] += cpu[r["id"]]
        walls[r["id"].split("::")[0]] += r["wall"]
    lines = [f"{len(records)} tests: {sum(cpu.values()):.0f} s of CPU, {sum(walls.values()):.0f} s of wall time summed",
             "", "CPU s   wall s  module"]
    lines += [f"{c:6.0f}  {walls[m]:6.0f}  {m}" for m, c in modules.most_common(top)]
    lines += ["", "CPU s   wall s  test"]
    walls_by_id = {r["id"]: r["wall"] for r in records}
    lines += [f"{c:6.1f}  {walls_by_id[t]:6.1f}  {t}" for t, c in Counter(cpu).most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("cpu-costs")))
