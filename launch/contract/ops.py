"""Where DeepSpeed's JIT-built CPU comm op of this environment lives, and whether it is built:
torch-free, so that the orchestrator can say, before a phase starts, that the build is ahead
(minutes on a busy CPU), and afterwards how long it took (``launch.ops`` builds it).

One folder per Python, torch and DeepSpeed version, shared by every environment that has them:
two checkouts (or a fresh clone beside a working one) build once. Once built, ``BUILT`` beside the
library records it; a process that finds it loads the library as it is, without asking ninja, whose
verdict changes with the include paths (those of another environment, or one environment's reached
through a link, made it build again for minutes: before ``BUILT``, each environment had a folder of
its own). The library needs nothing of the environment that built it: torch's libraries, which it
links to, are loaded by name, and every process has imported torch before it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

COMM_OP = "deepspeed_shm_comm"
"""DeepSpeed's ShareMemCommBuilder's op: the CPU accelerator's shared-memory allreduce."""
BUILT = "relayer-built.json"
"""Written beside the op's library once it is built: its file, size and the build's seconds."""


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def extensions_dir() -> Path:
    """Where this environment's JIT builds go: ``TORCH_EXTENSIONS_DIR``, else a folder of torch's
    default root (``$XDG_CACHE_HOME/torch_extensions``, ``~/.cache`` by default) for its Python,
    torch and DeepSpeed versions."""
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    key = " ".join([sys.version, _version("torch"), _version("deepspeed")])
    return Path(os.path.realpath(os.path.join(cache, "torch_extensions"))) / \
        f"relayer-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def built(name: str = COMM_OP) -> dict[str, Any] | None:
    """The op's build record where its library is there as built (``BUILT``); else None."""
    folder = extensions_dir() / name
    try:
        record = json.loads((folder / BUILT).read_text())
        if (folder / record["library"]).stat().st_size == record["size"]:
            return record
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None
