"""orchestrator.commit: finished phases' checkpoints fsynced in a thread, journaled done in order."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from orchestrator.commit import Committer


def checkpoint(tmp_path, name: str):
    d = tmp_path / "checkpoints" / name
    d.mkdir(parents=True)
    (d / "manifest.json").write_text("{}")
    return d


def test_phases_are_done_in_the_order_submitted_once_durable(tmp_path):
    done = []
    committer = Committer(lambda finished, current: done.append((finished.name, current)))
    first, second = (SimpleNamespace(name=n, end=checkpoint(tmp_path, n)) for n in ("a", "b"))
    committer.submit(first, "next-a")
    committer.submit(second, None)
    committer.poll(block=True)
    assert done == [("a", "next-a"), ("b", None)]
    assert committer.queue == []


def test_poll_does_not_wait_for_a_fsync_still_running(tmp_path, monkeypatch):
    release = threading.Event()
    import orchestrator.commit as commit

    monkeypatch.setattr(commit, "make_durable", lambda ckpt: release.wait(10))
    done = []
    committer = Committer(lambda finished, current: done.append(finished.name))
    committer.submit(SimpleNamespace(name="a", end=tmp_path), None)
    t0 = time.monotonic()
    committer.poll()
    assert done == [] and time.monotonic() - t0 < 1
    release.set()
    committer.poll(block=True)
    assert done == ["a"]


def test_a_failed_fsync_is_raised_in_the_loop_and_nothing_is_journaled(tmp_path):
    done = []
    committer = Committer(lambda finished, current: done.append(finished))
    committer.submit(SimpleNamespace(end=tmp_path / "gone"), None)
    with pytest.raises(FileNotFoundError):
        committer.poll(block=True)
    assert done == []
