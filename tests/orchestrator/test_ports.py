"""Each phase's MASTER_PORT lies below the kernel's ephemeral range (where nothing else is handed
it between the pick and the phase's own bind), is free when picked, and is not one picked lately
(a pre-warmed phase that has not bound it yet)."""

from __future__ import annotations

import collections
import socket

from orchestrator import ports


def test_ports_are_below_the_ephemeral_range_free_and_not_picked_lately():
    low = ports.ephemeral_low()
    picked = [ports.free_port() for _ in range(ports.RECENT)]
    assert len(set(picked)) == len(picked), picked
    if low - ports.LOWEST >= 4 * ports.RECENT:
        assert all(ports.LOWEST <= p < low for p in picked), (low, picked)


def test_a_port_in_use_or_picked_lately_is_not_picked(monkeypatch):
    # A window of five ports: one held by a listener, three picked lately: the fifth is the pick.
    with socket.socket() as probe:
        probe.bind(("", 0))
        base = probe.getsockname()[1]
    window = list(range(base, base + 5))
    monkeypatch.setattr(ports, "LOWEST", window[0])
    monkeypatch.setattr(ports, "RECENT", 1)
    monkeypatch.setattr(ports, "ephemeral_low", lambda: window[-1] + 1)
    monkeypatch.setattr(ports, "_recent", collections.deque(window[1:4], maxlen=8))
    with socket.socket() as held:
        held.bind(("", window[0]))
        held.listen()
        assert ports.free_port() == window[4]
