"""Work in a thread, its result (or what it raised) collected later: the one helper for a phase's
files made ahead, its host side prepared during the warm-up, the head's pages mapped while the
engine is built, and the orchestrator's durability fsyncs. No torch here.

    files = Later(make_files, ph)    # starts now, in a daemon thread
    ...
    files.result()                   # waits; the value, or raises what the work raised
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Later(Generic[T]):
    """``work(*args)`` in a daemon thread from now on (the process may exit without waiting for
    it); ``result`` waits for it and returns its value or raises what it raised, every time."""

    def __init__(self, work: Callable[..., T], *args: Any):
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work, args), name=work.__name__.strip("_"),
                                        daemon=True)
        self._thread.start()

    @classmethod
    def now(cls, value: T) -> Later[T]:
        """A result there already: work done where it was asked for."""
        done = cls.__new__(cls)
        done._value, done._error, done._thread = value, None, None
        return done

    def _run(self, work: Callable[..., T], args: tuple) -> None:
        try:
            self._value = work(*args)
        except BaseException as e:  # noqa: BLE001 - handed to result's caller
            self._error = e

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> T:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
