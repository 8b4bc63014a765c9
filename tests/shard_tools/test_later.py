"""shard_tools.later.Later: work in a thread, its value or its exception collected later."""

from __future__ import annotations

import threading

import pytest

from shard_tools.later import Later


def test_the_value_once_the_work_is_done():
    go = threading.Event()
    later = Later(lambda a, b: go.wait(10) and a + b, 2, 3)
    assert not later.done()
    go.set()
    assert later.result() == 5 and later.done() and later.result() == 5


def test_what_the_work_raised_is_raised_by_result_every_time():
    def fails():
        raise OSError(28, "No space left on device")

    later = Later(fails)
    for _ in range(2):
        with pytest.raises(OSError, match="No space left"):
            later.result()


def test_a_value_there_already():
    now = Later.now(None)
    assert now.done() and now.result() is None
