"""DeepSpeed's JIT-built comm op (``launch.ops``): one lock for every process that loads it, the
benchmarks' baselines too, one build folder for every environment of the same versions, so that
runs, test suites and benchmarks of several checkouts on one machine never race over a build nor
build it more than once; and a
process forked after the op was loaded (every phase rank of the fork server) never waits for the
build lock, so a phase paused while it holds that lock (orchestrator.quiet) cannot stall another
phase's start."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.ops import extensions_dir
from tests.conftest import ROOT, make_tokens

# The baseline as switch.py starts it: Trainer's start (its distributed init), then a word.
BASELINE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from benchmarks._baselines import Trainer
Trainer(json.loads(sys.argv[2]), __import__("pathlib").Path(sys.argv[3]))
print("initialised", flush=True)
"""


def test_environments_of_the_same_versions_share_one_build_folder(monkeypatch, tmp_path):
    """Another checkout's environment (a fresh clone's: 43 s of CPU for the build on 2 cores), or
    this one reached through a link (seen: a checkout whose .venv linked to another's built the op
    again, 4 minutes), finds the op built; another Python builds its own."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    from torch.utils.cpp_extension import get_default_build_root

    mine = extensions_dir()
    assert mine.parent == Path(get_default_build_root()) and mine.name.startswith("relayer-")
    monkeypatch.setattr(sys, "prefix", "/elsewhere/.venv")
    assert extensions_dir() == mine
    (tmp_path / ".venv").symlink_to(os.path.realpath(sys.base_prefix))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / ".venv"))
    assert extensions_dir() == mine
    monkeypatch.setattr(sys, "version", sys.version + " (another build)")
    assert extensions_dir() != mine
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/chosen")
    assert extensions_dir() == Path("/chosen")


# The environment's op, once built (``launch.contract.ops.built``), is loaded without ninja: a
# ninja on PATH that fails says whether anybody asked it.
LOADS_BUILT = """
import json
from deepspeed.comm.torch import build_shm_op
from launch.contract.ops import built
from launch.ops import load_comm_ops

load_comm_ops()
print(json.dumps({"built": built(), "module": build_shm_op().__file__}), flush=True)
"""


@pytest.mark.multiprocess  # imports DeepSpeed in processes of their own
def test_a_built_op_is_loaded_without_ninja(tmp_path):
    """Seen: the README's first run built the op again (216 s) minutes after make demo built it: the
    demo ran torch's build with the system's ninja 1.11 (no venv on PATH), the activated shell with
    the venv's ninja 1.13, which found the 1.11 build log "too old" and started over."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    first = subprocess.run([sys.executable, "-c", LOADS_BUILT], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)  # the environment's own build, once (whoever comes first)
    assert first.returncode == 0, first.stderr[-3000:]
    record = json.loads(first.stdout.splitlines()[-1])["built"]
    assert record and record["seconds"] >= 0 and record["library"] == "deepspeed_shm_comm.so", first.stdout
    copy = tmp_path / "ext"
    shutil.copytree(Path(json.loads(first.stdout.splitlines()[-1])["module"]).parent, copy / "deepspeed_shm_comm")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ninja").write_text(f"#!/bin/sh\ntouch {tmp_path / 'ninja-asked'}\nexit 1\n")
    (fake / "ninja").chmod(0o755)
    env.update(TORCH_EXTENSIONS_DIR=str(copy), PATH=f"{fake}{os.pathsep}{env['PATH']}")
    again = subprocess.run([sys.executable, "-c", LOADS_BUILT], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout.splitlines()[-1])["module"] == str(copy / "deepspeed_shm_comm" /
                                                                      "deepspeed_shm_comm.so")
    assert not (tmp_path / "ninja-asked").exists()


def waiting_on(lock: Path, pid: int) -> bool:
    """Whether ``pid`` is blocked in flock on ``lock`` (a "->" line of /proc/locks)."""
    inode = os.stat(lock).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if "->" in parts and "FLOCK" in parts:
            rest = parts[parts.index("->") + 1:]
            if int(rest[3]) == pid and int(rest[4].split(":")[-1]) == inode:
                return True
    return False


@pytest.mark.multiprocess
def test_the_benchmark_baseline_waits_for_relayers_build_lock(tmp_path):
    """Seen: the baseline of tests/benchmarks/test_switch_smoke.py held torch's baton without the
    lock, a phase process that held it removed the "stale" baton, and the baseline's own release
    failed (FileNotFoundError: .../deepspeed_shm_comm/lock)."""
    setup = {"data_path": str(make_tokens(tmp_path / "tokens.jsonl")), "seq_len": 16, "batch_size": 4,
             "micro_batch_size": 2, "seed": 0}
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29400 + os.getpid() % 500)}
    lock = extensions_dir() / ".relayer-deepspeed_shm_comm.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-c", BASELINE, str(ROOT), json.dumps(setup), str(tmp_path)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            while not waiting_on(lock, proc.pid):
                assert proc.poll() is None, "the baseline never waited for the lock: " + proc.communicate()[1][-2000:]
                time.sleep(0.1)
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "initialised" in out, err[-2000:]


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


@pytest.mark.multiprocess  # imports DeepSpeed in a process of its own
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
