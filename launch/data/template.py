"""A chat template rendered under a budget: a template is code from the user (or a downloaded
tokenizer), so one conversation's rendering gets at most ``SECONDS`` and ``chars`` characters.

transformers renders in jinja2's sandbox, which keeps a template from reading files or running
programs, and caps one ``range`` at 100,000 items, but not nested loops (their product), a string
repeated a billion times, or the output's size. Here the template is compiled in that same
environment (transformers' extensions and globals: ``raise_exception``, ``tojson``,
``{% generation %}``), with repetition and powers checked before they are made, and rendered as a
stream whose length is counted and whose time is bounded (an interval timer on the main thread of
a process, a ``datasets.map`` worker's too; a trace function elsewhere).

    renderer = Renderer(tok.chat_template, tok.special_tokens_map, "data.chat_template")
    text = renderer.render(messages, add_generation_prompt=True)  # TemplateFault, BudgetExceeded
    text, spans = renderer.render_marked(messages)                # and its {% generation %} spans
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

SECONDS = 5.0
"""Rendering one conversation (or one of its prefixes) takes at most this long."""
CHARS = 1 << 20
"""Rendered characters of one conversation, besides ``PER_CHAR`` for each character of its text."""
PER_CHAR = 8


class TemplateFault(Exception):
    """The template failed on a conversation (a syntax error, ``raise_exception``, an undefined
    attribute, a call the sandbox blocks); the message is one line naming the template's key."""


class BudgetExceeded(TemplateFault):
    """The template ran past its time or size budget: a fault of the template, not of one record,
    so the whole preparation stops (every record would pay the budget again)."""


class Renderer:
    """A chat template compiled once (``TemplateFault`` at once for a syntax error) and rendered
    under the budget. ``key`` names the template in every message. Picklable for ``datasets.map``
    workers: each compiles its own copy."""

    def __init__(self, source: str, variables: dict[str, Any], key: str):
        self.source, self.variables, self.key = source, dict(variables), key
        self._template = _compile(source, key)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_template"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _template=None)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        out: list[str] = []
        self._generate(messages, add_generation_prompt, out)
        return "".join(out)

    def render_marked(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation and the character spans its ``{% generation %}`` marks enclose,
        as transformers' ``return_assistant_tokens_mask`` finds them (its tracker, this rendering)."""
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        with self._compiled().environment.activate_tracker(out, spans):
            self._generate(messages, False, out)
        return "".join(out), [tuple(s) for s in spans]

    def _compiled(self):
        if self._template is None:
            self._template = _compile(self.source, self.key)
        return self._template

    def _generate(self, messages: list[dict], add_generation_prompt: bool, out: list[str]) -> None:
        """The rendering's chunks appended to ``out`` within the budget."""
        template = self._compiled()
        limit = CHARS + PER_CHAR * sum(len(m["content"]) for m in messages)
        size = 0
        try:
            with deadline(SECONDS, self.key):
                for chunk in template.generate(messages=messages, tools=None, documents=None,
                                               add_generation_prompt=add_generation_prompt, **self.variables):
                    size += len(chunk)
                    if size > limit:
                        raise BudgetExceeded(f"{self.key}: rendered more than {limit:,} characters for one "
                                             f"conversation (a template that repeats without end?)")
                    out.append(chunk)
        except TemplateFault:
            raise
        except Exception as e:  # noqa: BLE001 - whatever a template raises is the template's fault
            raise TemplateFault(f"{self.key}: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    line = getattr(e, "lineno", None)
    return f"{type(e).__name__}{f' at line {line}' if line else ''}: {first}"


def _compile(source: str, key: str):
    """The template in transformers' sandboxed environment (a fresh one: it is changed here), with
    string and list repetition and powers bounded."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _cached_compile_jinja_template

    env = _cached_compile_jinja_template("").environment
    env.intercepted_binops = frozenset({"*", "**"})
    env.call_binop = _bounded_binop(env.binop_table, key)
    # A width or count of millions (``center``, ``indent``, ``ljust``, ``format``) is one C call
    # that no timer stops: every call and filter is refused one.
    env.call = _bounded_call(env.call, key)
    env.filters = {name: _bounded_call(f, key, context=False) for name, f in env.filters.items()}
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TemplateFault(f"{key}: {_one_line(e)}") from None
    except (RecursionError, MemoryError, OverflowError, ValueError) as e:
        raise TemplateFault(f"{key}: cannot compile it: {_one_line(e)}") from None


def _bounded_binop(table: dict, key: str):
    """``call_binop`` for ``*`` and ``**``: a result beyond ``CHARS`` items (or digits) is refused
    before the C code that would make it runs (and, uninterruptible, could not be stopped)."""
    def call(context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            seq, n = (left, right) if isinstance(left, str | list | tuple) else (right, left)
            if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > CHARS:
                raise BudgetExceeded(f"{key}: repeats {len(seq):,} items {n:,} times, more than {CHARS:,}")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * max(abs(left), 2).bit_length() > CHARS * 4:
            raise BudgetExceeded(f"{key}: {left} ** {right} has more than {CHARS:,} digits")
        return table[operator](left, right)
    return call


def _bounded_call(call, key: str, context: bool = True):
    """``call`` refusing an integer argument above ``CHARS``; ``context``: the sandbox's ``call``,
    whose first two arguments are the context and the callee."""
    @functools.wraps(call)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        for v in (*args[2 if context else 0:], *kwargs.values()):
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > CHARS:
                raise BudgetExceeded(f"{key}: an argument of {v:,} (at most {CHARS:,} in a call or a filter)")
        return call(*args, **kwargs)
    return bounded


@contextmanager
def deadline(seconds: float, key: str) -> Iterator[None]:
    """BudgetExceeded naming ``key`` once ``seconds`` have passed inside the block."""
    def expired(*_):
        raise BudgetExceeded(f"{key}: rendering one conversation took more than {seconds:g} s (a template that "
                             f"loops without end?)")

    main = threading.current_thread() is threading.main_thread()
    if main and signal.getitimer(signal.ITIMER_REAL)[0] == 0:
        old = signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        return
    # Another thread (or a timer in use): a trace function looks at the clock.
    end = time.monotonic() + seconds

    def trace(frame, event, arg):
        if time.monotonic() > end:
            expired()
        return trace

    old_trace = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(old_trace)
