"""DeepSpeed's CPU comm op (launch.ops): a process forked after the op was loaded (every phase rank
of the fork server) never waits for the build lock, so a phase paused while it holds that lock
(orchestrator.quiet) cannot stall another phase's start."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.multiprocess  # imports DeepSpeed in a process of its own

# Loads the op, names its lock file (as torch's build folder places it), then, once the test
# holds that lock, forks a child that loads the op again, as a forked phase rank does.
FORKS = """
import os, sys
from deepspeed.accelerator import get_accelerator
from torch.utils.cpp_extension import _get_build_directory
from launch.ops import load_comm_ops

load_comm_ops()
name = get_accelerator().create_op_builder("ShareMemCommBuilder").NAME
print("lock:", os.path.join(os.path.dirname(_get_build_directory(name, verbose=False)), f".relayer-{name}.lock"), flush=True)
sys.stdin.readline()
pid = os.fork()
if pid == 0:
    load_comm_ops()
    os._exit(0)
print("forked child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def test_a_forked_process_loads_the_op_without_the_build_lock():
    proc = subprocess.Popen([sys.executable, "-c", FORKS], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    try:
        lines = iter(proc.stdout.readline, "")  # torch and DeepSpeed print about the build too
        lock = next((line.removeprefix("lock:").strip() for line in lines if line.startswith("lock:")), None)
        assert lock, proc.stderr.read()
        with open(lock, "w") as held:  # as a paused phase would hold it
            fcntl.flock(held, fcntl.LOCK_EX)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the forked process waited for the build lock")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.strip().endswith("forked child 0"), (out, err)
