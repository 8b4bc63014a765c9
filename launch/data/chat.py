"""A conversation rendered with a chat template, and where in that text its assistant turns lie.

    text, spans, marking = render_chat(tok, messages)   # spans: [(start, end)] characters of text

Every rendering goes through a ``launch.data.template.Renderer`` (the tokenizer's template under a time
and size budget; one compiled for many records is passed in); ``tok`` only tokenizes.

The text is always the template's rendering of the whole conversation. The assistant turns are
found one of three ways (``marking``):

- ``generation marks``: the template marks them itself with ``{% generation %}`` ...
  ``{% endgeneration %}``: its spans are the ones ``apply_chat_template(...,
  return_assistant_tokens_mask=True)`` masks (transformers' tracker, ``Renderer.render_marked``).
- ``prefixes``: turn j runs from the end of the conversation before it rendered with the
  generation prompt to the end of the conversation through it, where both are prefixes of the
  whole (most templates).
- ``turn by turn``: where the turn renders otherwise once later turns follow (Qwen3-style
  templates drop earlier turns' reasoning; some mark the last assistant turn): the whole is
  rendered again with that turn's content replaced, twice, which locates its content; the turn
  then runs from the generation prompt (where that is a prefix of the whole) to the end of its
  content and the end-of-turn tokens it shares with the same turn rendered last.
"""

from __future__ import annotations

import os
import re

from launch.data.records import DataError
from launch.data.template import Renderer

GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_STAND_INS = ("a", "b")
"""Two contents that differ in their first and their last character, for ``turn by turn``."""


def render_chat(tok, messages: list[dict], renderer: Renderer | None = None) -> tuple[str, list[tuple[int, int]], str]:
    """(the rendered text, the character spans of its assistant turns, how they were found)."""
    renderer = renderer or Renderer(tok.get_chat_template(), tok.special_tokens_map, "chat_template")
    if GENERATION.search(renderer.source):
        return (*renderer.render_marked(messages), "generation marks")
    text = _render(renderer, messages)
    spans, marking = [], "prefixes"
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        span = _by_prefixes(renderer, messages, j, text)
        if span is None:
            span, marking = _turn_by_turn(tok, renderer, messages, j, text), "turn by turn"
        if span is None or (spans and span[0] < spans[-1][1]):
            raise DataError(f"the chat template renders assistant turn {j} so that neither its prefixes nor a "
                            "rendering turn by turn locate it: mark the turns with {% generation %} in the template")
        spans.append(span)
    return text, spans, marking


def _render(renderer, messages: list[dict], prompt: bool = False) -> str:
    return renderer.render(messages, add_generation_prompt=prompt) if messages else ""


def _by_prefixes(renderer, messages: list[dict], j: int, text: str) -> tuple[int, int] | None:
    before = _render(renderer, messages[:j], prompt=True)
    through = _render(renderer, messages[: j + 1])
    if text.startswith(before) and text.startswith(through) and len(before) <= len(through):
        return len(before), len(through)
    return None


def _turn_by_turn(tok, renderer, messages: list[dict], j: int, text: str) -> tuple[int, int] | None:
    def instead(content: str, rest: list[dict]) -> str:
        return _render(renderer, messages[:j] + [{"role": "assistant", "content": content}] + rest)

    a, b = (instead(s, messages[j + 1:]) for s in _STAND_INS)
    head, tail = _common(a, b), _common(a[::-1], b[::-1])
    content_end = len(text) - tail
    if text[:head] != a[:head] or text[content_end:] != a[len(a) - tail:] or content_end < head:
        return None
    last_a, last_b = (instead(s, []) for s in _STAND_INS)
    closing = last_a[len(last_a) - _common(last_a[::-1], last_b[::-1]):]
    before = _render(renderer, messages[:j], prompt=True)
    start = len(before) if text.startswith(before) and len(before) <= head else head
    shared = _common(closing, text[content_end:])
    # Whole tokens of the closing only: "<|end|>\n<eos>" and "<|end|>\n<|user|>" share a "<" too.
    ends = [e for _, e in tok(closing, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    return start, content_end + max([e for e in ends if e <= shared], default=0)


def _common(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    return len(os.path.commonprefix([a, b]))
