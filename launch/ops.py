"""DeepSpeed's JIT-built ops, loaded so that a killed process cannot hang every later one, and
no two processes of one machine race over a build.

On the CPU, ``deepspeed.init_distributed`` loads the shared-memory comm op through torch's JIT
build, which guards the build directory with a lock *file* (torch's FileBaton). A process killed
while holding it (a phase SIGKILLed during its start) leaves the file behind, and every later
process waits on it forever. relayer serialises the load under an flock, which the kernel drops
when its holder dies: whoever holds the flock knows any baton file is stale and removes it. So
every process that loads the op must take the flock (the benchmarks' baselines too): one that
holds only the baton would have it removed under it. Loaded once, the op is cached in the
process (and in everything the fork server forks).

torch builds into one folder per user (``~/.cache/torch_extensions/py311_cpu``) whatever the
environment, and a build from another virtual environment (other include paths) makes ninja
build again: two checkouts on one machine would rebuild the op for each other all day, each
build minutes on a busy CPU. Each environment builds into a folder of its own instead, unless
``TORCH_EXTENSIONS_DIR`` says where.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
from pathlib import Path

COMM_BUFFER = "deepspeed_allreduce_buffer"


def extensions_dir() -> Path:
    """Where this environment's JIT builds go: ``TORCH_EXTENSIONS_DIR``, else a folder of torch's
    default root named after this environment (``sys.prefix``)."""
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root()) / f"relayer-{hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]}"


def load_comm_ops() -> None:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return
    from torch.utils.cpp_extension import _get_build_directory  # where torch puts JIT builds and their baton

    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir())  # read by torch's build, in this process
    build_dir = Path(_get_build_directory(builder.NAME, verbose=False))
    with open(build_dir.parent / f".relayer-{builder.NAME}.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        build_shm_op()


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
