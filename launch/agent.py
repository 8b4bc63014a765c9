"""One node's torchrun agent, for ``launch.launcher = "torchrun"`` on several nodes: srun starts
``python -m launch.agent SPEC`` once on every node of the step (``launch.commands``).

It imports no torch: it records itself as ``agent-N`` (N: the node's index in the step), works out
its node's torchrun arguments (``launch.commands.agent_command``) and execs torchrun in its place,
which starts the node's ranks once every node's agent has joined the rendezvous.
"""

import os
import sys
from pathlib import Path

from launch.commands import agent_command
from launch.contract.spec import PhaseSpec
from launch.procs import node_name, record_pid


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m launch.agent SPEC.json")
    spec = PhaseSpec.read(sys.argv[1])
    try:
        argv = agent_command(spec, sys.argv[1], sys.executable, os.environ)
    except ValueError as e:
        sys.exit(f"launch.agent on node {node_name()}: {e}")
    record_pid(Path(spec.phase_dir), f"agent-{os.environ['SLURM_NODEID']}")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
