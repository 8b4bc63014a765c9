"""The fault seam: production code reads no test variables; the tests' handlers reach the
processes that write, forked ones included (the fork server forks every phase's ranks)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT, faults_env

CHILD = """
import os, signal
from launch.contract import faults
faults.point("checkpoint.file_written", name="layers.safetensors")  # not the planned one: goes on
pid = os.fork()
if pid == 0:
    faults.point("checkpoint.file_written", name="head.safetensors")
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exited")
"""


def test_production_code_reads_no_test_variables():
    for package in ("orchestrator", "launch", "shard_tools"):
        for path in (ROOT / package).glob("*.py"):
            assert "RELAYER_TEST_" not in path.read_text(), path


def test_installed_handlers_survive_a_fork():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env={**os.environ, **faults_env(kill_after="head.safetensors")})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "9"


def test_points_do_nothing_unless_installed():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "exited"


KILL_AT = """
import os
from launch.contract import faults
faults.point("handover.offered", rank=1)  # another rank: goes on
faults.point("handover.copying", rank=0)  # another point: goes on
print("alive", flush=True)
faults.point("handover.offered", rank=0)
print("not killed")
"""


def test_kill_at_matches_the_point_and_its_context():
    r = subprocess.run([sys.executable, "-c", KILL_AT], capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env={**os.environ, **faults_env(kill_at={"point": "handover.offered", "rank": 0})})
    assert r.returncode == -9 and r.stdout == "alive\n", (r.returncode, r.stdout, r.stderr)
