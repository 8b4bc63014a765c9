"""Starts a phase's launcher: ``python -m launch SPEC``. The orchestrator runs exactly this.

It imports no torch: it reads the spec, builds the launcher's command, gives itself a
parent-death signal (which survives exec) and execs the launcher in its place.
"""

import os
import sys
from pathlib import Path

from launch.commands import command
from launch.procs import record_pid, set_parent_death_signal
from launch.contract.spec import PhaseSpec


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m launch SPEC.json")
    spec = PhaseSpec.read(sys.argv[1])
    argv, env = command(spec, sys.argv[1])
    set_parent_death_signal()
    record_pid(Path(spec.phase_dir), "launcher")
    os.execvpe(argv[0], argv, {**os.environ, **env})


if __name__ == "__main__":
    main()
