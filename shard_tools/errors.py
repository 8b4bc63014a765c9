"""The format package's errors; ``shard_tools.cli`` turns them into exit codes (the orchestrator
catches them where it calls in). No torch, no imports: every module of the package may raise them."""


class CheckpointError(Exception):
    """A checkpoint, or a file of a run directory, is missing, incomplete or damaged; the message
    names the file."""


class InputError(Exception):
    """A command was given a path or value it does not take; the message names it and says what is expected."""
