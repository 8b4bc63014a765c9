"""DeepSpeed's JIT-built ops, loaded so that a killed process cannot hang every later one.

On the CPU, ``deepspeed.init_distributed`` loads the shared-memory comm op through torch's JIT
build, which guards the build directory with a lock *file* (torch's FileBaton). A process killed
while holding it (a phase SIGKILLed during its start) leaves the file behind, and every later
process waits on it forever. relayer serialises the load under an flock, which the kernel drops
when its holder dies: whoever holds the flock knows any baton file is stale and removes it.
Loaded once, the op is cached in the process (and in everything the fork server forks).
"""

from __future__ import annotations

import fcntl
from pathlib import Path


def load_comm_ops() -> None:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return
    from torch.utils.cpp_extension import _get_build_directory  # where torch puts JIT builds and their baton

    build_dir = Path(_get_build_directory(builder.NAME, verbose=False))
    with open(build_dir.parent / f".relayer-{builder.NAME}.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        build_shm_op()
