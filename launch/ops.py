"""DeepSpeed's JIT-built ops, loaded so that a killed process cannot hang every later one.

On the CPU, ``deepspeed.init_distributed`` loads the shared-memory comm op through torch's JIT
build, which guards the build directory with a lock *file* (torch's FileBaton). A process killed
while holding it (a phase SIGKILLed during its start) leaves the file behind, and every later
process waits on it forever. relayer serialises the load under an flock, which the kernel drops
when its holder dies: whoever holds the flock knows any baton file is stale and removes it.
Loaded once, the op is cached in the process (and in everything the fork server forks), which then
never takes the flock again: a phase paused while it held it (``orchestrator.quiet``, SIGSTOP)
stalled the next phase's start at "starting the process group" until the pause ended.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

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
        build_dir = build_directory(builder.NAME)
        with open(build_lock(builder.NAME), "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            build_shm_op()
    _loaded = True


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
