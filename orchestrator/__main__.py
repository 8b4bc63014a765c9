"""``python -m orchestrator``: the ``orchestrator`` command, for callers that have an interpreter but
not its scripts on PATH (``shard-tools inspect`` runs ``report --json`` this way)."""

from orchestrator.cli import main

main()
