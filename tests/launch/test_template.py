"""A chat template is code from the user: it renders under a time and size budget, in the sandbox,
as transformers renders it; a template that fails or runs past its budget is one line naming its
key (``data.chat_template``), and the preparation stops at the first budget hit, also where the
records are rendered in ``datasets.map`` worker processes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from launch.data import cache as dataprep, template
from launch.data.examples import DataError, prepare
from launch.data.template import BudgetExceeded, Renderer, TemplateFault
from tests.launch.test_dataprep import CHAT, TEMPLATE, _tokenizer, part

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
FAILING = {
    "syntax": ("{% for m in messages %}", "TemplateSyntaxError at line 1"),
    "raise_exception": ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    "undefined attribute": ("{{ messages[0].nope.deeper }}", "UndefinedError"),
    "blocked by the sandbox": ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
}
OVER_BUDGET = {
    "nested loops": LOOP,
    "output without end": LOOP.replace("{% endfor %}{% endfor %}", "xxxxxxxx{% endfor %}{% endfor %}"),
    "one huge repetition": "{{ 'x' * 10000000000 }}",
    "one huge power": "{{ 10 ** 100000000 }}",
    "one huge width": "{{ 'a' | center(1000000000) }}",
    "one huge width, called": "{{ 'a'.ljust(1000000000) }}",
}


@pytest.fixture(autouse=True)
def short_budget(monkeypatch):
    monkeypatch.setattr(template, "SECONDS", 0.5)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return _tokenizer(tmp_path_factory.mktemp("tok"), TEMPLATE)


def test_renders_as_transformers_does(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    r = Renderer(tok.get_chat_template(), tok.special_tokens_map, "data.chat_template")
    for n in range(1, len(CHAT) + 1):
        for prompt in (False, True):
            assert r.render(CHAT[:n], add_generation_prompt=prompt) == tok.apply_chat_template(
                CHAT[:n], tokenize=False, add_generation_prompt=prompt)
    tracked = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}{% endfor %}"
    assert Renderer(tracked, tok.special_tokens_map, "k").render(CHAT[:2]) == "be brief<eos>hello there<eos>"


@pytest.mark.parametrize("name", FAILING)
def test_a_failing_template_is_one_line_naming_its_key(name):
    source, cause = FAILING[name]
    with pytest.raises(TemplateFault) as e:
        Renderer(source, {}, "data.chat_template").render(CHAT)
    assert not isinstance(e.value, BudgetExceeded)
    assert str(e.value).startswith("data.chat_template: ") and cause in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", OVER_BUDGET)
def test_a_template_past_its_budget_stops_within_it(name):
    t0 = time.monotonic()
    with pytest.raises(BudgetExceeded, match="^data.chat_template: "):
        Renderer(OVER_BUDGET[name], {}, "data.chat_template").render(CHAT)
    assert time.monotonic() - t0 < 10


def test_the_budget_holds_off_the_main_thread():
    caught = []
    worker = threading.Thread(target=lambda: caught.append(_fault(LOOP)))
    worker.start()
    worker.join(30)
    assert not worker.is_alive() and isinstance(caught[0], BudgetExceeded)


def _fault(source: str) -> BaseException | None:
    try:
        Renderer(source, {}, "k").render(CHAT)
    except BaseException as e:  # noqa: BLE001 - handed to the test
        return e
    return None


def chat_file(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(n)))
    return path


@pytest.mark.parametrize("workers", [False, True])
def test_preparing_stops_at_the_first_budget_hit_naming_the_key(tmp_path, tok_dir, monkeypatch, workers):
    if workers:  # datasets.map in worker processes (forked: they share the short budget)
        monkeypatch.setattr(dataprep, "PARALLEL_FROM", 10)
    data = chat_file(tmp_path / "chat.jsonl", 600)
    t0 = time.monotonic()
    with pytest.raises(DataError) as e:
        prepare(part(data, "chat", chat_template=LOOP + "{{ messages[0].content }}"), str(tok_dir), tmp_path / "cache")
    # Each worker pays the budget once, not each of the 600 records.
    assert time.monotonic() - t0 < 60
    assert f"{data}:" in str(e.value) and "data.chat_template: rendering one conversation took more" in str(e.value)
    assert not any((tmp_path / "cache").iterdir())


def test_a_failing_template_names_key_file_and_line(tmp_path, tok_dir):
    data = chat_file(tmp_path / "chat.jsonl", 3)
    source = "{% for m in messages %}{{ m.content }}{% if loop.index > 4 %}{{ raise_exception('too long') }}{% endif %}" \
             "{% endfor %}"
    with pytest.raises(DataError, match=f"^{data}:1: data.chat_template: TemplateError: too long$"):
        prepare(part(data, "chat", chat_template=source), str(tok_dir), tmp_path / "cache")
    with pytest.raises(DataError, match="^data.chat_template: TemplateSyntaxError at line 1: "):
        prepare(part(data, "chat", chat_template="{% if %}"), str(tok_dir), tmp_path / "cache")
