"""The test suite as ``make test`` and ``make test-fast`` run it: on every core, then what must run alone.

    .venv/bin/python tests/run.py [--fast] [PYTEST_ARGS...]

Two pytest runs, every failure of both reported, the wall time printed at the end:

1. every test not marked ``alone``, spread over ``TEST_WORKERS`` processes (pytest-xdist; default: the
   cores this process may use, at most 4), a test module at a time (``--dist loadscope``: a module's
   fixtures, such as the reference run its tests compare with, are built once), in the order
   ``tests/conftest.py`` gives: the fast modules first, then the multiprocess ones, longest first;
2. the tests marked ``alone`` (they need the machine's cores to themselves, or a fixed resource), one
   at a time.

``--costs REPORT.xml`` rewrites ``tests/costs.json`` (the seconds of each multiprocess module, by which
the modules are ordered) from the junit report of a whole run (``make test PYTEST_ARGS=--junitxml=REPORT.xml``).

``--fast`` is the tier a change to the product's logic needs first (``make test-fast``): the unit
tests of every package and the multiprocess tests marked ``smoke`` (a real run of each kind), in
about 5 minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

FAST = "(not multiprocess and not slow) or smoke"
ROOT = Path(__file__).resolve().parent.parent
NO_TESTS = 5
"""pytest's exit status where a selection collected nothing (a pass with no ``alone`` test in it)."""


def workers() -> int:
    if "TEST_WORKERS" in os.environ:
        return int(os.environ["TEST_WORKERS"])
    return max(1, min(4, len(os.sched_getaffinity(0))))


def passes(fast: bool, args: list[str]) -> list[list[str]]:
    """The pytest command lines, in order."""
    pytest = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    tier = ["-m", FAST] if fast else []
    n = workers()
    spread = ["-n", str(n), "--dist", "loadscope", "--no-loadscope-reorder"] if n > 1 else []
    # The second pass collects only the modules with a test marked alone, unless the caller named what to
    # collect: a collection of the whole suite imports every test module again (some 6 s on 2 cores).
    named = any(Path(a.split("::")[0]).exists() for a in args)
    return [[*pytest, *spread, "--durations=15", "--alone=skip", *tier, *args],
            [*pytest, "--durations=5", "--alone=only", *tier, *args, *([] if named else alone_modules())]]


def costs(report: Path, multiprocess: set[str]) -> dict[str, float]:
    """Seconds per test module of ``multiprocess`` in a junit report (setup and teardown included)."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(report).iter("testcase"):
        module = "/".join(p for p in case.get("classname", "").split(".") if not p[:1].isupper()) + ".py"
        if module in multiprocess:
            seconds[module] += float(case.get("time", 0))
    return {m: round(s, 1) for m, s in sorted(seconds.items())}


def marked_modules(marker: str) -> list[str]:
    """The test modules with a test marked ``marker``, relative to the checkout, sorted."""
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/**/test_*.py") if f"pytest.mark.{marker}" in p.read_text())


def alone_modules() -> list[str]:
    return marked_modules("alone")


def multiprocess_modules() -> set[str]:
    return set(marked_modules("multiprocess"))


def write_costs(report: Path) -> None:
    """``tests/costs.json`` from ``report``; a module the report lacks (one of the ``alone`` pass, run
    apart) keeps its cost."""
    path, modules = ROOT / "tests" / "costs.json", multiprocess_modules()
    kept = {m: c for m, c in json.loads(path.read_text()).items() if m in modules}
    path.write_text(json.dumps(dict(sorted({**kept, **costs(report, modules)}.items())), indent=1) + "\n")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--costs"]:
        write_costs(Path(argv[1]))
        return 0
    fast = "--fast" in argv
    args = [a for a in argv if a != "--fast"]
    start, failed = time.monotonic(), []
    for n, command in enumerate(passes(fast, args), 1):
        print(f"\ntests/run.py: pass {n}: {' '.join(command[1:])}", flush=True)
        status = subprocess.call(command)
        if status not in (0, NO_TESTS):
            failed.append(f"pass {n} exited {status}")
    took = time.monotonic() - start
    tier = "make test-fast" if fast else "make test"
    print(f"\n{tier}: {took / 60:.1f} minutes wall ({took:.0f} s), {workers()} workers; "
          + ("; ".join(failed) if failed else "passed"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
