"""Domain errors of the control plane; the CLI turns them into exit codes, nothing else does."""

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
"""What stops a command: a run writes a checkpoint first; every command exits 75 (``Preempted``).
SIGHUP is the terminal closing: a stop like SIGTERM, not the end of the work done since the last
checkpoint."""


class RelayerError(Exception):
    """A fault during a run: exit 1."""

    exit_code = 1


class ScheduleError(RelayerError):
    """Bad input (schedule file, command-line value): exit 2, nothing written."""

    exit_code = 2


class PhaseFailed(RelayerError):
    """A phase's processes ended without committing the phase."""


class Stalled(PhaseFailed):
    """A phase made no progress for ``launch.stall_seconds`` and was ended (``orchestrator.watchdog``)."""


class RunLocked(RelayerError):
    """Another orchestrator holds the run directory."""


class Preempted(RelayerError):
    """A signal stopped the run after its processes wrote a checkpoint; running again resumes."""

    exit_code = 75  # EX_TEMPFAIL: try again later
