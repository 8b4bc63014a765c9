"""launch/rendezvous.py: a start that overruns its bound ends the process, saying where it waited
(the whole run through a real cluster: tests/cluster/test_slurm.py)."""

from __future__ import annotations

import subprocess
import sys
import time

from launch.rendezvous import unmet
from tests.conftest import ROOT

STUCK = """
import time
from pathlib import Path
from launch.rendezvous import bounded
with bounded(0.5, Path({phase!r}), 1):
    time.sleep(30)
"""


def test_a_start_past_its_bound_ends_the_process_with_its_reason(tmp_path):
    env = {"MASTER_ADDR": "n1.invalid", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "SLURMD_NODENAME": "n2",
           "PATH": "/usr/bin:/bin"}
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", STUCK.format(phase=str(tmp_path))], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=60)
    assert r.returncode == 1 and time.time() - t0 < 20
    reason = (tmp_path / "errors" / "rank-1.txt").read_text()
    assert reason.startswith("PhaseError: the process group did not start within 0.5 s (launch.rendezvous_seconds): "
                             "rank 1 of 2 on node n2 waited at n1.invalid:29500, the rendezvous: n1.invalid does not "
                             "resolve on this node (")
    assert reason.rstrip().endswith("launch.master_addr names an address of rank 0's node that every node resolves")
    assert r.stderr.startswith("rank 1: the process group did not start within 0.5 s")


def test_an_address_that_resolves_but_does_not_answer(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "9")
    assert "waited at 127.0.0.1:9, the rendezvous: nothing answered there, or not every rank came" in unmet(300, 0)


def test_a_start_within_its_bound_goes_on(tmp_path):
    code = STUCK.format(phase=str(tmp_path)).replace("bounded(0.5", "bounded(30").replace("sleep(30)", "sleep(0.1)")
    r = subprocess.run([sys.executable, "-c", code + "\ntime.sleep(1)\nprint('on')"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert (r.returncode, r.stdout) == (0, "on\n"), r.stderr
    assert not (tmp_path / "errors").exists()
