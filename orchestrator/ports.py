"""The MASTER_PORT of each phase's process group.

A port the kernel handed out for ``bind(0)`` is back in its ephemeral range once the probe closes,
and in the seconds before the phase's rank 0 binds it (its TCPStore) the kernel may hand it to
anything else: an outgoing connection, NCCL's bootstrap, another phase's store client. On an H200,
2 of 200 pre-warmed 1.1B phases died so (``EADDRINUSE`` at ``init_process_group``), each switch then
8 s on a cold phase. The ports picked here lie below the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), where the kernel hands out none, nothing listens on
them when picked, and none is one of the last ``RECENT`` picked (a pre-warmed phase that has not
bound its port yet).
"""

from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000
"""The lowest port picked, where the ephemeral range starts above it (Linux's default: 32768)."""
RECENT = 64
_recent: deque[int] = deque(maxlen=RECENT)


def ephemeral_low() -> int:
    """Where the kernel's ephemeral range starts (32768 where it cannot be read)."""
    try:
        return int(RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port for a phase's process group: below the ephemeral range, free, not picked lately;
    where that range leaves too few below it, the kernel's pick (``bind(0)``), not picked lately."""
    low = ephemeral_low()
    below = range(LOWEST, low) if low - LOWEST >= 4 * RECENT else range(0)
    for port in random.sample(below, min(len(below), 512)):
        if port not in _recent and _free(port):
            _recent.append(port)
            return port
    while True:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in _recent:
            _recent.append(port)
            return port
