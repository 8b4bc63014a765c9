"""``python -m orchestrator``: the ``orchestrator`` command, for callers that have an interpreter but
not its scripts on PATH."""

from orchestrator.cli import main

main()
