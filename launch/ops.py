"""DeepSpeed's JIT-built ops, loaded so that a killed process cannot hang every later one, and
no two processes of one machine race over a build.

On the CPU, ``deepspeed.init_distributed`` loads the shared-memory comm op through torch's JIT
build, which guards the build directory with a lock *file* (torch's FileBaton). A process killed
while holding it (a phase SIGKILLed during its start) leaves the file behind, and every later
process waits on it forever. relayer serialises the load under an flock, which the kernel drops
when its holder dies: whoever holds the flock knows any baton file is stale and removes it.
Loaded once, the op is cached in the process (and in everything the fork server forks), which then
never takes the flock again: a phase paused while it held it (``orchestrator.quiet``, SIGSTOP)
stalled the next phase's start at "starting the process group" until the pause ended. Every
process that loads the op takes the flock (the benchmarks' baselines too): one that held only the
baton would have it removed under it.

torch builds into one folder per user (``~/.cache/torch_extensions/py311_cpu``) whatever the
environment, and a build from another virtual environment (other include paths) makes ninja
build again: two checkouts on one machine would rebuild the op for each other all day, each
build minutes on a busy CPU. relayer builds into a folder of its own per Python, torch and
DeepSpeed versions instead, unless ``TORCH_EXTENSIONS_DIR`` says where (``launch.contract.ops``),
once: a process that finds the op built there, by whichever environment, loads its library
without ninja.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from launch.contract.ops import BUILT, built, extensions_dir
from shard_tools.files import write_atomic

COMM_BUFFER = "deepspeed_allreduce_buffer"
_loaded = False
"""The comm op is loaded in this process (or in the fork server it was forked from)."""


def load_comm_ops() -> None:
    global _loaded
    if _loaded:
        return
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir())  # read by torch's build, in this process
        build_dir = build_directory(builder.NAME)
        with open(build_lock(builder.NAME), "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            if not _load_built(builder):
                _build(build_shm_op, build_dir, builder.NAME)
    _loaded = True


def _build(build_shm_op, build_dir: Path, name: str) -> None:
    """The op built by torch's JIT build with this environment's ninja where it has one: whether the
    shell had the environment activated made the build use the system's ninja or its own, each
    finding the other's build log of another version and starting over."""
    path, here = os.environ.get("PATH", ""), Path(sys.executable).parent
    if (here / "ninja").is_file():
        os.environ["PATH"] = f"{here}{os.pathsep}{path}"
    t0 = time.time()
    try:
        build_shm_op()
    finally:
        os.environ["PATH"] = path
    _record_build(build_dir, name, time.time() - t0)


def _load_built(builder) -> bool:
    """Loads the op's library built before in this environment (``launch.contract.ops.built``)
    into DeepSpeed's cache of loaded ops, which its own load then returns; False where there is none."""
    record = built(builder.NAME)
    if record is None:
        return False
    spec = importlib.util.spec_from_file_location(builder.NAME, build_directory(builder.NAME) / record["library"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    owner = next(c for c in type(builder).__mro__ if "_loaded_ops" in vars(c))
    owner._loaded_ops[builder.NAME] = module
    return True


def _record_build(build_dir: Path, name: str, seconds: float) -> None:
    library = build_dir / f"{name}.so"
    if library.is_file():  # else DeepSpeed found the op incompatible and built nothing
        record = {"library": library.name, "size": library.stat().st_size, "seconds": round(seconds, 1),
                  "built": time.time(), "python": sys.executable}
        write_atomic(build_dir / BUILT, json.dumps(record), durable=False)


def build_directory(name: str) -> Path:
    """Where torch JIT-builds the op ``name`` (and keeps its baton file)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def build_lock(name: str) -> Path:
    """The file whose flock serialises loading the op ``name``."""
    return build_directory(name).parent / f".relayer-{name}.lock"


def unlink_comm_buffers(rank: int) -> None:
    """Unlinks this rank's shared-memory buffer of DeepSpeed's CPU comm op.

    The op creates /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> (69 MB) in each
    process and never unlinks it: every phase would leave its buffers in memory for good. Once
    every rank has mapped every other rank's buffer (its initialisation does that before it
    returns, hence the barrier), the name can go; the mappings live until the process ends.
    """
    import torch

    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    torch.distributed.barrier()
    name = f"{COMM_BUFFER}_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}_{rank}"
    Path("/dev/shm", name).unlink(missing_ok=True)
